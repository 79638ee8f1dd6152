"""Declared conversions (``fsdptk.conversions``) against torchtune's own converter: torchtune's
Llama read from a Hugging Face checkpoint through the rules docs/layouts.md declares (renames plus
the q/k RoPE permutation) holds exactly the tensors ``convert_weights.hf_to_tune`` gives, in one
process and sharded over 2 gloo ranks. The rules are the page's own code block, run here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

_PAGE = Path(__file__).resolve().parent.parent / "docs" / "layouts.md"
_HEADS, _KV_HEADS, _DIM = 4, 2, 64


def _page_rules():
    """The ``llama_hf_to_torchtune`` block of docs/layouts.md, executed."""
    text = _PAGE.read_text()
    block = re.search(r"```python\n(from fsdptk\.conversions import Conversion, Convert, Rename, Transform\n.*?)```",
                      text, re.S)
    assert block is not None, "docs/layouts.md lost its torchtune Llama block"
    ns: dict = {}
    exec(compile(block.group(1), str(_PAGE), "exec"), ns)  # noqa: S102 - the page's code is the test
    return ns["llama_hf_to_torchtune"](_HEADS, _KV_HEADS, _DIM)


def _model():
    from torchtune.models.llama3 import llama3

    return llama3(vocab_size=256, num_layers=2, num_heads=_HEADS, num_kv_heads=_KV_HEADS,
                  embed_dim=_DIM, max_seq_len=64, intermediate_dim=128)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face Llama checkpoint written by torchtune's own tune_to_hf, and what
    hf_to_tune reads back from it."""
    from safetensors.torch import save_file
    from torchtune.models import convert_weights

    torch.manual_seed(0)
    hf = convert_weights.tune_to_hf(_model().state_dict(), num_heads=_HEADS, num_kv_heads=_KV_HEADS, dim=_DIM)
    root = tmp_path_factory.mktemp("hf-llama")
    save_file({k: v.contiguous() for k, v in hf.items()}, root / "model.safetensors")
    want = convert_weights.hf_to_tune(dict(hf), num_heads=_HEADS, num_kv_heads=_KV_HEADS, dim=_DIM)
    return root, want


def test_rules_read_what_hf_to_tune_gives(hf_dir):
    from fsdptk import load_safetensors

    root, want = hf_dir
    torch.manual_seed(1)
    model = _model()
    result = load_safetensors(model, root, conversion=_page_rules())
    assert not result.missing_keys and not result.unexpected_keys
    got = model.state_dict()
    assert sorted(want) == sorted(got)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _sharded(root: str) -> dict:
    from fsdptk import gather_cpu_state_dict, load_safetensors, shard_model

    with torch.device("meta"):
        model = _model()
    shard_model(model, lambda name, m: bool(re.fullmatch(r"layers\.\d+", name)), cpu_offload=False)
    load_safetensors(model, root, conversion=_page_rules())
    return gather_cpu_state_dict(model, torch.distributed.get_rank() == 0)


def test_rules_read_per_shard_over_two_ranks(world, hf_dir):
    root, want = hf_dir
    got = world(2).run(_sharded, str(root))[0]
    for k, v in want.items():
        assert torch.equal(got[k], v), k

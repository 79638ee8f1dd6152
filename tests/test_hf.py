"""Hugging Face transformers models end to end, with the real transformers (tiny configs, random
init, nothing downloaded): meta build -> shard_model(no_split_modules) -> load (shard-on-read,
rank-0-read, broadcast of a full state dict) -> logits and 3 AdamW steps equal a single-process
reference -> save_safetensors -> from_pretrained. Plus the config files save_safetensors writes,
hf_meta_model, and ``fsdptk plan`` on a checkpoint directory (an HF-cache snapshot included).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fsdptk import save_safetensors  # noqa: E402
from fsdptk.cli import main  # noqa: E402
from fsdptk.hf import hf_meta_model, save_hf_config  # noqa: E402
from fsdptk.predicates import no_split_modules  # noqa: E402

# family -> (config class, extra config arguments). vocab 250 is not a multiple of 4: uneven shards.
FAMILIES = {
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16}),  # tied, scaled embedding, two RoPE tables
    "mistral": ("MistralConfig", {}),
    "phi3": ("Phi3Config", {}),
}
_LR, _STEPS = 1e-2, 3


def _config(family: str):
    cls, extra = FAMILIES[family]
    return getattr(transformers, cls)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=250, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **extra)


def _batch() -> torch.Tensor:
    return torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(7))


def _train(model, batch: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=_LR)
    losses = []
    for _ in range(_STEPS):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _as_hf_cache(src: Path, root: Path, family: str) -> Path:
    """The files of a save_pretrained directory laid out as the HF hub cache does: content in
    ``blobs/``, the snapshot directory holding relative symlinks to them."""
    repo = root / f"models--fsdptk--{family}"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copyfile(f, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / f.name)
    return snap


_REFS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """family -> the reference: a CPU-built model's checkpoint (save_pretrained, plain and as an HF
    cache snapshot), its logits on the batch, its losses over 3 AdamW steps."""

    def get(family: str) -> dict:
        if family not in _REFS:
            root = tmp_path_factory.mktemp(family)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(_config(family))
            model.save_pretrained(root / "src")
            batch = _batch()
            with torch.no_grad():
                logits = model(input_ids=batch).logits
            buffers = {k: b.clone() for k, b in model.named_buffers()}
            _REFS[family] = {"src": root / "src", "cache": _as_hf_cache(root / "src", root / "hub", family),
                             "logits": logits, "buffers": buffers, "losses": _train(model, batch),
                             "root": root}
        return _REFS[family]

    return get


# ---------------------------------------------------------------------------------------------
# run on every rank
def _end_to_end(family: str, src: str, mode: str, ref_logits: torch.Tensor, out: str):
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fsdptk import (
        gather_cpu_state_dict,
        load_from_full_model_state_dict,
        load_safetensors,
        save_safetensors,
        shard_model,
    )

    rank = dist.get_rank()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(family))
    plan = shard_model(model, no_split_modules(model), cpu_offload=False)
    if mode == "broadcast":
        full_sd = load_file(f"{src}/model.safetensors") if rank == 0 else {}
        res = load_from_full_model_state_dict(model, full_sd, "cpu", strict=True,
                                              broadcast_from_rank0=True)
    else:
        res = load_safetensors(model, src, shard_on_read=mode == "shard_on_read", strict=True)
    buffers = {k: b.clone() for k, b in model.named_buffers()}  # rotary tables, embed_scale
    batch = _batch()
    with torch.no_grad():
        logits_diff = (model(input_ids=batch).logits - ref_logits).abs().max().item()
    losses = _train(model, batch)
    save_safetensors(model, out)
    gathered = gather_cpu_state_dict(model, rank == 0)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return ([u.name for u in plan.units], list(res.missing_keys), list(res.unexpected_keys),
            logits_diff, losses, tied, gathered, buffers)


# (family, load mode, world size): Llama tied and untied, Qwen2 and Gemma3 in every load mode at 2
# and at 4 ranks (a warm 4-rank case takes well under a second), Mistral and Phi3 once at 2
MODES = ("shard_on_read", "rank0_read", "broadcast")
CASES = [(family, mode, n) for n in (2, 4) for family in ("llama_tied", "llama", "qwen2", "gemma3")
         for mode in MODES] + [("mistral", "shard_on_read", 2), ("phi3", "rank0_read", 2)]


@pytest.mark.parametrize("family, mode, n", CASES)
def test_meta_shard_load_train_save_from_pretrained(world, reference, tmp_path, family, mode, n):
    ref = reference(family)
    src = ref["cache"] if mode == "shard_on_read" else ref["src"]  # the HF cache's symlinks too
    results = world(n).run(_end_to_end, family, str(src), mode, ref["logits"], str(tmp_path / "out"))
    units, missing, unexpected, diff, _losses, tied, gathered, _ = results[0]
    assert units == ["model.layers.0", "model.layers.1", "<root>"]
    assert missing == [] and unexpected == []
    assert diff <= 1e-5, f"logits differ from the reference by {diff}"
    for _, _, _, d, rank_losses, _, _, buffers in results:
        assert d == diff
        torch.testing.assert_close(rank_losses, ref["losses"], rtol=0, atol=1e-5)
        assert sorted(buffers) == sorted(ref["buffers"])  # non-persistent ones as a CPU build has
        assert all(torch.equal(buffers[k], b) for k, b in ref["buffers"].items())
    assert tied == bool(_config(family).tie_word_embeddings)
    assert all(r[6] == {} for r in results[1:])

    # the file holds exactly the keys save_pretrained writes (the tied lm_head left out)
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as ours, \
            safe_open(ref["src"] / "model.safetensors", "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())
    # the directory loads as is: no missing / unexpected keys, exactly the gathered state
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert {k: sorted(v) for k, v in info.items() if k != "error_msgs"} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    sd = loaded.state_dict()
    assert sorted(sd) == sorted(gathered)
    for key, value in gathered.items():
        assert sd[key].dtype == value.dtype and torch.equal(sd[key], value), key
    # the config files are the ones save_pretrained writes for this model
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "out" / name).read_text()) == json.loads(
            (ref["src"] / name).read_text()), name
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]


# ---------------------------------------------------------------------------------------------
# single process
@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_split_modules_picks_the_decoder_layers(family):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(family))
    cond = no_split_modules(model)
    layer_cls = type(model.model.layers[0]).__name__
    assert repr(cond) == f"no_split_modules({layer_cls})"
    assert [n for n, m in model.named_modules() if n and cond(n, m)] == [
        "model.layers.0", "model.layers.1"]


def test_no_split_modules_error_for_a_model_declaring_none():
    class NoDecl(transformers.LlamaForCausalLM):
        _no_split_modules = None

    class NoDeclModel(transformers.LlamaModel):
        _no_split_modules = None

    with torch.device("meta"):
        model = NoDecl(_config("llama"))
        model.model = NoDeclModel(_config("llama"))
        model._no_split_modules = None
    with pytest.raises(ValueError, match="NoDecl declares no _no_split_modules"):
        no_split_modules(model)


def test_save_safetensors_writes_the_config_save_pretrained_writes(tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("llama_tied"))
    before = model.config.to_dict()
    save_safetensors(model, tmp_path / "ours", dtype=torch.bfloat16)
    assert model.config.to_dict() == before  # the model's own config is not modified
    model.save_pretrained(tmp_path / "hf")
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    theirs = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert ours == {**theirs, "dtype": "bfloat16"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert loaded.dtype == torch.bfloat16 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())

    save_safetensors(model, tmp_path / "weights_only", write_config=False)
    assert sorted(p.name for p in (tmp_path / "weights_only").iterdir()) == ["model.safetensors"]
    save_safetensors(torch.nn.Linear(2, 2), tmp_path / "plain")  # no HF config: weights only
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["model.safetensors"]
    assert [p.name for p in save_hf_config(model, tmp_path / "cfg")] == [
        "config.json", "generation_config.json"]
    with pytest.raises(TypeError, match="Linear carries no Hugging Face config"):
        save_hf_config(torch.nn.Linear(2, 2), tmp_path / "cfg")


def test_hf_config_finds_the_config_of_plain_and_sharded_models():
    from torch.distributed.fsdp import FSDPModule

    from fsdptk.hf import hf_config

    model = hf_meta_model(_config("qwen2"))
    assert hf_config(model) is model.config
    # fully_shard swaps the class for FSDP<Class>: the config is still found
    wrapped = type("FSDPQwen2ForCausalLM", (FSDPModule, type(model)), {})
    model.__class__ = wrapped
    assert hf_config(model) is model.config
    holder = torch.nn.Linear(2, 2)
    holder.config = {"hidden_size": 2}  # a dict is not an HF config: nothing to save
    assert hf_config(holder) is None and hf_config(torch.nn.Linear(2, 2)) is None


def test_a_failed_save_leaves_no_new_config(tmp_path, monkeypatch):
    from fsdptk._files.safetensors_writer import ShardedWriter

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("qwen2"))

    def fail(self):
        raise OSError(5, "disk on fire")

    monkeypatch.setattr(ShardedWriter, "commit", fail)
    with pytest.raises(OSError, match="disk on fire"):
        save_safetensors(model, tmp_path)
    assert list(tmp_path.iterdir()) == []  # no config, no staged file, no weights
    monkeypatch.undo()

    model.config.temperature = 0.3  # transformers refuses generation parameters in the config
    with pytest.raises(ValueError, match="generation parameters"):
        save_safetensors(model, tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before any tensor moved


def test_the_config_is_committed_under_the_directory_lock(tmp_path, monkeypatch):
    # a second writer must not interleave between the weights commit and the config rename
    from fsdptk._files.hf_config import StagedConfig
    from fsdptk._files.safetensors_writer import LOCK_NAME

    seen = []
    original = StagedConfig.commit

    def commit(self):
        seen.append((self.directory / LOCK_NAME).exists())
        return original(self)

    monkeypatch.setattr(StagedConfig, "commit", commit)
    model = transformers.AutoModelForCausalLM.from_config(_config("qwen2"))
    save_safetensors(model, tmp_path)
    assert seen == [True]
    assert (tmp_path / "config.json").exists() and not (tmp_path / LOCK_NAME).exists()


def test_hf_meta_model_from_dirs_files_and_configs(reference):
    ref = reference("gemma3")
    for source in (ref["src"], ref["cache"], ref["src"] / "config.json", _config("gemma3")):
        model = hf_meta_model(source)
        assert type(model).__name__ == "Gemma3ForCausalLM"
        assert {p.device.type for p in model.parameters()} == {"meta"}
    deeper = hf_meta_model(ref["src"], num_hidden_layers=3)  # per-layer config lists follow
    assert len(deeper.model.layers) == 3 and len(deeper.config.layer_types) == 3
    assert hf_meta_model(ref["src"], dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf_meta_model(ref["root"])
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        hf_meta_model(ref["root"] / "nope")
    with pytest.raises(ValueError, match="need a path source"):
        hf_meta_model(_config("gemma3"), num_hidden_layers=1)


def test_docstring_examples():
    import doctest

    import fsdptk.hf
    import fsdptk.predicates

    result = doctest.testmod(fsdptk.hf, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 4, result
    globs = {"nn": torch.nn, "no_split_modules": no_split_modules}
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(fsdptk.predicates.no_split_modules, globs=globs):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


# ---------------------------------------------------------------------------------------------
# fsdptk plan DIR
def test_plan_on_a_checkpoint_directory(reference, capsys):
    from fsdptk import describe_sharding

    ref = reference("qwen2")
    for source in (ref["src"], ref["cache"]):
        assert main(["plan", str(source), "--world-size", "4"]) == 0
        out = capsys.readouterr().out
        model = hf_meta_model(source)
        assert out.strip() == str(describe_sharding(model, no_split_modules(model), world_size=4)).strip()
        assert "no_split_modules(Qwen2DecoderLayer)" in out and "model.layers.1" in out

    assert main(["plan", str(ref["src"]), "--world-size", "2", "--dtype", "bfloat16",
                 "--kwargs", '{"num_hidden_layers": 3}', "--glob", "model.embed_tokens"]) == 0
    out = capsys.readouterr().out
    model = hf_meta_model(ref["src"], dtype=torch.bfloat16, num_hidden_layers=3)
    expected = describe_sharding(model, [no_split_modules(model), _glob("model.embed_tokens")],
                                 world_size=2)
    assert out.strip() == str(expected).strip() and "model.layers.2" in out


def _glob(pattern):
    from fsdptk.predicates import by_glob

    return by_glob(pattern)


@pytest.mark.parametrize("make, message", [
    (lambda d: d, "has no config.json"),
    (lambda d: (d / "config.json").write_text("{oops") and d, "config.json"),
    (lambda d: (d / "config.json").write_text('{"model_type": "no_such_arch"}') and d, "no_such_arch"),
])
def test_plan_on_a_bad_directory_is_a_one_line_error(tmp_path, capsys, make, message):
    path = make(tmp_path)
    assert main(["plan", str(path), "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fsdptk plan: error:") and message in err and err.count("\n") == 1


def test_plan_dtype_applies_to_factories_too(capsys, monkeypatch):
    from fsdptk import describe_sharding, get_shard_conditions

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    assert main(["plan", "examples.llama:tiny", "--world-size", "2", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    monkeypatch.syspath_prepend(str(Path.cwd()))
    from examples.llama import tiny

    with torch.device("meta"):
        model = tiny().to(torch.bfloat16)
    assert out.strip() == str(describe_sharding(model, [get_shard_conditions], world_size=2)).strip()
    assert main(["plan", "no_colon", "--world-size", "2"]) == 1
    assert "or be a Hugging Face checkpoint directory" in capsys.readouterr().err

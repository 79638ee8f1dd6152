"""Shared helpers for the torchtune parity tests: the swap, tiny torchtune models, comparisons.

Everything here runs inside the peers environment (``.venv-peers``: torchtune 0.6.1, torchao 0.14.1,
editable fsdptk). Functions that run on the ranks of a ``world`` live in the test modules; the ones
here are plain helpers they call.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

# Every public name fsdptk shares with ``torchtune.training`` (0.6.1). test_tt_signatures checks
# this list against both packages, so a name that becomes shared must be added here (and tested).
SHARED = (
    "gather_cpu_state_dict",
    "get_distributed_backend",
    "get_full_optimizer_state_dict",
    "get_shard_conditions",
    "get_world_size_and_rank",
    "is_distributed",
    "load_from_full_model_state_dict",
    "load_from_full_optimizer_state_dict",
    "prepare_mha_for_tp",
    "set_torch_num_threads",
    "shard_model",
    "validate_no_params_on_meta_device",
)

# A tiny Llama-2 LoRA model from torchtune's own component builder. NF4 needs every weight's
# element count (and each rank's half of it) divisible by block_size * scaler_block_size
# (64 * 256), hence 256-wide projections for the QLoRA variant.
LORA_KWARGS: dict[str, Any] = dict(
    lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
    apply_lora_to_mlp=True,
    apply_lora_to_output=False,
    vocab_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=32,
    max_seq_len=16,
    intermediate_dim=64,
    lora_rank=4,
    lora_alpha=8.0,
)
QLORA_KWARGS: dict[str, Any] = {
    **LORA_KWARGS, "num_kv_heads": 4, "embed_dim": 256, "intermediate_dim": 512,
    "quantize_base": True,
}


@contextlib.contextmanager
def fsdptk_in_torchtune() -> Iterator[None]:
    """Make ``torchtune.training.<name>`` (and ``torchtune.training._distributed.<name>``) be
    fsdptk's function for every shared name, as a user's ``from fsdptk import ...`` would; restore
    torchtune's on exit (the world's processes are reused by later tests)."""
    import fsdptk

    mods = [importlib.import_module("torchtune.training"),
            importlib.import_module("torchtune.training._distributed")]
    saved = [(m, n, getattr(m, n)) for m in mods for n in SHARED if hasattr(m, n)]
    try:
        for m, n, _ in saved:
            setattr(m, n, getattr(fsdptk, n))
        yield
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)


def lora_model(device: str | torch.device, *, quantize: bool = False,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """torchtune's ``lora_llama2`` (tiny), adapters trainable and the base frozen, as its recipes
    set it up (``set_trainable_params(model, get_adapter_params(model))``)."""
    from torchtune.models.llama2 import lora_llama2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    from torchtune.training import set_default_dtype

    with set_default_dtype(dtype), torch.device(device):
        model = lora_llama2(**(QLORA_KWARGS if quantize else LORA_KWARGS))
    set_trainable_params(model, get_adapter_params(model))
    return model


def random_full_state_dict(quantize: bool = False, seed: int = 0,
                           dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A full state dict for :func:`lora_model` with every entry random (LoRA B included, which
    torchtune initialises to zero), the same on every rank for a given seed."""
    model = lora_model("cpu", quantize=quantize, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        if type(v).__name__ == "NF4Tensor":
            v = v.get_original_weight()
        out[k] = (torch.randn(v.shape, generator=gen) * 0.1).to(v.dtype)
    return out


def split(sd: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(base, adapter)`` as torchtune's checkpoints split them (``get_adapter_state_dict``)."""
    adapter = {k: v for k, v in sd.items() if "lora" in k or "magnitude" in k}
    return {k: v for k, v in sd.items() if k not in adapter}, adapter


def rope_init(model: nn.Module) -> None:
    """What torchtune's recipes do for the non-persistent RoPE cache of a meta-built model."""
    for m in model.modules():
        if hasattr(m, "rope_init"):
            m.rope_init()


def _leaf(t: Any) -> Any:
    """A comparable view of one value: DTensors by placements and local shard, NF4 by its
    inner tensors (quantised data and scalers), plain tensors as they are."""
    desc: list[Any] = []
    if hasattr(t, "to_local"):
        desc.append(("dtensor", tuple(t.placements), tuple(t.device_mesh.mesh.tolist()),
                     tuple(t.shape)))
        t = t.to_local()
    if type(t).__name__ == "NF4Tensor":
        from fsdptk.nf4 import inner_tensors, nf4_block_sizes

        desc.append(("nf4", nf4_block_sizes(t), tuple(t.shape)))
        return desc, [x.detach() for x in inner_tensors(t)]
    return desc, [t.detach()] if isinstance(t, torch.Tensor) else t


def same(a: Any, b: Any) -> bool:
    """Bit-identical: same structure, key order, types, dtypes, shapes, placements and bytes."""
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and list(a) == list(b)
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        (da, ta), (db, tb) = _leaf(a), _leaf(b)
        return da == db and len(ta) == len(tb) and all(
            x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
            and torch.equal(x, y) for x, y in zip(ta, tb))
    return a == b


def diff_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Keys whose values are not :func:`same` (keys present in one only included); ``[]`` when
    the two mappings are bit-identical, key order included."""
    bad = [k for k in a if k not in b or not same(a[k], b[k])]
    bad += [k for k in b if k not in a]
    if not bad and list(a) != list(b):
        bad = ["<key order>"]
    return bad


def param_facts(model: nn.Module) -> dict[str, tuple[Any, ...]]:
    """What a training loop observes of each parameter besides its values."""
    return {n: (type(p).__name__, p.requires_grad, p.dtype, tuple(p.shape), p.device.type)
            for n, p in model.named_parameters()}

"""Fresh PEFT adapters of a (sharded) model: PEFT's own LoRA initialisation replayed on CPU at the
full shapes, for :func:`fsdptk.hf.init_adapters` to distribute with one load.

PEFT's own initialisation, replayed: for each LoRA layer in the order ``get_peft_model`` creates
them (adapters in ``peft_config`` order; per adapter, the ``target_modules`` layers in module
order, then the ``target_parameters`` wrappers, the innermost of a nested chain first, as PEFT's
``_inject_parameters`` nests them), the two ``nn.Linear`` of PEFT's ``update_layer`` are built
(their constructors draw from the generator, as PEFT's do) and handed to the layer's own
``reset_lora_parameters``. From ``torch.manual_seed(seed)`` the values are those of
``get_peft_model(base, config)`` in one process after the same seed. Only what needs no base
weight: LoRA factors of ``nn.Linear`` form (``lora_A`` / ``lora_B``, their bias),
``init_lora_weights`` True, False or ``"gaussian"``; the rest (DoRA's magnitude, PiSSA, embedding
LoRA, other tuners) is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdptk._plans.peft import adapter_file_names, require_adapter

__all__ = ["FRESH_INITS", "fresh_adapter_plan", "fresh_adapter_state", "fresh_keys"]

FRESH_INITS = (True, False, "gaussian")


def _fresh_order(model: nn.Module, adapter: str) -> list[tuple[str, Any]]:
    """``(fqn, layer)`` of the LoRA layers holding ``adapter``, in PEFT's creation order."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    layers = [(n, m) for n, m in model.named_modules()
              if isinstance(m, LoraLayer) and adapter in getattr(m, "lora_A", {})]
    plain = [(n, m) for n, m in layers if not isinstance(m, ParamWrapper)]
    wrapped = [(n, m) for n, m in layers if isinstance(m, ParamWrapper)]
    inner = {id(m.base_layer) for _, m in wrapped}
    chains = []
    for name, mod in wrapped:
        if id(mod) in inner:
            continue  # not the outermost of its chain
        chain = [(name, mod)]
        while isinstance(chain[-1][1].base_layer, ParamWrapper):
            chain.append((f"{chain[-1][0]}.base_layer", chain[-1][1].base_layer))
        chains.extend(reversed([c for c in chain if adapter in c[1].lora_A]))
    return plain + chains


def fresh_adapter_plan(model: nn.Module, adapter_names: list[str]) -> list[tuple[str, Any, str, Any]]:
    """``(layer fqn, layer, adapter, init_lora_weights)`` to initialise, in PEFT's creation order,
    checked first (nothing changes).

    Raises:
        TypeError / KeyError: see :func:`require_adapter`.
        NotImplementedError: an adapter tensor that is not a LoRA factor of ``nn.Linear`` form, or
            an ``init_lora_weights`` that needs the base weights (names the key or the value).
        ValueError: a sharded model whose adapter tensors no FSDP unit manages (``get_peft_model``
            after ``shard_model``; names the key, its shape and the full shape).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    plan: list[tuple[str, Any, str, Any]] = []
    unmanaged: list[tuple[str, torch.Tensor, Any, str, str]] = []
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    for adapter in adapter_names:
        config = require_adapter(model, adapter)
        init = getattr(config, "init_lora_weights", None)
        if not any(init is v or init == v for v in FRESH_INITS):
            raise NotImplementedError(
                f"adapter {adapter!r}: init_lora_weights={init!r} needs the base weights; fresh "
                f"adapters are initialised with {list(FRESH_INITS)} (load a saved adapter instead)")
        layers = _fresh_order(model, adapter)
        covered = set()
        for name, layer in layers:
            prefix = f"{name}." if name else ""
            for part in ("lora_A", "lora_B"):
                for pname, p in getattr(layer, part)[adapter].named_parameters():
                    fqn = f"{prefix}{part}.{adapter}.{pname}"
                    covered.add(fqn)
                    if sharded and not isinstance(p, DTensor):
                        unmanaged.append((fqn, p, layer, part, adapter))
            plan.append((name, layer, adapter, init))
        if unmanaged:  # the first whose shape is wrong, else the first
            notes = [_unmanaged(*u) for u in unmanaged]
            raise ValueError(next((n for n in notes if "full shape" in n), notes[0])
                             + f" ({len(unmanaged)} adapter tensors are unmanaged)")
        left = sorted(set(adapter_file_names(model, adapter, embeddings=False).values()) - covered)
        if left:
            raise NotImplementedError(
                f"adapter {adapter!r}: {left[:5]} are not LoRA factors of nn.Linear form (DoRA's "
                "magnitude, embedding LoRA, another tuner); fresh adapters cannot initialise them: "
                "load a saved adapter with load_adapter")
    return plan


def _unmanaged(fqn: str, p: torch.Tensor, layer: Any, part: str, adapter: str) -> str:
    base = getattr(layer.get_base_layer(), "weight", None)
    want = ""
    if base is not None and base.ndim == 2 and not hasattr(layer, "parameter_name"):
        r = layer.r[adapter]
        full = (r, base.shape[1]) if part == "lora_A" else (base.shape[0], r)
        if tuple(p.shape) != full:
            want = f"; the base layer's full shape {list(base.shape)} gives {list(full)}"
    return (f"adapter tensor {fqn!r} (shape {list(p.shape)}{want}) is a plain tensor of a sharded "
            "model that no FSDP unit manages: peft.get_peft_model ran after shard_model, so each rank "
            "would train its own copy (PEFT sizes LoRA from the local shard unless the mesh dim is "
            "named 'fsdp'). Call get_peft_model on the meta-built model before shard_model, then "
            "fsdptk.hf.init_adapters after the base load")


def fresh_adapter_state(plan: list[tuple[str, Any, str, Any]], seed: int) -> dict[str, torch.Tensor]:
    """``{model fqn: full CPU tensor}`` of every adapter tensor of ``plan``, PEFT's own init replayed
    from ``seed`` in a forked generator (the caller's RNG state is untouched)."""
    out: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, layer, adapter, init in plan:
            old_a, old_b = layer.lora_A[adapter], layer.lora_B[adapter]
            a = nn.Linear(old_a.weight.shape[1], old_a.weight.shape[0], bias=old_a.bias is not None)
            b = nn.Linear(old_b.weight.shape[1], old_b.weight.shape[0], bias=old_b.bias is not None)
            layer.lora_A[adapter], layer.lora_B[adapter] = a, b
            try:
                if init is not False:
                    layer.reset_lora_parameters(adapter, init)
            finally:
                layer.lora_A[adapter], layer.lora_B[adapter] = old_a, old_b
            prefix = f"{name}." if name else ""
            for part, mod, old in (("lora_A", a, old_a), ("lora_B", b, old_b)):
                for pname, p in mod.named_parameters():
                    out[f"{prefix}{part}.{adapter}.{pname}"] = p.detach().to(getattr(old, pname).dtype)
    return out



def fresh_keys(plan: list[tuple[str, Any, str, Any]]) -> list[str]:
    """The model fqns :func:`fresh_adapter_state` fills, in its order (every rank alike)."""
    return [f"{name}.{part}.{adapter}.{pname}" if name else f"{part}.{adapter}.{pname}"
            for name, layer, adapter, _ in plan for part in ("lora_A", "lora_B")
            for pname, _ in getattr(layer, part)[adapter].named_parameters()]

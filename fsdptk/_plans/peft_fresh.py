"""Fresh PEFT adapters of a (sharded) model: PEFT's own LoRA initialisation replayed on CPU at the
full shapes, for :func:`fsdptk.hf.init_adapters` to distribute with one load.

PEFT's own initialisation, replayed: for each LoRA layer in the order ``get_peft_model`` creates
them (adapters in ``peft_config`` order; per adapter, the ``target_modules`` layers in module
order, and the ``target_parameters`` wrappers, the innermost of a nested chain first, as PEFT's
``_inject_parameters`` nests them: the layers first with PEFT 0.21, the wrappers first from 0.22), the two ``nn.Linear`` of PEFT's ``update_layer`` are built
(their constructors draw from the generator, as PEFT's do) and handed to the layer's own
``reset_lora_parameters``. From ``torch.manual_seed(seed)`` the values are those of
``get_peft_model(base, config)`` in one process after the same seed. Only what needs no base
weight: LoRA factors of ``nn.Linear`` form (``lora_A`` / ``lora_B``, their bias),
``init_lora_weights`` True, False or ``"gaussian"``; the rest (DoRA's magnitude, PiSSA, embedding
LoRA, other tuners) is refused by name.

Adapters attached after ``shard_model`` (plain per-rank Parameters, maybe at the local shard's
shape): :func:`attach_plan` checks them and :func:`attach_units` makes each LoRA factor of an
``nn.Linear`` layer an FSDP unit of its own at its full shape, on the mesh and policies of the base
layer's unit, before the values are built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdptk._plans.peft import adapter_file_names, require_adapter

__all__ = ["FRESH_INITS", "attach_plan", "attach_units", "fresh_adapter_plan", "fresh_adapter_state",
           "fresh_keys"]

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
    # PEFT 0.22's inject_adapter checks every target first and then creates the target_parameters
    # wrappers before the target_modules layers; 0.21 created the layers first
    return chains + plain if _peft_release() >= (0, 22) else plain + chains


def _peft_release() -> tuple[int, int]:
    """The installed PEFT's (major, minor)."""
    from importlib.metadata import version

    major, minor = (version("peft").split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def fresh_adapter_plan(model: nn.Module, adapter_names: list[str]) -> list[tuple[str, Any, str, Any]]:
    """``(layer fqn, layer, adapter, init_lora_weights)`` to initialise, in PEFT's creation order,
    checked first (nothing changes).

    Raises:
        TypeError / KeyError: see :func:`require_adapter`.
        NotImplementedError: an adapter tensor that is not a LoRA factor of ``nn.Linear`` form, or
            an ``init_lora_weights`` that needs the base weights (names the key or the value).
    """
    plan: list[tuple[str, Any, str, Any]] = []
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
                for pname, _ in getattr(layer, part)[adapter].named_parameters():
                    fqn = f"{prefix}{part}.{adapter}.{pname}"
                    covered.add(fqn)
            plan.append((name, layer, adapter, init))
        left = sorted(set(adapter_file_names(model, adapter, embeddings=False).values()) - covered)
        if left:
            raise NotImplementedError(
                f"adapter {adapter!r}: {left[:5]} are not LoRA factors of nn.Linear form (DoRA's "
                "magnitude, embedding LoRA, another tuner); fresh adapters cannot initialise them: "
                "load a saved adapter with load_adapter")
    return plan


def _unit_of(model: nn.Module, fqn: str) -> Any:
    """The FSDP unit whose parameters include the module at ``fqn``: its nearest ``FSDPModule``
    ancestor, itself included (``None`` if none)."""
    from torch.distributed.fsdp import FSDPModule

    parts = fqn.split(".") if fqn else []
    for i in range(len(parts), -1, -1):
        mod = model.get_submodule(".".join(parts[:i]))
        if isinstance(mod, FSDPModule):
            return mod
    return None


def _ran_forward(model: nn.Module) -> bool:
    """Whether FSDP2's lazy init ran (the root's first forward collected the model's units)."""
    from torch.distributed.fsdp import FSDPModule

    return any(m._get_fsdp_state()._is_root is not None
               for m in model.modules() if isinstance(m, FSDPModule))


def attach_plan(model: nn.Module, plan: list[tuple[str, Any, str, Any]]
                ) -> list[tuple[str, Any, str, dict[str, Any]]]:
    """``(layer fqn, layer, adapter, fully_shard kwargs)`` of the LoRA layers of ``plan`` whose
    factors no FSDP unit manages (``get_peft_model`` ran after ``shard_model``), checked first
    (nothing changes): each pair of factors becomes two FSDP units of their own at the full shapes,
    on the mesh and policies of the base layer's unit (see :func:`attach_units`).

    Raises:
        ValueError: the model already ran a forward (FSDP2's lazy init collected its units at the
            root's first forward; a unit added now would never be reduced), or a LoRA layer whose
            base layer no FSDP unit manages; names the key.
        NotImplementedError: LoRA on parameters (``target_parameters``, PEFT's ``ParamWrapper``),
            a base layer that is not an ``nn.Linear`` or whose weight is not sharded by its unit
            alone (tensor parallel); names the key.
    """
    from peft.tuners.lora.layer import ParamWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return []
    out: list[tuple[str, Any, str, dict[str, Any]]] = []
    for name, layer, adapter, _ in plan:
        params = [(f"{name}.{part}.{adapter}.{pname}" if name else f"{part}.{adapter}.{pname}", p)
                  for part in ("lora_A", "lora_B")
                  for pname, p in getattr(layer, part)[adapter].named_parameters()]
        plain = [(fqn, p) for fqn, p in params if not isinstance(p, DTensor)]
        if not plain:
            continue
        fqn, p = plain[0]
        where = f"adapter tensor {fqn!r} (shape {list(p.shape)}) is a plain tensor of a sharded model"
        if _ran_forward(model):
            raise ValueError(
                f"{where}, and the model already ran a forward: FSDP2 collected its units at the "
                "root's first forward, so init_adapters cannot make the adapters FSDP units (their "
                "gradients would never be reduced). Call peft.get_peft_model and init_adapters "
                "before the first forward")
        if isinstance(layer, ParamWrapper):
            raise NotImplementedError(
                f"{where}: LoRA on parameters (target_parameters, PEFT's ParamWrapper) attached after "
                "shard_model cannot be made FSDP-managed (its factors are not FSDP units of their "
                "own, peft#3080). Call peft.get_peft_model on the meta-built model before "
                "shard_model, then init_adapters after the base load")
        base = layer.get_base_layer()
        weight = getattr(base, "weight", None)
        if not isinstance(base, nn.Linear) or weight is None or weight.ndim != 2:
            raise NotImplementedError(
                f"{where}: its base layer is a {type(base).__name__}, and only LoRA on nn.Linear "
                "layers attached after shard_model is made FSDP-managed; call peft.get_peft_model "
                "before shard_model")
        base_fqn = f"{name}.base_layer" if name else "base_layer"
        unit = _unit_of(model, base_fqn)
        state = unit._get_fsdp_state() if unit is not None else None
        group = state._fsdp_param_group if state is not None else None
        if state is None or group is None:
            raise ValueError(f"{where}: no FSDP unit manages its base layer {base_fqn!r}; shard it "
                             "with shard_model (or call peft.get_peft_model before shard_model)")
        mesh = group.mesh_info.mesh
        if not isinstance(weight, DTensor) or weight.device_mesh != mesh:
            raise NotImplementedError(
                f"{where}: its base layer's weight is not sharded by its FSDP unit's mesh alone "
                "(tensor parallel, or a parameter FSDP ignores); call peft.get_peft_model before "
                "apply_tp / shard_model")
        out.append((name, layer, adapter, {
            "mesh": mesh, "reshard_after_forward": group.post_forward_mesh_info is not None,
            # the unit's policy: its group's in torch 2.13; torch 2.15 keeps it on the state only
            "mp_policy": getattr(group, "mp_policy", None) or state._mp_policy,
            "offload_policy": group.offload_policy}))
    return out


def attach_units(attach: list[tuple[str, Any, str, dict[str, Any]]]) -> None:
    """Replace each factor of ``attach`` by an ``nn.Linear`` on ``meta`` at its full shape
    (``lora_A``: ``(r, in_features)``, ``lora_B``: ``(out_features, r)`` of the base layer's full
    weight; bias, dtype and ``requires_grad`` kept) and ``fully_shard`` it with its kwargs: an FSDP
    unit of its own, sharded and reduced as the base layer's unit is."""
    from torch.distributed.fsdp import fully_shard

    for _, layer, adapter, kwargs in attach:
        out_f, in_f = layer.get_base_layer().weight.shape
        r = layer.r[adapter]
        for part, shape in (("lora_A", (r, in_f)), ("lora_B", (out_f, r))):
            old = getattr(layer, part)[adapter]
            new = nn.Linear(shape[1], shape[0], bias=old.bias is not None, device="meta",
                            dtype=old.weight.dtype)
            for pname, p in new.named_parameters():
                p.requires_grad_(getattr(old, pname).requires_grad)
            fully_shard(new, **kwargs)
            getattr(layer, part)[adapter] = new


def fresh_adapter_state(plan: list[tuple[str, Any, str, Any]], seed: int) -> dict[str, torch.Tensor]:
    """``{model fqn: full CPU tensor}`` of every adapter tensor of ``plan``, PEFT's own init replayed
    from ``seed``.

    The tensors are built on CPU (whatever the default device), so PEFT's init draws from the CPU
    generator only: that one is
    seeded as ``torch.manual_seed(seed)`` seeds it (the values are those of ``get_peft_model``
    after ``torch.manual_seed(seed)``) inside ``fork_rng``, which puts its state back after. No
    other generator is seeded or drawn from (not ``torch.manual_seed``: it also reseeds every
    CUDA / accelerator generator), so the caller's RNG state, CPU and every device's, is as it was.
    """
    out: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        for name, layer, adapter, init in plan:
            old_a, old_b = layer.lora_A[adapter], layer.lora_B[adapter]
            # on CPU whatever the default device (torch.set_default_device, a device context)
            a = nn.Linear(old_a.weight.shape[1], old_a.weight.shape[0], bias=old_a.bias is not None, device="cpu")
            b = nn.Linear(old_b.weight.shape[1], old_b.weight.shape[0], bias=old_b.bias is not None, device="cpu")
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

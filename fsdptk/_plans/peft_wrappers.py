"""PEFT's ``ParamWrapper`` (LoRA on a parameter, ``target_parameters``: e.g. the fused experts of a
transformers 5 MoE model) and the rules fsdptk keeps around it: the LoRA factors a wrapper reads
without calling them stay in their wrapper's FSDP unit (peft#3080), and under expert parallelism
the factors are sharded with the experts (:func:`shard_ep_factors`) and computed on the local
experts (:class:`local_factors`).

Design note (LoRA on the experts under EP). PEFT 0.21 stores an experts ``ParamWrapper``'s factors
as ``A = lora_A.weight (r * E, in)``, read as ``A.reshape(E, r, in)`` (expert ``e``'s ``r`` rows
contiguous), and ``B = lora_B.weight (out, r * E)``, read as ``B.reshape(out, r, E)`` (expert ``e``'s
columns ``e, E + e, 2E + e, ...``: strided). With each ``ep`` rank holding a contiguous range of
``L = E / ep`` experts, its blocks are ``Shard(0)`` of A and ``_StridedShard(1, split_factor=r)`` of
B over the ``ep`` mesh (torch's placement: the columns cut into ``r`` groups of ``E``, each group
``Shard``-ed), and the local tensors are exactly PEFT's layout for ``L`` experts: ``(r * L, in)``
and ``(out, r * L)``. So the forward runs PEFT's own code on local tensors with the wrapper's
``num_experts`` set to ``L`` for the call; nothing mixes Tensor and DTensor, and the engine gathers,
saves and loads the factors through DTensor's own placement math like any other DTensor.

Design note (DCP). torch 2.13's DCP describes a DTensor's local data as one box per rank, computed
as if every placement were a plain ``Shard``; the ``ep`` block of B is ``r`` column ranges, not one,
so DCP plans overlapping boxes and refuses the save ("Failed to validate global plan: ... overlapping
chunks"), and on load would read the wrong columns. :func:`dcp_factor_views` hands DCP every experts
B factor (and its optimizer state) as the 3-D view ``(out, r, E)`` of the same bytes, where each
rank's block is one box: ``_StridedShard(1, r)`` becomes ``Shard(2)``, a dim-0 shard stays. The view
shares the parameter's storage, so DCP's load writes into the model in place. A checkpoint then
holds these factors as ``(out, r, E)`` whatever the EP degree it was saved at, and loads at any
other (ep=1 included).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdptk._core.compat import StridedShard
from fsdptk._plans.ep_styles import local_view
from fsdptk._plans.peft import peft_configs

__all__ = ["check_ep_factors", "dcp_factor_views", "ep_lora_order", "ep_lora_tp", "experts_b_factors",
           "local_factors", "param_wrapped", "read_not_called", "restore_factors", "shard_ep_factors",
           "wrapper_chains"]


def read_not_called(model: nn.Module) -> dict[int, tuple[str, str]]:
    """``{id(module): (module fqn, wrapper fqn)}`` of the modules whose parameters a PEFT
    ``ParamWrapper`` (LoRA on a parameter: ``target_parameters``, e.g. fused MoE experts) reads
    without calling them: its ``lora_A`` / ``lora_B`` and their per-adapter ``nn.Linear``. FSDP2
    gathers a unit's parameters in the unit's forward hook, which never runs for these, so such a
    module cannot be an FSDP unit of its own (the wrapper would read sharded factors: peft#3080).
    Empty for a model without PEFT adapters."""
    if peft_configs(model) is None:
        return {}
    from peft.tuners.lora.layer import ParamWrapper

    out: dict[int, tuple[str, str]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, ParamWrapper):
            for part in ("lora_A", "lora_B"):
                holder = getattr(mod, part)
                out[id(holder)] = (f"{name}.{part}", name)
                for adapter, sub in holder.items():
                    out[id(sub)] = (f"{name}.{part}.{adapter}", name)
    return out


def param_wrapped(model: nn.Module) -> dict[int, tuple[str, list[str]]]:
    """``{id(module): (outermost wrapper fqn, wrapped parameter names)}`` of every module whose
    parameters PEFT ``ParamWrapper`` s wrap (LoRA on parameters, ``target_parameters``). Empty for
    a model without PEFT adapters."""
    if peft_configs(model) is None:
        return {}
    from peft.tuners.lora.layer import ParamWrapper

    out: dict[int, tuple[str, list[str]]] = {}
    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    for name, mod in model.named_modules():
        if isinstance(mod, ParamWrapper) and id(mod) not in inner:
            params: list[str] = []
            base: nn.Module = mod
            while isinstance(base, ParamWrapper):
                params.append(base.parameter_name)
                base = base.base_layer
            out[id(base)] = (name, sorted(params))
    return out


def wrapper_chains(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """``{id(module): [(fqn, wrapper), ...]}``: the PEFT ``ParamWrapper`` s around each module whose
    parameters they wrap, outermost first. Empty for a model without PEFT adapters."""
    if peft_configs(model) is None:
        return {}
    from peft.tuners.lora.layer import ParamWrapper

    out: dict[int, list[tuple[str, nn.Module]]] = {}
    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    for name, mod in model.named_modules():
        if isinstance(mod, ParamWrapper) and id(mod) not in inner:
            chain: list[tuple[str, nn.Module]] = []
            base: nn.Module = mod
            while isinstance(base, ParamWrapper):
                chain.append((name + ".base_layer" * len(chain), base))
                base = base.base_layer
            out[id(base)] = chain
    return out


def _factors(wrapper: Any) -> list[tuple[str, str, nn.Module, int]]:
    """``(adapter, "lora_A" | "lora_B", the factor's nn.Linear, r)`` of every adapter of ``wrapper``."""
    return [(a, part, getattr(wrapper, part)[a], int(wrapper.r[a]))
            for a in wrapper.lora_A for part in ("lora_A", "lora_B")]


def check_ep_factors(chain: list[tuple[str, nn.Module]], experts: int, ep: int) -> None:
    """Validate the LoRA factors of an experts module's ``ParamWrapper`` s for expert parallelism
    over ``ep`` ranks (``ep`` divides ``experts``: checked before). Changes nothing.

    Raises:
        ValueError: a wrapper's ``num_experts`` is not the module's count, or a factor does not hold
            ``r * experts`` on its experts dim (names the key and both shapes); a factor is already
            a DTensor.
        NotImplementedError: one expert per rank (PEFT 0.21's ``ParamWrapper`` computes a
            1-expert delta as a 2-D weight), or a LoRA bias.
    """
    local = experts // ep
    for fqn, wrapper in chain:
        n = getattr(wrapper, "num_experts", None)
        if n != experts:
            raise ValueError(f"PEFT ParamWrapper '{fqn}' ({wrapper.parameter_name}) was built for "
                             f"num_experts={n}, its experts module holds {experts}")
        if local < 2:
            raise NotImplementedError(
                f"LoRA on the experts under expert parallelism needs at least 2 experts per rank: "
                f"ep ({ep}) leaves {local} of the {experts} experts of '{fqn}' on each rank, and "
                "PEFT 0.21's ParamWrapper computes a 1-expert delta as a 2-D weight; use a smaller ep")
        for adapter, part, linear, r in _factors(wrapper):
            w = linear._parameters["weight"]
            assert w is not None
            key = f"{fqn}.{part}.{adapter}.weight"
            if isinstance(w, DTensor):
                raise ValueError(f"LoRA factor '{key}' is already a DTensor ({w.placements}): apply "
                                 "expert parallelism to the unsharded PEFT model")
            if getattr(linear, "bias", None) is not None:
                raise NotImplementedError(f"LoRA factor '{fqn}.{part}.{adapter}' has a bias: LoRA "
                                          "on the experts under expert parallelism takes none")
            dim = 0 if part == "lora_A" else 1
            if w.dim() != 2 or w.shape[dim] != r * experts:
                raise ValueError(
                    f"LoRA factor '{key}' has shape {list(w.shape)}: dim {dim} must be r * experts "
                    f"= {r} * {experts} = {r * experts} to be cut to each rank's experts")


def shard_ep_factors(chain: list[tuple[str, nn.Module]], ep_mesh: DeviceMesh) -> None:
    """Make every LoRA factor of the wrappers a DTensor over ``ep_mesh`` holding this rank's experts'
    blocks: A ``Shard(0)``, B ``_StridedShard(1, split_factor=r)`` (see the module's design note).
    After :func:`check_ep_factors`; ``meta`` is fine."""
    for _, wrapper in chain:
        for _, part, linear, r in _factors(wrapper):
            w = linear._parameters["weight"]
            assert w is not None
            placement = Shard(0) if part == "lora_A" else StridedShard(1, split_factor=r)
            linear.register_parameter("weight", nn.Parameter(
                distribute_tensor(w, ep_mesh, [placement], src_data_rank=0),
                requires_grad=w.requires_grad))


class local_factors:  # noqa: N801 - used as a context manager
    """For one call of the wrappers' forward on the local experts: every LoRA factor swapped for its
    local tensor (its gradient multiplied by ``scale``, the experts' gradient scale) and each
    wrapper's ``num_experts`` set to ``local``; all restored on exit."""

    def __init__(self, chain: list[tuple[str, nn.Module]], local: int, scale: float) -> None:
        self.chain = chain
        self.local = local
        self.scale = scale
        self.saved: list[tuple[nn.Module, Any]] = []
        self.counts: list[tuple[nn.Module, Any]] = []

    def __enter__(self) -> None:
        for _, wrapper in self.chain:
            self.counts.append((wrapper, getattr(wrapper, "num_experts")))  # noqa: B009
            setattr(wrapper, "num_experts", self.local)  # noqa: B010
            for _, _, linear, _ in _factors(wrapper):
                w = linear._parameters["weight"]
                if isinstance(w, DTensor):
                    self.saved.append((linear, w))
                    linear._parameters["weight"] = local_view(w, self.scale)

    def __exit__(self, *exc: object) -> None:
        for linear, w in self.saved:
            linear._parameters["weight"] = w
        for wrapper, n in self.counts:
            setattr(wrapper, "num_experts", n)  # noqa: B010
        self.saved, self.counts = [], []


def ep_lora_order(wrapper: str, params: list[str], experts: str) -> str:
    """The message refusing an expert-parallel experts module that PEFT wrapped afterwards."""
    return (f"PEFT's ParamWrapper '{wrapper}' (target_parameters {params}) wraps experts module "
            f"'{experts}', which was made expert-parallel before PEFT wrapped it: its LoRA factors "
            "were sized and placed without the experts' sharding. Call peft.get_peft_model before "
            "fsdptk.apply_ep (apply_ep then shards the factors with the experts)")


def ep_lora_tp(wrapper: str, params: list[str], experts: str) -> str:
    """The message refusing LoRA on the experts under expert parallelism with tensor parallelism."""
    return (f"LoRA on the experts under expert parallelism with tensor parallelism (tp_mesh) is not "
            f"built: PEFT's ParamWrapper '{wrapper}' (target_parameters {params}) wraps experts "
            f"module '{experts}'. Use tp=1 with ep > 1 (FSDP x EP, HSDP x EP), or ep=1 with FSDP x TP")



def experts_b_factors(model: nn.Module) -> dict[str, int]:
    """``{fqn of the weight: r}`` of every LoRA B factor of a PEFT ``ParamWrapper`` on an experts
    module (read strided per expert by PEFT). Empty for a model without such wrappers."""
    out: dict[str, int] = {}
    for chain in wrapper_chains(model).values():
        for fqn, wrapper in chain:
            if getattr(wrapper, "num_experts", None) in (None, 1):  # a 2-D parameter: B read as is
                continue
            w: Any = wrapper
            for adapter in w.lora_B:
                out[f"{fqn}.lora_B.{adapter}.weight"] = int(w.r[adapter])
    return out


def _experts_view(t: torch.Tensor, r: int, key: str) -> torch.Tensor:
    """The ``(out, r, E)`` view of a B factor ``(out, r * E)`` (a DTensor: its local tensor viewed,
    ``_StridedShard(1, r)`` -> ``Shard(2)``), sharing ``t``'s storage."""
    if t.dim() != 2 or t.shape[1] % r:
        raise ValueError(f"LoRA factor '{key}' has shape {list(t.shape)}: a DCP checkpoint holds "
                         f"an experts B factor as (out, r, E), which needs (out, r * E) with r={r}")
    if not isinstance(t, DTensor):
        return t.view(t.shape[0], r, t.shape[1] // r)
    placements: list[Any] = []
    for p in t.placements:
        if isinstance(p, StridedShard) and p.dim == 1 and p.split_factor == r:
            placements.append(Shard(2))
        elif isinstance(p, Replicate) or (isinstance(p, (Shard, StridedShard)) and p.dim == 0):  # rows
            placements.append(p)
        else:
            raise ValueError(f"LoRA factor '{key}' is sharded as {t.placements}: DCP can save an "
                             f"experts B factor (out, r * E) sharded on dim 0 and by expert "
                             f"(_StridedShard(dim=1, split_factor={r})) only")
    with torch.no_grad():
        local = t.to_local()
        view = local.view(local.shape[0], r, local.shape[1] // r)
        shape = torch.Size([t.shape[0], r, t.shape[1] // r])
        return DTensor.from_local(view, t.device_mesh, placements, run_check=False, shape=shape,
                                  stride=(shape[1] * shape[2], shape[2], 1))


def dcp_factor_views(model: nn.Module, state: dict[str, Any],
                     saved: dict[str, Any] | None = None) -> dict[str, Any]:
    """Put the ``(out, r, E)`` view (see the DCP design note) of every experts B factor, and of its
    optimizer state tensors, into ``state`` (DCP's ``{"model": ..., "optim": ...}``), in new
    containers: the dicts ``state`` held, which may be the optimizer's own, are not changed.

    Args:
        model: the model whose state it is.
        state: ``{"model": model state, "optim": optimizer state}`` (``optim`` optional), keyed by FQN.
        saved: on load, the checkpoint's metadata (``{"model.<fqn>": metadata}``): a factor the
            checkpoint holds 2-D (written before this layout) is left 2-D where DCP reads it right
            (no expert placement); with one, a ValueError names it.

    Returns:
        dict: what was replaced, ``{(part, fqn, name): the original tensor}``, so the caller can put
        the originals back after DCP's load (the views share their storage).

    Raises:
        ValueError: a factor sharded another way, or an old 2-D checkpoint entry for a factor
            sharded by expert (names the factor and both shapes).
    """
    factors = experts_b_factors(model)
    replaced: dict[Any, Any] = {}
    if not factors:
        return replaced
    # new containers: DCP's state dicts may share their per-parameter dicts with the live optimizer
    msd = state["model"] = dict(state["model"])
    osd: dict[str, Any] = {}
    if "optim" in state:
        state["optim"] = dict(state["optim"])
        osd = state["optim"]["state"] = dict(state["optim"].get("state", {}))
    for fqn, r in factors.items():
        t = msd.get(fqn)
        if t is None:
            continue
        old = saved.get(f"model.{fqn}") if saved is not None else None
        if old is not None and len(getattr(old, "size", ())) == 2:
            if isinstance(t, DTensor) and any(isinstance(p, StridedShard) for p in t.placements):
                raise ValueError(
                    f"LoRA factor '{fqn}' is held (out, r * E) = {list(old.size)} in the checkpoint "
                    f"(written before experts B factors were saved as (out, r, E)), and this model "
                    f"shards it by expert ({t.placements}), whose columns DCP cannot read from a "
                    "2-D entry: load it into a model without expert parallelism and save it again")
            continue
        replaced[("model", fqn, None)] = t
        msd[fqn] = _experts_view(t, r, fqn)
        if fqn in osd:
            osd[fqn] = dict(osd[fqn])
        for name, v in list(osd.get(fqn, {}).items()):
            if isinstance(v, torch.Tensor) and v.shape == t.shape:
                replaced[("optim", fqn, name)] = v
                osd[fqn][name] = _experts_view(v, r, f"{fqn} (optimizer state {name!r})")
    return replaced


def restore_factors(state: dict[str, Any], replaced: dict[Any, Any]) -> None:
    """Put back into ``state`` the originals :func:`dcp_factor_views` replaced."""
    for (part, fqn, name), t in replaced.items():
        if part == "model":
            state["model"][fqn] = t
        else:
            state["optim"]["state"][fqn][name] = t

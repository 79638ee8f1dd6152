"""``shard_model``: FSDP2 units chosen by predicates, applied bottom-up, ties and prefetch handled.

The order of a full set-up, and why (see ``docs/sharding.md``)::

    model = build_on_meta()                       # nobody materialises the full model
    apply_tp(model, dims.tp_mesh, plan)           # TP first: FSDP2 then shards TP's DTensors
    apply_activation_checkpointing(model, cond)   # AC before FSDP: FSDP's hooks wrap the AC region
    shard_model(model, conds, cpu_offload=False, dp_mesh=dims.fsdp_mesh)
    load_from_full_model_state_dict(model, ...)   # after sharding: each rank loads its shards

Nothing is sharded until every condition has been evaluated on every module and the plan (units,
tied-parameter groups) validated, so a bad input leaves the model untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from fsdptk._core.compat import shared_mesh_concatenation
from fsdptk._core.dist import has_process_group, log_rank0, world
from fsdptk._plans.sharding import (
    ShardingPlan,
    Unit,
    UnitPlan,
    describe_sharding,
    make_plan,
    summarise,
)
from fsdptk.predicates import ShardCondition

__all__ = ["shard_model", "describe_sharding", "ShardingPlan", "UnitPlan"]

_log = logging.getLogger(__name__)


def _accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()  # pragma: no cover - torch < 2.6


def _check_options(
    cpu_offload: Any,
    dp_mesh: Any,
    forward_prefetch: Any,
    backward_prefetch: Any,
    mp_policy: Any,
    root_reshard: Any,
) -> None:
    if not isinstance(cpu_offload, bool):
        raise TypeError(f"cpu_offload must be a bool, got {cpu_offload!r}")
    if cpu_offload and not _accelerator_available():
        raise RuntimeError(
            "cpu_offload=True needs an accelerator: FSDP2's CPUOffloadPolicy keeps parameters on "
            "CPU and copies them to the accelerator for compute, and torch.accelerator reports "
            "none on this machine; use cpu_offload=False on a CPU-only run"
        )
    for name, depth in (("forward_prefetch", forward_prefetch),
                        ("backward_prefetch", backward_prefetch)):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"{name} must be an int >= 0 (units to prefetch), got {depth!r}")
    if root_reshard is not None and not isinstance(root_reshard, bool):
        raise TypeError(f"root_reshard_after_forward must be a bool or None, got {root_reshard!r}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if dp_mesh is None:
        if not has_process_group():
            raise RuntimeError(
                "shard_model needs a dp_mesh or an initialised default process group "
                "(torch.distributed.init_process_group); for a dry run use describe_sharding"
            )
        return
    if not isinstance(dp_mesh, DeviceMesh):
        raise TypeError(f"dp_mesh must be a DeviceMesh, got {type(dp_mesh).__name__}")
    if dp_mesh.ndim not in (1, 2):
        names = dp_mesh.mesh_dim_names
        raise ValueError(
            f"dp_mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, shard), got a {dp_mesh.ndim}-D "
            f"mesh of shape {tuple(dp_mesh.shape)} with dims {names}; pass the data-parallel "
            "slice, e.g. ParallelDims.fsdp_mesh or mesh['dp_replicate', 'dp_shard']"
        )


def _shard_world_size(dp_mesh: DeviceMesh | None) -> int:
    if dp_mesh is None:
        return world()[0]
    return dp_mesh.size(dp_mesh.ndim - 1)


def _target(unit: Unit) -> nn.Module | list[nn.Module]:
    return unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)


def _expert_units(model: nn.Module, expert_dp_mesh: DeviceMesh | None
                  ) -> list[tuple[str, nn.Module]]:
    """The expert-parallel modules (:func:`fsdptk.apply_ep`), checked against ``expert_dp_mesh``."""
    from fsdptk._plans.ep_styles import experts_info

    found = [(f, m) for f, m in model.named_modules() if experts_info(m) is not None]
    if expert_dp_mesh is not None and not isinstance(expert_dp_mesh, DeviceMesh):
        raise TypeError(f"expert_dp_mesh must be a DeviceMesh, got {type(expert_dp_mesh).__name__}")
    if found and expert_dp_mesh is None:
        raise ValueError(
            f"{len(found)} modules are expert-parallel ({found[0][0]}, ...): pass "
            "expert_dp_mesh=dims.expert_fsdp_mesh so FSDP shards them over the ranks that hold the "
            "same experts")
    if expert_dp_mesh is None:
        return found
    if not found:
        raise ValueError("expert_dp_mesh was given but no module is expert-parallel: call "
                         "fsdptk.apply_ep first, or leave expert_dp_mesh out")
    if expert_dp_mesh.ndim not in (1, 2):
        raise ValueError(f"expert_dp_mesh must be 1-D (efsdp) or 2-D (dp_replicate, efsdp), got "
                         f"dims {expert_dp_mesh.mesh_dim_names}")
    ep_mesh = experts_info(found[0][1]).ep_mesh  # type: ignore[union-attr]
    if ep_mesh._get_root_mesh() is not expert_dp_mesh._get_root_mesh():
        raise ValueError(
            f"expert_dp_mesh (dims {expert_dp_mesh.mesh_dim_names}) is not a slice of the mesh the "
            f"experts' ep mesh comes from: pass ParallelDims.expert_fsdp_mesh of the dims whose "
            "ep_mesh apply_ep got")
    return found


# -- the experts' gradient divisor ---------------------------------------------------------------
# Every data-parallel rank's tokens reach the experts: before any reduction, an expert's gradient
# on its rank is the sum of the per-batch (mean-loss) gradients of the ep / tp batches of its EP
# group (the ranks of a TP group share one batch and each sends a disjoint slice of it). FSDP then
# averages over the expert mesh, dp_replicate * efsdp ranks, whose EP groups hold the other batches.
# The dense model's gradient is the mean over all dp_replicate * dp_shard batches, so the experts'
# gradient is scaled by (dp_replicate * efsdp) / (dp_replicate * dp_shard) = tp / ep in the backward
# of the experts' own forward, before FSDP sees it, and FSDP keeps its default divisor.
# Not FSDP's set_gradient_divide_factor: where the expert shard dim has one rank (efsdp = 1: HSDP x
# EP, or ep = dp_shard * tp) FSDP2 (torch 2.13) divides by that factor while copying the unreduced
# gradient and again after the reduction whenever it reduces with sums (gloo's forced sums, and
# every reduce_dtype other than fp32 / bf16, e.g. fp16): 1/factor**2.
def _expert_grad_scale(expert_dp_mesh: DeviceMesh | None, dp_mesh: DeviceMesh | None) -> float:
    """``(dp_replicate * efsdp) / (dp_replicate * dp_shard)``: the expert mesh's size over the dense
    data-parallel size; ValueError (before anything is sharded) when the expert mesh is the larger."""
    dense_dp = dp_mesh.size() if dp_mesh is not None else world()[0]
    expert_dp = expert_dp_mesh.size() if expert_dp_mesh is not None else 1
    if expert_dp > dense_dp:
        raise ValueError(
            f"expert_dp_mesh has {expert_dp} ranks, more than the dense data-parallel mesh "
            f"({dense_dp}): pass the expert_fsdp_mesh and fsdp_mesh of one ParallelDims")
    return expert_dp / dense_dp


def _check_lora_factor_units(model: nn.Module, units: Sequence[Unit]) -> None:
    """Refuse a unit that is a LoRA factor a PEFT ``ParamWrapper`` reads without calling (LoRA on
    fused experts): FSDP2 would never gather it before the wrapper's delta reads it (peft#3080).
    The rule: those factors stay in the unit of their wrapper (or one enclosing it)."""
    from fsdptk._plans.peft_wrappers import read_not_called

    read = read_not_called(model)
    if not read:
        return
    for unit in units:
        for mod in unit.modules:
            inner = getattr(mod, "_checkpoint_wrapped_module", mod)
            hit = read.get(id(mod)) or read.get(id(inner))
            if hit is not None:
                raise ValueError(
                    f"'{hit[0]}' cannot be an FSDP unit of its own: the PEFT ParamWrapper '{hit[1]}' "
                    "reads its LoRA factors without calling the module, so FSDP2 would never gather "
                    "them before the delta is computed (peft#3080). Leave the factors to the unit of "
                    "their wrapper (e.g. the decoder layer: no_split_modules(model))")


def _expert_unit_modules(model: nn.Module, experts: list[tuple[str, nn.Module]]
                         ) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(unit fqn, unit, experts module)`` for each expert-parallel module: the module itself, or,
    with LoRA on its weights (PEFT ``ParamWrapper`` s, made expert-parallel by ``apply_ep`` with
    them), the outermost wrapper, so the experts' LoRA factors are FSDP-sharded over the expert mesh
    with the experts. An expert-parallel module PEFT wrapped after ``apply_ep`` is refused
    (NotImplementedError naming it) before anything is sharded."""
    from fsdptk._plans.ep_styles import experts_info
    from fsdptk._plans.peft_wrappers import ep_lora_order, wrapper_chains

    chains = wrapper_chains(model) if experts else {}
    out = []
    for fqn, module in experts:
        chain = chains.get(id(module))
        info = experts_info(module)
        if chain is None:
            out.append((fqn, module, module))
        elif info is None or info.entry is not chain[0][1]:
            params = sorted(str(w.parameter_name) for _, w in chain)
            raise NotImplementedError(ep_lora_order(chain[0][0], params, fqn))
        else:
            out.append((chain[0][0], chain[0][1], module))
    return out


def _set_prefetch(units: list[FSDPModule], forward: int, backward: int) -> None:
    """Explicit prefetch over units in forward order: each unit gathers the next ``forward`` units
    in forward and the previous ``backward`` units (in backward order) in backward."""
    for i, unit in enumerate(units):
        if forward:
            nxt = units[i + 1 : i + 1 + forward]
            if nxt:
                unit.set_modules_to_forward_prefetch(nxt)
        if backward:
            prev = units[max(0, i - backward) : i][::-1]
            if prev:
                unit.set_modules_to_backward_prefetch(prev)


def shard_model(
    model: nn.Module,
    shard_conditions: Sequence[ShardCondition] | ShardCondition,
    *,
    cpu_offload: bool,
    reshard_after_forward: bool | int = True,
    dp_mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    forward_prefetch: int = 0,
    backward_prefetch: int = 0,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    root_reshard_after_forward: bool | None = None,
    expert_dp_mesh: DeviceMesh | None = None,
) -> ShardingPlan:
    """Apply FSDP2 ``fully_shard`` to every module a condition matches (bottom-up), then the root.

    A drop-in for torchtune's ``shard_model`` (same positional arguments and flags, the same
    units and the same ``reshard_after_forward`` for every unit, the root included: torchtune 0.6.1
    passes its value to the root's ``fully_shard`` explicitly, and FSDP2 (torch 2.13) overrides
    the root's value only when none is given, so with ``True`` the root's parameters are
    resharded after forward too; ``tests_peers/test_tt_parity.py`` checks this against
    torchtune) that also:
    groups modules sharing a parameter (tied embeddings) into one unit, or leaves the parameter to
    their common parent, so the tie survives (one Parameter, stepped once); sets explicit prefetch;
    validates everything before sharding anything; returns the plan it applied.

    Modules are matched by their clean FQN (wrapper prefixes such as ``_checkpoint_wrapped_module``
    removed; the condition receives the wrapped module) and every non-root module is tried; the
    root is always a unit. Unit order for prefetching is registration order (``named_modules``),
    which is forward order for the usual embed -> layers -> norm -> output models.

    Args:
        model: the model (``meta``, CPU or accelerator; after tensor parallel if used).
        shard_conditions: callables ``(name, module) -> bool`` (or a single one); a module that any
            of them matches becomes an FSDP unit. See :mod:`fsdptk.predicates`.
        cpu_offload: keep sharded parameters, gradients and optimizer step on CPU
            (``CPUOffloadPolicy``; needs an accelerator).
        reshard_after_forward: FSDP2's option for the non-root units: ``True`` frees gathered
            parameters after forward, ``False`` keeps them until backward, an int reshards to
            that smaller world size.
        dp_mesh: a 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh (HSDP), e.g.
            :attr:`fsdptk.ParallelDims.fsdp_mesh`; ``None`` uses the whole default process group.
        mp_policy: FSDP2 ``MixedPrecisionPolicy`` (``None``: full precision).
        forward_prefetch: number of following units each unit all-gathers early in forward
            (0: FSDP2's default, no explicit forward prefetch).
        backward_prefetch: number of preceding units each unit all-gathers early in backward
            (0: FSDP2's default implicit prefetch of one).
        shard_placement_fn: passed to ``fully_shard`` (per-parameter shard dim).
        root_reshard_after_forward: the root unit's policy. ``None`` (default): the same as
            ``reshard_after_forward``, as torchtune does, so after any forward (an eval one
            included) every parameter is sharded again. ``False``: keep the root's parameters
            gathered from forward to backward (saves one all-gather per step; what FSDP2 does for
            the root when ``fully_shard`` gets no ``reshard_after_forward``), but then build the
            optimizer before the first forward and call ``model.reshard()`` before reading a
            state dict after a forward without backward.
        expert_dp_mesh: with expert parallelism (:func:`fsdptk.apply_ep`), the mesh the experts
            are FSDP-sharded over: :attr:`fsdptk.ParallelDims.expert_fsdp_mesh` (``efsdp``, or
            ``(dp_replicate, efsdp)`` with HSDP). Each experts module becomes a unit of its own,
            sharded first, with the same options; its gradients are averaged over every
            data-parallel rank (``dp_mesh``'s size), not only over the expert mesh, because every
            rank's tokens reach the experts, so the experts' gradients match the dense model's
            (fp32 or any ``reduce_dtype``). With LoRA on the experts (PEFT ``ParamWrapper`` s that
            ``apply_ep`` sharded with them) the unit is the outermost wrapper: the experts and
            their LoRA factors, whose gradients get the same scale.

    Returns:
        ShardingPlan: the applied units (see :func:`describe_sharding`); ``print`` it for a table.

    Raises:
        ValueError: when no module matches (names the conditions), a matched module cannot be an
            FSDP unit (among them the LoRA factors a PEFT ``ParamWrapper`` reads, which stay in
            their wrapper's unit: docs/hf.md, "LoRA on the experts"), the model is already sharded, a parameter is 0-dim, ``dp_mesh`` is not 1-D
            or 2-D, or a prefetch depth is not an int >= 0; when the model has expert-parallel
            modules and no ``expert_dp_mesh`` (or one without them), or ``expert_dp_mesh`` is not
            of the experts' mesh or has more ranks than ``dp_mesh``.
        ShardConditionError: when a condition raises; names the condition and the module FQN.
        NotImplementedError: an expert-parallel module that PEFT wrapped (LoRA on its weights,
            ``target_parameters``) after :func:`fsdptk.apply_ep`: call ``get_peft_model`` first.
        RuntimeError: when ``cpu_offload=True`` without an accelerator, or without a mesh and a
            process group. In every error case the model is left unchanged.
        TypeError: on arguments of the wrong type.

    Examples:
        >>> from fsdptk import shard_model
        >>> from fsdptk.predicates import layers, by_name
        >>> plan = shard_model(model, [layers(), by_name("tok_embeddings", "output")],  # a process group: tests/test_sharding.py  # doctest: +SKIP
        ...                    cpu_offload=False, dp_mesh=dims.fsdp_mesh,
        ...                    forward_prefetch=1, backward_prefetch=1)
        >>> print(plan)  # needs the plan above; tests/test_sharding.py prints one  # doctest: +SKIP
    """
    from fsdptk._plans.ep_styles import set_grad_scale

    _check_options(cpu_offload, dp_mesh, forward_prefetch, backward_prefetch, mp_policy,
                   root_reshard_after_forward)
    plan = make_plan(model, shard_conditions)
    _check_lora_factor_units(model, plan.units)
    experts = _expert_unit_modules(model, _expert_units(model, expert_dp_mesh))
    expert_scale = _expert_grad_scale(expert_dp_mesh, dp_mesh) if experts else 1.0
    world_size = _shard_world_size(dp_mesh)
    summary = summarise(plan, world_size)

    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        "shard_placement_fn": shard_placement_fn,
    }
    # One concatenated (DP, TP/EP) mesh for all the parameters that share those meshes, instead of
    # a new one per parameter (compat.shared_mesh_concatenation).
    with shared_mesh_concatenation():
        # The experts first (innermost), over their own mesh. Gradients: see _expert_grad_scale.
        for fqn, holder, module in experts:
            fully_shard(holder, **{**kwargs, "mesh": expert_dp_mesh})
            set_grad_scale(module, expert_scale)
            log_rank0(_log, "fully_shard(%s) over the expert mesh %s, gradients scaled by %s", fqn,
                      tuple(expert_dp_mesh.shape) if expert_dp_mesh is not None else None,
                      expert_scale, level=logging.DEBUG)
        # Bottom-up: a unit must be sharded before any unit that contains it, so that the outer unit
        # skips the inner unit's parameters. Reverse registration order guarantees that (tied groups
        # are ordered by their first member, which is valid because the planner only groups modules
        # with the same enclosing units).
        for unit in reversed(plan.units):
            fully_shard(_target(unit), **kwargs)
            log_rank0(_log, "fully_shard(%s) [rule: %s]", " + ".join(unit.fqns), unit.rule, level=logging.DEBUG)
        root_reshard = reshard_after_forward if root_reshard_after_forward is None else (
            root_reshard_after_forward)
        fully_shard(model, **{**kwargs, "reshard_after_forward": root_reshard})
    for note in plan.notes:
        log_rank0(_log, "shard_model: %s", note)
    log_rank0(
        _log,
        "shard_model: applied fully_shard to %d units + root over %d shard ranks%s "
        "(reshard_after_forward=%s, root %s, mp_policy=%s, cpu_offload=%s)",
        len(plan.units), world_size,
        f" on mesh {tuple(dp_mesh.shape)}" if dp_mesh is not None else "",
        reshard_after_forward, root_reshard, mp_policy, cpu_offload,
    )
    if forward_prefetch or backward_prefetch:
        units = [u.modules[0] for u in plan.units]
        _set_prefetch(units, forward_prefetch, backward_prefetch)  # type: ignore[arg-type]  # units are FSDPModules once fully_shard ran
        log_rank0(_log, "shard_model: explicit prefetch over %d units (forward depth %d, backward depth %d)",
                  len(units), forward_prefetch, backward_prefetch)
    return summary

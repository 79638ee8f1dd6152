"""Expert parallelism: each rank of an ``ep`` group holds whole experts of every MoE layer, and
tokens travel to their experts and back.

The order of a full set-up, and why (see ``docs/expert_parallel.md``)::

    dims = ParallelDims(dp_shard=4, ep=2)        # ep borrows ranks of dp_shard (and tp)
    dims.build_mesh("cuda")                      # the dense mesh and the expert mesh
    model = build_on_meta()
    apply_tp(model, dims.tp_mesh, plan)          # TP first (no rules for the experts), if tp > 1
    apply_ep(model, dims.ep_mesh, experts, tp_mesh=dims.tp_mesh)   # experts Shard(0) over ep
    shard_model(model, conds, cpu_offload=False, dp_mesh=dims.fsdp_mesh,
                expert_dp_mesh=dims.expert_fsdp_mesh)   # experts FSDP over efsdp, the rest over dp
    load_safetensors(model, path)                # each rank reads only its experts' bytes

An experts module holds all experts' weights fused on dim 0 and is called as
``experts(hidden_states, top_k_index, top_k_weights)`` (transformers' MoE models: Mixtral,
Qwen3-MoE, DeepSeek-V3, gpt-oss, ...); see :mod:`fsdptk._plans.ep_styles` for the dispatch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdptk._core.dist import log_rank0
from fsdptk._plans.ep_styles import ExpertParallel, experts_info

__all__ = ["apply_ep", "expert_modules"]

_log = logging.getLogger(__name__)

ExpertsArg = Callable[[str, nn.Module], bool] | Iterable[str]


def _select(model: nn.Module, experts: ExpertsArg) -> list[str]:
    modules = dict(model.named_modules())
    if callable(experts):
        chosen = []
        for fqn, module in modules.items():
            try:
                if experts(fqn, module):
                    chosen.append(fqn)
            except Exception as e:
                name = getattr(experts, "__name__", repr(experts))
                raise ValueError(f"the experts predicate {name} raised on module '{fqn}' "
                                 f"({type(module).__name__}): {e}") from e
    else:
        if isinstance(experts, str):
            raise TypeError("experts must be a predicate (name, module) -> bool or a list of module "
                            f"FQNs, got the string {experts!r} (wrap it in a list)")
        chosen = list(experts)
        unknown = [f for f in chosen if f not in modules]
        if unknown:
            raise ValueError(f"experts names no module of the model: {unknown}")
    if not chosen:
        raise ValueError("no experts module matched: expert parallelism needs at least one module "
                         "holding fused expert weights [experts, ...]")
    nested = [f for f in chosen for g in chosen if f != g and f.startswith(g + ".")]
    if nested:
        raise ValueError(f"experts modules nest inside each other: {nested}")
    return chosen


def apply_ep(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    experts: ExpertsArg,
    *,
    tp_mesh: DeviceMesh | None = None,
) -> list[str]:
    """Shard each experts module's weights ``Shard(0)`` over ``ep_mesh`` and route its tokens.

    Each rank of the ``ep`` group then holds ``num_experts / ep`` whole experts (a contiguous
    range) of every selected module. The module's forward becomes an all-to-all dispatch: the
    (token, expert) pairs of this rank's tokens go to the ranks that hold their experts, run
    there through the module's own forward, and come back weighted by the routing weights (both
    exchanges differentiable). With ``tp_mesh`` (the ranks that share this rank's batch, all inside
    its EP group) each TP rank sends a disjoint slice of the tokens and the results are gathered
    back, so no pair is computed twice. Then :func:`fsdptk.shard_model` with ``expert_dp_mesh``
    FSDP-shards the experts over the ranks that hold the same ones.

    Call it on the unsharded model (``meta`` is fine), after :func:`fsdptk.apply_tp` (whose plan
    must have no rules for the experts modules) and before :func:`fsdptk.shard_model`. Every
    module is validated before any changes. Collective: every rank calls it with the same
    arguments.

    LoRA on the experts (PEFT >= 0.21's ``target_parameters``, a ``ParamWrapper`` around the experts
    module): call it after ``peft.get_peft_model``, naming the experts module itself (what
    :func:`fsdptk.hf.hf_ep_plan` returns). Each wrapper's LoRA factors are then sharded with the
    experts, each rank holding its experts' blocks only: A ``(r * E, in)`` ``Shard(0)`` and B
    ``(out, r * E)`` ``_StridedShard(1, split_factor=r)`` (PEFT reads B's expert columns strided),
    local ``(r * E / ep, in)`` and ``(out, r * E / ep)``. The dispatch moves to the outermost wrapper,
    whose own (PEFT's) forward runs on the local experts and factors; their gradients get the
    experts' gradient scale. Not built: with ``tp_mesh``, or one expert per rank.

    Args:
        model: the model.
        ep_mesh: the 1-D ``ep`` mesh, :attr:`fsdptk.ParallelDims.ep_mesh`.
        experts: the experts modules: a predicate ``(fqn, module) -> bool`` or their FQNs (for a
            transformers model :func:`fsdptk.hf.hf_ep_plan` reads the model's own EP plan).
        tp_mesh: the TP mesh when ``tp > 1`` (:attr:`fsdptk.ParallelDims.tp_mesh`).

    Returns:
        list[str]: the FQNs of the experts modules, in ``named_modules`` order.

    Raises:
        ValueError: no module matched; a module's parameters do not hold the experts on dim 0 with
            one count; ``ep`` does not divide a module's number of experts (both named); a
            parameter is already a DTensor (TP rules for the experts); the TP group is not inside
            the EP group; the meshes are not 1-D; a LoRA factor on the experts whose experts dim is
            not ``r * E`` (key and shape named).
        NotImplementedError: LoRA on the experts with ``tp_mesh``, or with one expert per rank.
        TypeError: a mesh that is not a DeviceMesh, or ``experts`` a string.

    Examples:
        >>> dims = ParallelDims(dp_shard=4, ep=2); dims.build_mesh("cuda")  # needs 4 ranks: tests/test_ep.py  # doctest: +SKIP
        >>> apply_ep(model, dims.ep_mesh, hf_ep_plan(model))  # needs 4 ranks: tests/test_ep.py  # doctest: +SKIP
        ['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']
        >>> model.model.layers[0].mlp.experts.down_proj.placements  # needs 4 ranks: tests/test_ep.py  # doctest: +SKIP
        (Shard(dim=0),)
    """
    for name, mesh in (("ep_mesh", ep_mesh), ("tp_mesh", tp_mesh)):
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{name} must be a torch DeviceMesh, got {type(mesh).__name__}")
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"{name} must be a 1-D DeviceMesh, got a {mesh.ndim}-D mesh of shape "
                             f"{tuple(mesh.shape)} with dims {mesh.mesh_dim_names}")
    style = ExpertParallel(ep_mesh, tp_mesh)
    style.check_meshes()
    chosen = _select(model, experts)
    modules = dict(model.named_modules())
    chains = _lora_chains(model, chosen, style)  # everything checked before anything changes
    for fqn in chosen:
        if experts_info(modules[fqn]) is not None:
            raise ValueError(f"experts module '{fqn}' is already expert-parallel")
        style.check(modules[fqn], fqn)
    for fqn in chosen:
        chain = chains.get(fqn)
        if chain is None:
            style.apply(modules[fqn], fqn)
            continue
        _apply_with_lora(style, modules[fqn], fqn, chain)
    log_rank0(_log, "apply_ep: %d experts modules sharded over ep=%d%s", len(chosen), ep_mesh.size(),
              f" (tokens sliced over tp={tp_mesh.size()})" if tp_mesh is not None else "")
    return chosen


def _lora_chains(model: nn.Module, chosen: list[str], style: ExpertParallel
                 ) -> dict[str, list[tuple[str, nn.Module]]]:
    """``{experts fqn: its PEFT ParamWrapper chain, outermost first}`` for the chosen modules that
    carry LoRA on their weights (``target_parameters``), each chain checked (changes nothing)."""
    from fsdptk._plans.peft_wrappers import check_ep_factors, ep_lora_tp, wrapper_chains

    by_id = wrapper_chains(model)
    modules = dict(model.named_modules())
    out: dict[str, list[tuple[str, nn.Module]]] = {}
    for fqn in chosen:
        chain = by_id.get(id(modules[fqn]))
        if chain is None:
            continue
        params = sorted(str(w.parameter_name) for _, w in chain)
        if style.tp_mesh is not None:
            raise NotImplementedError(ep_lora_tp(chain[0][0], params, fqn))
        experts = style.check(modules[fqn], fqn)
        check_ep_factors(chain, experts, style.ep_mesh.size())
        out[fqn] = chain
    return out


def _apply_with_lora(style: ExpertParallel, module: nn.Module, fqn: str,
                     chain: list[tuple[str, nn.Module]]) -> None:
    """Expert parallelism for an experts module PEFT wraps: the LoRA factors sharded with the experts,
    the dispatch around the outermost wrapper, PEFT's forward run on the local experts."""
    from fsdptk._plans.peft_wrappers import local_factors, shard_ep_factors

    local = style.check(module, fqn) // style.ep_mesh.size()
    shard_ep_factors(chain, style.ep_mesh)
    style.apply(module, fqn, entry=chain[0][1],
                around=lambda scale: local_factors(chain, local, scale))


def expert_modules(model: nn.Module) -> list[str]:
    """The FQNs of the modules :func:`apply_ep` made expert-parallel, in ``named_modules`` order.

    Args:
        model: any model.

    Returns:
        list[str]: empty when the model has no expert parallelism.

    Examples:
        >>> from torch import nn
        >>> expert_modules(nn.Linear(2, 2))
        []
    """
    return [f for f, m in model.named_modules() if experts_info(m) is not None]

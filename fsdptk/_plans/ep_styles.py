"""Expert parallelism for one experts module: whole experts per rank, tokens sent to them.

An *experts module* holds every expert's weights fused on dim 0 (``[experts, ...]``, the layout of
transformers' MoE models and of their ``grouped_gemm`` EP rule) and is called as
``experts(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])``,
returning ``[tokens, hidden]``: the sum over each token's ``k`` experts of the weighted expert
outputs. :class:`ExpertParallel` shards every parameter ``Shard(0)`` over the ``ep`` mesh (each
rank a contiguous range of whole experts) and replaces the module's forward with an all-to-all
dispatch around the module's own forward:

1. with tensor parallelism (an EP group holds whole TP groups, whose ranks share one batch), each
   TP rank keeps a disjoint slice of the tokens, so no (token, expert) pair is computed twice;
2. the (token, expert) pairs are sorted by expert, so by the rank that owns it; the per-expert
   counts are exchanged (one small all-to-all), then the token rows (``all_to_all_single`` with
   autograd: its backward is the reverse exchange);
3. each rank runs its experts on the rows it received, with local expert ids and unit weights;
4. the outputs go back the same way, are put back in (token, slot) order, weighted by the
   routing weights and summed per token; with TP the slices are gathered back (DTensor
   ``Shard(0) -> Replicate``, whose backward keeps each rank's slice of the gradient).

The parameters are swapped for their local tensors for the module's own forward (gradients flow
back to the DTensors, multiplied by the module's gradient scale: :func:`set_grad_scale`). When
something around the experts module computes on its weights (PEFT's ``ParamWrapper`` s: LoRA on the
experts), the dispatch is installed on that outer ``entry`` module instead, and an ``around``
context makes its own expert-sharded tensors local too, with the same scale. A rank
that receives no rows still runs its experts on one zero-weighted row, so the backward reaches
every parameter and FSDP's gradient reduction runs on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed import all_to_all_single, get_process_group_ranks
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = ["EP_ATTR", "ExpertParallel", "ExpertsInfo", "check_divides", "check_experts_divide", "experts_info",
           "grad_scale", "local_view", "set_grad_scale", "where"]

EP_ATTR = "_fsdptk_expert_parallel"  # set on an experts module once EP is applied
_GRAD_SCALE_ATTR = "_fsdptk_expert_grad_scale"  # set by set_grad_scale; 1.0 when absent


@dataclass(frozen=True)
class ExpertsInfo:
    """What :class:`ExpertParallel` recorded on an experts module (``getattr(module, EP_ATTR)``)."""

    ep_mesh: DeviceMesh
    num_experts: int  # all experts of the module
    local_experts: int  # those on each rank
    entry: nn.Module | None = None  # the module that runs the dispatch when not this one (LoRA)


def experts_info(module: nn.Module) -> ExpertsInfo | None:
    """The :class:`ExpertsInfo` of an expert-parallel module, else None."""
    info = getattr(module, EP_ATTR, None)
    return info if isinstance(info, ExpertsInfo) else None


def set_grad_scale(module: nn.Module, scale: float) -> None:
    """Multiply the gradients the expert-parallel ``module``'s parameters receive by ``scale``.

    Applied in the backward of the local views the module's own forward runs on, before any
    gradient reduction; ``fsdptk.shard_model`` sets it (see its ``expert_dp_mesh``).

    Raises:
        ValueError: ``module`` is not expert-parallel, or ``scale`` is not in ``(0, 1]``.
    """
    if experts_info(module) is None:
        raise ValueError(f"{type(module).__name__} is not expert-parallel (fsdptk.apply_ep)")
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"an experts gradient scale must be in (0, 1], got {scale}")
    setattr(module, _GRAD_SCALE_ATTR, float(scale))


def grad_scale(module: nn.Module) -> float:
    """The gradient scale :func:`set_grad_scale` gave the expert-parallel ``module`` (1.0 if none)."""
    return float(getattr(module, _GRAD_SCALE_ATTR, 1.0))


def local_view(p: DTensor, scale: float = 1.0) -> torch.Tensor:
    """``p.to_local()``, its gradient multiplied by ``scale`` in the backward (when not 1)."""
    local = p.to_local()
    if scale != 1.0 and local.requires_grad:
        local = _ScaleGrad.apply(local, scale)
    return local


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: D102
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad * ctx.scale, None


class _Route(NamedTuple):
    """What the combine step needs from the dispatch step of one forward."""

    weights: torch.Tensor  # [tokens, k] routing weights of this rank's tokens
    inverse: torch.Tensor  # position of each (token, slot) pair in the sorted order
    send_sizes: list[int]  # rows sent to each EP rank
    recv_sizes: list[int]  # rows received from each EP rank
    tokens: int  # tokens before the TP slice


def where(fqn: str, module: nn.Module) -> str:
    """How an error names an experts module."""
    return f"experts module '{fqn}' ({type(module).__name__})"


def check_divides(where: str, experts: int, ep: int) -> None:
    """The one "ep divides the experts" check: ``ep`` must divide an experts module's count.

    Examples:
        >>> check_divides("experts module 'mlp.experts' (Experts)", 8, 3)
        Traceback (most recent call last):
        ValueError: experts module 'mlp.experts' (Experts): ep (3) must divide its number of experts (8)
    """
    if experts % ep:
        raise ValueError(f"{where}: ep ({ep}) must divide its number of experts ({experts})")


def check_experts_divide(model: nn.Module, experts: list[str], ep: int) -> None:
    """:func:`check_divides` for every experts module ``experts`` names in ``model`` (the expert
    counts read from its parameters' dim 0, on ``meta`` too): before anything changes."""
    modules = dict(model.named_modules())
    for fqn in experts:
        for n in sorted({p.shape[0] for p in modules[fqn].parameters() if p.dim()}):
            check_divides(where(fqn, modules[fqn]), n, ep)


class ExpertParallel:
    """Shard an experts module over ``ep_mesh`` and route its tokens (see the module docstring).

    Args:
        ep_mesh: the 1-D ``ep`` mesh (:attr:`fsdptk.ParallelDims.ep_mesh`).
        tp_mesh: the 1-D TP mesh whose ranks share this rank's batch (``None`` or size 1: none).
            Its ranks must all be in this rank's EP group.
    """

    def __init__(self, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> None:
        self.ep_mesh = ep_mesh
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None

    def check_meshes(self) -> None:
        """ValueError when the TP group is not inside the EP group (tokens would be lost or doubled)."""
        if self.ep_mesh.ndim != 1:
            raise ValueError(f"ep_mesh must be 1-D, got a {self.ep_mesh.ndim}-D mesh of shape "
                             f"{tuple(self.ep_mesh.shape)} with dims {self.ep_mesh.mesh_dim_names}")
        if self.tp_mesh is None:
            return
        ep_ranks = set(get_process_group_ranks(self.ep_mesh.get_group()))
        tp_ranks = set(get_process_group_ranks(self.tp_mesh.get_group()))
        if not tp_ranks <= ep_ranks:
            raise ValueError(
                f"the TP group {sorted(tp_ranks)} is not inside the EP group {sorted(ep_ranks)}: the "
                "ranks that share a batch must be in one expert-parallel group (ParallelDims builds "
                "such meshes: ep a multiple of tp)")

    def check(self, module: nn.Module, fqn: str) -> int:
        """Validate one experts module; returns its number of experts. Changes nothing."""
        at = where(fqn, module)
        params = list(module.named_parameters())
        if not params:
            raise ValueError(f"{at} has no parameters: expert parallelism shards the experts' "
                             "fused weights [experts, ...]")
        if any("." in n for n, _ in params):
            nested = [n for n, _ in params if "." in n]
            raise ValueError(f"{at} has parameters in submodules ({nested}); expert parallelism "
                             "takes a module whose own parameters are the fused expert weights")
        counts = {n: p.shape[0] if p.dim() else None for n, p in params}
        if len(set(counts.values())) != 1 or None in counts.values():
            shapes = {n: list(p.shape) for n, p in params}
            raise ValueError(f"{at}: every parameter must hold the experts on dim 0 with the same "
                             f"count; shapes {shapes}")
        for n, p in params:
            if isinstance(p, DTensor):
                raise ValueError(
                    f"{at}: parameter '{n}' is already a DTensor on mesh "
                    f"{p.device_mesh.mesh_dim_names} with {p.placements}: apply expert parallelism "
                    "before tensor parallelism leaves it, and without TP rules for the experts")
        experts = next(iter(counts.values()))
        assert experts is not None
        ep = self.ep_mesh.size()
        check_divides(at, experts, ep)
        declared = getattr(module, "num_experts", experts)
        if isinstance(declared, int) and declared != experts:
            raise ValueError(f"{at}: num_experts ({declared}) is not its weights' dim 0 "
                             f"({experts})")
        return int(experts)

    def apply(self, module: nn.Module, fqn: str, *, entry: nn.Module | None = None,
              around: Callable[[float], AbstractContextManager[Any]] | None = None) -> None:
        """Shard the parameters and install the dispatch (after :meth:`check`).

        ``entry``: the module the model calls for these experts when it is not ``module`` (a
        wrapper around it, e.g. PEFT's ``ParamWrapper`` s); the dispatch replaces its forward, and
        ``around(scale)`` is entered with the local parameters around its own forward.
        """
        experts = self.check(module, fqn)
        local = experts // self.ep_mesh.size()
        for name, p in list(module.named_parameters()):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p, self.ep_mesh, [Shard(0)], src_data_rank=0),
                requires_grad=p.requires_grad))
        if isinstance(getattr(module, "num_experts", None), int):
            setattr(module, "num_experts", local)  # noqa: B010 - its own forward sees local experts
        if hasattr(module, "_is_expert_parallel"):  # transformers' kernels mask sentinels then
            setattr(module, "_is_expert_parallel", True)  # noqa: B010
        host = module if entry is None else entry
        own_forward = host.forward
        setattr(host, "forward", self._forward(module, own_forward, local, around))  # noqa: B010
        setattr(module, EP_ATTR, ExpertsInfo(self.ep_mesh, experts, local, entry))

    # -- the dispatch ---------------------------------------------------------------------------
    def _forward(self, module: nn.Module, own_forward: Callable[..., Any], local: int,
                 around: Callable[[float], AbstractContextManager[Any]] | None = None
                 ) -> Callable[..., torch.Tensor]:
        def ep_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
            if isinstance(hidden_states, DTensor):
                hidden_states = hidden_states.to_local()
            if isinstance(top_k_weights, DTensor):
                top_k_weights = top_k_weights.to_local()
            rows, ids, weights, route = self._dispatch(hidden_states, top_k_index, top_k_weights, local)
            scale = grad_scale(module)
            with _local_params(module, scale), (nullcontext() if around is None else around(scale)):
                if rows.shape[0]:
                    out = own_forward(rows, ids, weights)
                else:  # keep the backward (and FSDP's reduction) running on this rank
                    out = own_forward(rows.sum(0, keepdim=True), ids.new_zeros((1, 1)),
                                      weights.new_ones((1, 1)))[:0]
            return self._combine(out, route).to(hidden_states.dtype)

        return ep_forward

    def _dispatch(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, local: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Route]:
        tokens = hidden.shape[0]
        if self.tp_mesh is not None:  # Replicate -> Shard(0): a local slice; backward gathers
            hidden, index, weights = (
                DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                .redistribute(self.tp_mesh, [Shard(0)]).to_local()
                for t in (hidden, index, weights))
        ep = self.ep_mesh.size()
        group = self.ep_mesh.get_group()
        k = index.shape[-1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        send_rows = hidden[order // k]
        counts = torch.bincount(flat, minlength=ep * local)
        if counts.numel() != ep * local:
            raise ValueError(f"routing picked expert {int(flat.max())}; the module has {ep * local} "
                             "experts")
        counts = counts.view(ep, local)
        recv_counts = torch.empty_like(counts)
        all_to_all_single(recv_counts, counts, group=group)
        send_sizes, recv_sizes = torch.stack([counts.sum(1), recv_counts.sum(1)]).tolist()
        rows = all_to_all_single_autograd(send_rows, recv_sizes, send_sizes, group)
        ids = torch.arange(local, device=hidden.device).repeat(ep).repeat_interleave(
            recv_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
        ones = torch.ones(ids.shape, dtype=rows.dtype, device=rows.device)
        return rows, ids, ones, _Route(weights, torch.argsort(order), send_sizes, recv_sizes, tokens)

    def _combine(self, out: torch.Tensor, route: _Route) -> torch.Tensor:
        back = all_to_all_single_autograd(out, route.send_sizes, route.recv_sizes,
                                          self.ep_mesh.get_group())
        hidden_dim = back.shape[-1]
        per_slot = back[route.inverse].view(*route.weights.shape, hidden_dim)
        mine = (per_slot * route.weights.unsqueeze(-1).to(per_slot.dtype)).sum(1)
        if self.tp_mesh is None:
            return mine
        whole = DTensor.from_local(mine.contiguous(), self.tp_mesh, [Shard(0)], run_check=False,
                                   shape=torch.Size((route.tokens, hidden_dim)),
                                   stride=(hidden_dim, 1)).full_tensor()
        # a view of the gather's buffer: FSDP warns that an in-place op on a unit's output view
        # would lose its backward hook, so hand out a tensor of its own
        return whole.clone() if whole._base is not None else whole


class _local_params:  # noqa: N801 - used as a context manager
    """Swap a module's DTensor parameters for their local tensors for one call (gradients flow
    back to the DTensors through ``to_local``'s autograd, multiplied by ``scale`` when not 1).

    A parametrization registered on a swapped parameter during the call (PEFT's ``ParamWrapper``
    adds LoRA's delta that way) holds the local tensor as its ``original``; once it is removed with
    ``leave_parametrized=False`` torch puts that plain tensor back as a buffer, which is dropped
    here before the DTensor Parameter returns."""

    def __init__(self, module: nn.Module, scale: float = 1.0) -> None:
        self.module = module
        self.scale = scale
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> None:
        for n, p in self.module._parameters.items():
            if isinstance(p, DTensor):
                self.saved[n] = p
                self.module._parameters[n] = local_view(p, self.scale)

    def __exit__(self, *exc: object) -> None:
        for n in self.saved:
            self.module._buffers.pop(n, None)
        self.module._parameters.update(self.saved)
        self.saved = {}

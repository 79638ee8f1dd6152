"""The DTensor ``ParallelStyle``\\ s that :func:`fsdptk.hf_tp_plan` translates transformers' plan
strings into, where torch's own classes are not enough.

- :class:`ColwiseKeepTied` / :class:`RowwiseKeepTied`: torch's ``ColwiseParallel`` /
  ``RowwiseParallel`` whose tied parameters (an input embedding and ``lm_head``) stay one
  Parameter; the rowwise one also takes an uneven last-dim input shard, as transformers does.
- :class:`ReplicatedPartialGrad`: transformers' ``"replicated_with_grad_allreduce"``.
- :class:`GatherSequence`, :class:`ReplicatedKVColwise` (public as :mod:`fsdptk.tp_plan`'s): a
  sequence-sharded input gathered; GQA k/v projections with fewer KV heads than TP ranks.
- :func:`is_norm`: the one rule for which modules are norms (sequence parallel shards them).
- :class:`HFAttentionHeads`: checks a transformers attention module's head split before any module
  changes and, with fewer KV heads than TP ranks, sets its per-rank ``num_key_value_groups``.
- :class:`MoEExpertsTP`: transformers' ``"moe_tp_experts"`` (LoRA on those experts:
  :mod:`fsdptk._plans.tp_experts_lora`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from fsdptk._core.compat import StridedShard

__all__ = ["ColwiseKeepTied", "RowwiseKeepTied", "ReplicatedPartialGrad", "HFAttentionHeads",
           "GatherSequence", "ReplicatedKVColwise", "MoEExpertsTP", "is_norm"]


def is_norm(module: nn.Module) -> bool:
    """A norm layer: its class name says so and it holds parameters of its own (a norm without
    weights has nothing to shard, so sequence parallel leaves it alone)."""
    return "norm" in type(module).__name__.lower() and any(
        True for _ in module.parameters(recurse=False)
    )


class GatherSequence(ParallelStyle):
    """Turn a module's sequence-sharded input into a replicated DTensor (sequence parallel).

    Like ``PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))``
    but independent of the module's signature: it converts the first positional tensor argument,
    or, if there is none, the first tensor keyword argument (Hugging Face calls
    ``self_attn(hidden_states=...)``). A DTensor input is redistributed; a plain tensor is taken
    as this rank's ``input_layout`` shard. The module then sees the global shape
    (``x.shape[1]`` is the full sequence), and its colwise projections need no further gather.

    Args:
        input_layout: the layout the input arrives in (default ``Shard(1)``).
        desired_layout: the layout handed to the module (default ``Replicate()``).
    """

    def __init__(
        self, *, input_layout: Placement | None = None, desired_layout: Placement | None = None
    ) -> None:
        super().__init__()
        self.input_layout = input_layout or Shard(1)
        self.desired_layout = desired_layout or Replicate()

    def _convert(self, x: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
        if x.placements != (self.desired_layout,):
            x = x.redistribute(placements=(self.desired_layout,))
        return x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        import torch

        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    return (*args[:i], self._convert(a, device_mesh), *args[i + 1 :]), kwargs
            for k, a in kwargs.items():
                if isinstance(a, torch.Tensor):
                    return args, {**kwargs, k: self._convert(a, device_mesh)}
            raise ValueError(
                f"GatherSequence: {type(mod).__name__} was called without a tensor input"
            )

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return (
            f"GatherSequence(input_layout={self.input_layout}, "
            f"desired_layout={self.desired_layout})"
        )


class ReplicatedKVColwise(ParallelStyle):
    """Colwise K/V projection that also works when there are fewer KV heads than TP ranks.

    With ``num_kv_heads`` divisible by the TP size this is exactly ``ColwiseParallel``. With
    fewer KV heads (TP size a multiple of ``num_kv_heads``) the weight is replicated over the TP
    mesh, every rank computes all KV heads (cheap: there are few) and keeps the one its query
    heads use (rank ``r`` keeps head ``r // (tp / num_kv_heads)``), in DTensor ops so that the
    weight gradient is the full sum over ranks. Pair with
    ``prepare_mha_for_tp(..., replicate_kv_heads=True)``. The parameter keeps its full shape,
    so state dicts are unchanged.

    Args:
        num_kv_heads: the model's global number of KV heads.
        input_layouts: layout of the incoming activation (default ``Replicate()``).

    Raises:
        ValueError: (when applied) if neither the KV head count nor the TP size divides the
            other, or the module's output features are not a multiple of ``num_kv_heads``.
    """

    def __init__(self, num_kv_heads: int, *, input_layouts: Placement | None = None):
        super().__init__()
        if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0:
            raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
        self.num_kv_heads = num_kv_heads
        self.input_layouts = input_layouts

    def _check(self, module: nn.Module, tp: int, fqn: str = "") -> None:
        """ValueError when ``module`` cannot be split over ``tp`` ranks (nothing is changed)."""
        kv = self.num_kv_heads
        ok_layout = kv % tp == 0 or tp % kv == 0
        if ok_layout and isinstance(module, nn.Linear) and module.out_features % kv == 0:
            return
        where = f" '{fqn}'" if fqn else ""
        raise ValueError(
            f"ReplicatedKVColwise: cannot split {kv} KV heads over tensor parallel size {tp} "
            f"(module{where} {type(module).__name__}, out_features "
            f"{getattr(module, 'out_features', '?')}): the TP size must be a multiple or a divisor "
            "of the KV head count and the module an nn.Linear with out_features divisible by it."
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, kv = device_mesh.size(), self.num_kv_heads
        self._check(module, tp)
        if kv % tp == 0:
            colwise = ColwiseParallel(input_layouts=self.input_layouts)
            colwise.src_data_rank = self.src_data_rank
            return colwise._apply(module, device_mesh)
        head_dim, rep = cast(nn.Linear, module).out_features // kv, tp // kv
        in_layout = self.input_layouts or Replicate()

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                rep_p = distribute_tensor(p, mesh, [Replicate()], src_data_rank=self.src_data_rank)
                mod.register_parameter(pname, nn.Parameter(rep_p, requires_grad=p.requires_grad))

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> Any:
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (in_layout,), run_check=False)
            if x.placements != (Replicate(),):
                x = x.redistribute(placements=(Replicate(),))
            return x

        def prepare_output(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            lead = out.shape[:-1]
            heads = out.view(*lead, kv, 1, head_dim).expand(*lead, kv, rep, head_dim)
            heads = heads.reshape(*lead, tp, head_dim).redistribute(placements=(Shard(len(lead)),))
            local = heads.to_local()  # (..., 1, head_dim): this rank's replica
            return local.reshape(*local.shape[:-2], head_dim)

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)

    def __repr__(self) -> str:
        return (
            f"ReplicatedKVColwise(num_kv_heads={self.num_kv_heads}, "
            f"input_layouts={self.input_layouts})"
        )



def _place(style: _KeepTied, module: nn.Module, mesh: DeviceMesh,
           placements: Mapping[str, Placement]) -> None:
    """Distribute the module's own parameters. A tied parameter whose other owner was already
    parallelised (``style.tied``) adopts that owner's DTensor Parameter, so the tie stays one
    Parameter whichever end is applied first."""
    for pname, param in list(module.named_parameters(recurse=False)):
        want = (placements[pname],)
        if isinstance(param, DTensor):
            raise ValueError(f"{type(module).__name__}.{pname} is already a DTensor "
                             f"({param.placements}): apply tensor parallel once")
        for other, oname in style.tied.get(pname, ()):
            placed = other._parameters.get(oname)
            if isinstance(placed, DTensor):
                if placed.device_mesh != mesh or tuple(placed.placements) != want:
                    raise ValueError(
                        f"{type(module).__name__}.{pname} is tied to a parameter already placed "
                        f"{placed.placements}, but {type(style).__name__} needs {want}")
                module.register_parameter(pname, placed)
                break
        else:
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, mesh, want, src_data_rank=style.src_data_rank),
                requires_grad=param.requires_grad))


class _KeepTied:
    """Mixin: ``tied`` maps a parameter name to the (module, name) pairs sharing it."""

    # never mutated: tie() assigns a new dict to the instance
    tied: dict[str, list[tuple[nn.Module, str]]] = {}  # noqa: RUF012
    src_data_rank: int | None  # set by the ParallelStyle it is mixed into

    def tie(self, pname: str, other: nn.Module, oname: str) -> None:
        """Record that this module's ``pname`` is ``other.<oname>`` (one tied Parameter)."""
        self.tied = {**self.tied, pname: [*self.tied.get(pname, []), (other, oname)]}


class ColwiseKeepTied(_KeepTied, ColwiseParallel):
    """``ColwiseParallel`` whose tied parameters stay one Parameter with their other owner's."""

    def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _place(self, module, mesh, {"weight": Shard(0), "bias": Shard(0)})

    def _partition_embedding_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _place(self, module, mesh, {"weight": Shard(1)})


class RowwiseKeepTied(_KeepTied, RowwiseParallel):
    """``RowwiseParallel`` whose tied parameters stay one Parameter with their other owner's.

    As transformers' own rowwise style, a plain input sharded on its last dim is taken as this
    rank's slice of ``in_features`` even when that does not divide by the TP size (a colwise
    projection's uneven output feeds it); torch's style would assume equal slices.
    """

    @staticmethod
    def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module,
                          inputs: Any, device_mesh: DeviceMesh) -> Any:
        x = inputs[0]
        last = input_layouts[0]
        if (isinstance(mod, nn.Linear) and not isinstance(x, DTensor) and isinstance(last, Shard)
                and last.dim in (-1, x.ndim - 1)):
            shape = (*x.shape[:-1], mod.in_features)
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False, shape=torch.Size(shape),
                                   stride=stride)
        return RowwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod,
                                                 (x, *inputs[1:]), device_mesh)

    def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _place(self, module, mesh, {"weight": Shard(1), "bias": Replicate()})

    def _partition_embedding_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _place(self, module, mesh, {"weight": Shard(0)})


class ReplicatedPartialGrad(ParallelStyle):
    """Replicated parameters whose gradient is summed over the TP ranks.

    transformers' ``"replicated_with_grad_allreduce"``: for a module that sits between a colwise
    and a rowwise projection and sees only this rank's share of the activation (Qwen3 / Gemma3
    per-head ``q_norm`` / ``k_norm``). The forward runs on local tensors with no collective; each
    rank's parameter gradient covers only its heads, so the parameters are replicated DTensors
    whose local views carry a ``Partial`` gradient: summed over TP ranks by FSDP2's
    reduce-scatter, or by ``grad.full_tensor()`` without FSDP.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(param, device_mesh, [Replicate()],
                                      src_data_rank=self.src_data_rank),
                    requires_grad=param.requires_grad))
        saved: list[dict[str, Any]] = []

        def to_local(mod: nn.Module, args: Any) -> None:
            own: dict[str, Any] = {n: p for n, p in mod._parameters.items() if isinstance(p, DTensor)}
            saved.append(own)
            for n, p in own.items():
                mod._parameters[n] = p.to_local(grad_placements=[Partial()])

        def restore(mod: nn.Module, args: Any, out: Any) -> None:
            mod._parameters.update(saved.pop())

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)  # also after an exception
        return module

    def __repr__(self) -> str:
        return "ReplicatedPartialGrad()"


class HFAttentionHeads(ParallelStyle):
    """Checks (and, with replicated KV heads, sets) a transformers attention module's head split.

    transformers' attention reshapes with ``-1`` heads, so a colwise q/k/v split needs the head
    counts to divide by the TP size: :func:`fsdptk.apply_tp` calls :meth:`_check` before changing
    any module. With fewer KV heads than TP ranks (a multiple of them), the k/v projections are
    :class:`~fsdptk.tp_plan.ReplicatedKVColwise` and every rank holds one KV head: the module's
    ``num_key_value_groups`` becomes ``num_heads // tp``. With ``gather_sequence`` the module also
    gathers its sequence-sharded input (:class:`~fsdptk.tp_plan.GatherSequence`).

    Args:
        num_heads: the module's global number of query heads.
        num_kv_heads: its global number of KV heads.
        gather_sequence: also gather a sequence-sharded input (sequence parallel).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, *, gather_sequence: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.gather_sequence = gather_sequence

    def _check(self, module: nn.Module, tp: int, fqn: str = "") -> None:
        where = f"attention module '{fqn}' ({type(module).__name__})"
        if self.num_heads % tp:
            raise ValueError(f"{where}: Number of attention heads ({self.num_heads}) must be "
                             f"divisible by tensor parallel size ({tp}).")
        kv = self.num_kv_heads
        if kv % tp and tp % kv:
            raise ValueError(f"{where}: Number of KV heads ({kv}) must be divisible by tensor "
                             f"parallel size ({tp}), or the TP size a multiple of it (each rank "
                             "then keeps a replica of one KV head).")
        if kv < tp and not isinstance(getattr(module, "num_key_value_groups", None), int):
            raise ValueError(f"{where}: {kv} KV heads over tensor parallel size {tp} need "
                             "replicated KV heads, but the module has no int "
                             "'num_key_value_groups' to set to its per-rank value.")

    def _apply(self, module: Any, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        self._check(module, tp)
        if self.num_kv_heads < tp:  # one (replicated) KV head per rank
            module.num_key_value_groups = self.num_heads // tp
        if self.gather_sequence:
            GatherSequence()._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return (f"HFAttentionHeads(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"gather_sequence={self.gather_sequence})")


class MoEExpertsTP(ParallelStyle):
    """transformers' ``"moe_tp_experts"``: every rank holds every expert, a slice of each expert's
    intermediate dimension.

    The fused expert weights are 3-D (``[experts, out, in]``). ``"packed_colwise"`` (``gate_up_proj``:
    gate rows then up rows) shards each half's rows alike, so a rank holds its gate rows and the
    matching up rows: ``_StridedShard(1, split_factor=2)``, the placement DTensor gives a dim
    sharded after a split into two. ``"colwise"`` is ``Shard(1)``, ``"rowwise"`` (``down_proj``)
    ``Shard(2)``. The module's own forward then runs on the local slices (its parameters swapped for
    their local tensors for the call, gradients flowing back to the DTensors) and its output, a
    partial sum over the ranks' intermediate slices, is summed over the TP ranks (``Partial`` ->
    ``Replicate``, whose backward is the identity). Inputs are whole on every rank; their
    gradients (hidden states, routing weights), partial on each rank, are summed over the TP
    ranks in backward (identity forward), so the replicated modules before the experts (router,
    norms, attention) get the same gradient on every TP rank.

    Args:
        params: parameter name -> transformers style string (``packed_colwise``, ``colwise``,
            ``rowwise``); every parameter of the module must be named.
    """

    STRINGS = ("packed_colwise", "colwise", "rowwise")

    def __init__(self, params: Mapping[str, str]) -> None:
        super().__init__()
        self.params = dict(params)

    def placement(self, string: str) -> Placement:
        if string == "packed_colwise":
            return cast(Placement, StridedShard(1, split_factor=2))
        return Shard(1) if string == "colwise" else Shard(2)

    def _check(self, module: nn.Module, tp: int, fqn: str = "") -> None:
        where = f"experts module '{fqn}' ({type(module).__name__})"
        for pname, p in module.named_parameters(recurse=False):
            string = self.params.get(pname)
            if string not in self.STRINGS:
                raise ValueError(f"{where}: parameter '{pname}' (shape {list(p.shape)}) has no tensor-"
                                 f"parallel rule ({string!r}); experts sharded with 'moe_tp_experts' "
                                 f"need one of {list(self.STRINGS)} for each parameter (a bias is not "
                                 "supported)")
            if p.dim() != 3:
                raise ValueError(f"{where}: parameter '{pname}' has shape {list(p.shape)}; fused "
                                 "expert weights are 3-D [experts, out, in]")
            dim = 2 if string == "rowwise" else 1
            parts = 2 * tp if string == "packed_colwise" else tp
            if p.shape[dim] % parts:
                raise ValueError(f"{where}: parameter '{pname}' dim {dim} ({p.shape[dim]}) must be "
                                 f"divisible by {parts} ('{string}' over tensor parallel size {tp})")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh.size())
        for pname, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(p, device_mesh, [self.placement(self.params[pname])],
                                      src_data_rank=self.src_data_rank),
                    requires_grad=p.requires_grad))
        saved: list[dict[str, Any]] = []

        def entering(x: Any) -> Any:  # identity forward; backward sums the partial grads
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.is_floating_point():
                return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(
                    grad_placements=[Partial()])
            return x

        def to_local(mod: nn.Module, args: Any, kwargs: Any) -> Any:
            own: dict[str, Any] = {n: p for n, p in mod._parameters.items() if isinstance(p, DTensor)}
            saved.append(own)
            for n, p in own.items():
                mod._parameters[n] = p.to_local()
            return tuple(entering(a) for a in args), {k: entering(v) for k, v in kwargs.items()}

        def reduce(mod: nn.Module, args: Any, out: Any) -> Any:
            mod._parameters.update(saved.pop())
            return DTensor.from_local(out, device_mesh, [Partial()], run_check=False).redistribute(
                device_mesh, [Replicate()]).to_local()

        def restore_on_error(mod: nn.Module, args: Any, out: Any) -> None:
            if saved:
                mod._parameters.update(saved.pop())

        module.register_forward_pre_hook(to_local, with_kwargs=True)
        module.register_forward_hook(reduce)
        module.register_forward_hook(restore_on_error, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"MoEExpertsTP(params={self.params})"


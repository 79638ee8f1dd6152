"""LoRA on tensor-parallel fused experts: :class:`MoEExpertsLoraTP`, the style :func:`fsdptk.hf.hf_tp_plan`
gives the outermost of PEFT's ``ParamWrapper`` s (``target_parameters``) around an experts module that
:class:`~fsdptk._plans.tp_styles.MoEExpertsTP` shards (transformers' ``"moe_tp_experts"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from fsdptk._core.compat import StridedShard
from fsdptk._plans.tp_styles import MoEExpertsTP

__all__ = ["MoEExpertsLoraTP", "param_wrapper_chain"]


# Design note. PEFT 0.21's ParamWrapper (``target_parameters``) adapts one parameter W of an experts
# module; two targeted parameters are two nested wrappers. Stored as transformers does, W is
# ``(E, out, in)`` (``is_transposed`` experts: ``(E, in, out)``), and the wrapper's factors are
# ``A = lora_A.weight (r * E, in)`` and ``B = lora_B.weight (out, r * E)``; PEFT's forward registers
# ``W + s * einsum(B, A)`` (per expert ``W_e + s * B_e @ A_e``) as a parametrization of W for the
# call. MoEExpertsTP cuts W on one dim: rows of ``out`` (``packed_colwise``: each half's rows;
# ``colwise``) or columns of ``in`` (``rowwise``). A rank's slice of the delta's ``out`` rows is B's
# same rows times all of A; a slice of its ``in`` columns is all of B times A's same columns. So for
# the call the wrapped weights and every factor are swapped for local tensors: the factor that meets
# W's split dim is this rank's slice of it (``colwise``: B ``Shard(0)``; ``rowwise``: A ``Shard(1)``),
# the other factor whole, and PEFT's own code runs on this rank's slice (the same ops as on an
# unsharded model whose experts are that slice). The whole factor's gradient on each rank covers only
# its slice of the delta: its local view carries a ``Partial`` gradient, summed over the TP ranks (by
# FSDP2's reduce-scatter, as ReplicatedPartialGrad's).
#
# ``packed_colwise`` B (gate rows then up rows; a rank needs its rows of each half) would be
# ``_StridedShard(0, split_factor=2)``, but FSDP2 (torch 2.13) describes its own dim-0 shard of such
# a parameter as ``_StridedShard(0, split_factor=tp)``, which does not match the rows it holds: the
# state-dict engine then reads wrong rows into the shards and ``full_tensor()`` gives wrong rows
# (measured on a 2 x 2 mesh). So a packed B stays whole over TP (FSDP still shards it over the data
# ranks) and the call sees this rank's rows of it (an index on dim 0: the gradient lands on those
# rows, ``Partial`` over TP like any whole factor). B is small beside the experts (``out x r E``
# against ``E x out x in``).
#
# Once PEFT removes its parametrization (``leave_parametrized=False``) torch registers the plain local
# weight back as a buffer: dropped before the DTensor Parameter returns.
def param_wrapper_chain(module: nn.Module) -> list[Any]:
    """PEFT's ``ParamWrapper`` s from ``module`` inward (``module`` first; empty if it is not one)."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return []
    chain: list[Any] = []
    current: Any = module
    while isinstance(current, ParamWrapper):
        chain.append(current)
        current = current.base_layer
    return chain


class MoEExpertsLoraTP(ParallelStyle):
    """LoRA on tensor-parallel fused experts: applied to the outermost of PEFT's ``ParamWrapper`` s
    around an experts module that :class:`MoEExpertsTP` shards (see the design note above).

    Each wrapper's factors are placed on the TP mesh by the wrapped weight's rule: ``colwise``: B
    ``Shard(0)``, A ``Replicate()``; ``rowwise``: A ``Shard(1)``, B ``Replicate()``;
    ``packed_colwise``: both ``Replicate()``, B's rows of this rank taken for the call (each half's
    slice); the ``(E, in, out)`` layout swaps the roles. The factors keep their full shapes in state
    dicts, and PEFT's forward runs on this rank's local tensors.

    Args:
        params: the experts' parameter name -> transformers style string (:class:`MoEExpertsTP`'s).
    """

    def __init__(self, params: Mapping[str, str]) -> None:
        super().__init__()
        self.params = dict(params)

    def _split(self, wrapper: Any, experts: nn.Module) -> tuple[str, int, bool]:
        """(the factor cut like W: ``"lora_A"`` or ``"lora_B"``, its dim, packed) for ``wrapper``."""
        string = self.params.get(wrapper.parameter_name)
        dim = 2 if string == "rowwise" else 1
        out_dim = 2 if getattr(experts, "is_transposed", False) else 1  # (E, out, in) or (E, in, out)
        part, fdim = ("lora_B", 0) if dim == out_dim else ("lora_A", 1)
        return part, fdim, string == "packed_colwise"

    def _check(self, module: nn.Module, tp: int, fqn: str = "") -> None:
        """ValueError when the wrappers' factors cannot follow their experts' split (nothing changes)."""
        chain = param_wrapper_chain(module)
        if not chain:
            raise ValueError(f"MoEExpertsLoraTP applies to PEFT's ParamWrapper around fused experts; "
                             f"'{fqn}' is a {type(module).__name__}")
        experts: nn.Module = chain[-1].base_layer
        for depth, wrapper in enumerate(chain):
            where = f"PEFT ParamWrapper '{fqn}{'.base_layer' * depth}' ({wrapper.parameter_name})"
            w = experts._parameters.get(wrapper.parameter_name)
            string = self.params.get(wrapper.parameter_name)
            if w is None or w.dim() != 3 or string not in MoEExpertsTP.STRINGS:
                raise ValueError(f"{where}: LoRA under tensor parallel is built for 3-D fused expert "
                                 f"weights with a {list(MoEExpertsTP.STRINGS)} rule; the wrapped "
                                 f"parameter has shape {None if w is None else list(w.shape)}, rule "
                                 f"{string!r}")
            n = int(w.shape[0])
            transposed = bool(getattr(experts, "is_transposed", False))
            in_f, out_f = (int(w.shape[1]), int(w.shape[2])) if transposed else (int(w.shape[2]), int(w.shape[1]))
            if getattr(wrapper, "num_experts", None) != n:
                raise ValueError(f"{where}: built for num_experts={getattr(wrapper, 'num_experts', None)}, "
                                 f"its experts module holds {n}")
            variants = sorted(getattr(wrapper, "lora_variant", {}) or {})
            if variants:
                raise ValueError(f"{where}: adapter(s) {variants} use a LoRA variant; tensor parallel "
                                 "is built for plain LoRA")
            for adapter in wrapper.lora_A:
                r = int(wrapper.r[adapter])
                for part, want in (("lora_A", (r * n, in_f)), ("lora_B", (out_f, r * n))):
                    linear = getattr(wrapper, part)[adapter]
                    p = linear._parameters["weight"]
                    key = f"{fqn}{'.base_layer' * depth}.{part}.{adapter}.weight"
                    if isinstance(p, DTensor):
                        raise ValueError(f"LoRA factor '{key}' is already a DTensor ({p.placements}): "
                                         "apply tensor parallel once, before fully_shard")
                    if tuple(p.shape) != want:
                        raise ValueError(f"LoRA factor '{key}' has shape {list(p.shape)}, expected "
                                         f"{list(want)} (r={r}, {n} experts)")
                    if getattr(linear, "bias", None) is not None:
                        raise ValueError(f"LoRA factor '{key}' has a bias: LoRA on the experts under "
                                         "tensor parallel takes none")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, at = device_mesh.size(), device_mesh.get_local_rank()
        self._check(module, tp)
        chain = param_wrapper_chain(module)
        experts: nn.Module = chain[-1].base_layer
        # (factor's nn.Linear, its placement's role: "shard" (local = this rank's slice), "whole"
        # (Partial gradient), or the rows of this rank (packed: whole, rows indexed for the call))
        factors: list[tuple[nn.Module, str | torch.Tensor]] = []
        for wrapper in chain:
            split, fdim, packed = self._split(wrapper, experts)
            for adapter in wrapper.lora_A:
                for part in ("lora_A", "lora_B"):
                    linear = getattr(wrapper, part)[adapter]
                    p = linear._parameters["weight"]
                    role: str | torch.Tensor = "whole"
                    if part == split and packed and fdim == 0:
                        half = p.shape[0] // 2
                        rows = torch.arange(half).chunk(tp)[at]
                        role = torch.cat([rows, rows + half])
                    elif part == split:
                        role = "shard"
                    place: Placement = Replicate()
                    if role == "shard":
                        place = cast(Placement, StridedShard(fdim, split_factor=2)) if packed else Shard(fdim)
                    linear.register_parameter("weight", nn.Parameter(
                        distribute_tensor(p, device_mesh, [place], src_data_rank=self.src_data_rank),
                        requires_grad=p.requires_grad))
                    factors.append((linear, role))
        wrapped = [str(w.parameter_name) for w in chain]
        saved: list[tuple[list[tuple[nn.Module, Any]], dict[str, Any]]] = []

        def to_local(mod: nn.Module, args: Any) -> None:
            own: list[tuple[nn.Module, Any]] = []
            for linear, role in factors:
                p = linear._parameters["weight"]
                if not isinstance(p, DTensor):
                    continue
                own.append((linear, p))
                if isinstance(role, str) and role == "shard":
                    local = p.to_local()
                else:
                    local = p.to_local(grad_placements=[Partial()])
                    if isinstance(role, torch.Tensor):
                        local = local.index_select(0, role.to(local.device))
                linear._parameters["weight"] = local
            weights: dict[str, Any] = {}
            for n in wrapped:
                w = experts._parameters.get(n)
                if isinstance(w, DTensor):
                    weights[n] = w
                    experts._parameters[n] = w.to_local()
            saved.append((own, weights))

        def restore(mod: nn.Module, args: Any, out: Any) -> None:
            if not saved:
                return
            own, weights = saved.pop()
            for linear, p in own:
                linear._parameters["weight"] = p
            for n, p in weights.items():
                experts._buffers.pop(n, None)  # PEFT's parametrization left the local weight there
                experts._parameters[n] = p

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"MoEExpertsLoraTP(params={self.params})"

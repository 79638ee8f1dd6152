"""transformers' ``"mla_kv_a_proj"`` as a DTensor ``ParallelStyle``: the low-rank KV projection of
multi-head latent attention (DeepSeek-V2/V3, LongCat-Flash, GLM-4.5-Air-style ``glm4_moe_lite``,
dots3), whose output feeds both a colwise projection and, directly, the head-sharded attention.

``kv_a_proj_with_mqa`` maps the hidden states to ``[kv_lora_rank + qk_rope_head_dim]``. The first
part goes through ``kv_a_layernorm`` into ``kv_b_proj`` (colwise: its input gradient is summed over
the TP ranks by the colwise style's backward); the last ``qk_rope_head_dim`` features (the shared
rotary key) go straight into the attention, which each TP rank runs for its own heads only, so the
gradient a rank computes for them covers only its heads. transformers' ``MlaKvAProjParallel``
therefore keeps the projection replicated and sums that slice's gradient over the TP ranks in
backward; :class:`MlaKvAProj` does the same with DTensor's own placements (the rotary slice seen as
a replicated DTensor whose local view carries a ``Partial`` gradient: its backward is the sum).
The projection's parameters are left as they are (whole on every TP rank, sharded by FSDP over the
data-parallel mesh like any module outside the plan): their gradient, from the whole output
gradient, is the same on every TP rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["MlaKvAProj"]


class MlaKvAProj(ParallelStyle):
    """The last ``rope_dim`` output features' gradient summed over the TP ranks; nothing else.

    Args:
        rope_dim: the config's ``qk_rope_head_dim`` (the rotary key's width at the end of the
            projection's output).

    Example:
        >>> MlaKvAProj(rope_dim=64)
        MlaKvAProj(rope_dim=64)
    """

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim <= 0:
            raise ValueError(f"rope_dim must be a positive int (the config's qk_rope_head_dim), got {rope_dim!r}")
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = self.rope_dim
        out_features = getattr(module, "out_features", None)
        if isinstance(out_features, int) and out_features <= rope_dim:
            raise ValueError(f"'mla_kv_a_proj' on {type(module).__name__} with {out_features} output "
                             f"features: qk_rope_head_dim ({rope_dim}) must be fewer")

        def sum_rope_grad(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            rest, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False)
            return torch.cat([rest, rope.to_local(grad_placements=[Partial()])], dim=-1)

        module.register_forward_hook(sum_rope_grad)
        return module

    def __repr__(self) -> str:
        return f"MlaKvAProj(rope_dim={self.rope_dim})"

"""``weight_source(adapters="merged")``'s LoRA merges, planned from the model alone: which LoRA
layers of the active adapter merge into which base weight (:func:`lora_merges`), and PEFT's own
``merge_and_unload`` arithmetic for each (:class:`Merge`: ``lora.Linear`` and ``ParamWrapper`` on
fused experts), so the merged tensors are PEFT's bit for bit. :mod:`fsdptk._plans.hub_items` puts
them in a weight source's plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Merge", "lora_merges"]


@dataclass(frozen=True)
class Merge:
    """One LoRA layer of the active adapter, merged into its base weight as PEFT's ``merge_and_unload``
    does (``W += get_delta_weight()``), in PEFT's own op order and dtypes, so the merged tensor is
    PEFT's bit for bit.

    ``lora.Linear`` (``wrapper=False``): the delta is ``(B @ A) * scaling`` in B's dtype (computed in
    float32 for half-precision factors, as PEFT does on CPU), added in place (the sum in the
    promoted dtype, stored in W's). PEFT's ``ParamWrapper`` (``wrapper=True``, ``target_parameters``):
    with ``experts == 1`` (a 2-D parameter) the same product; on fused experts (``E = experts > 1``)
    A is ``(r * E, in)`` (expert ``e``'s block: rows ``e * r`` to ``e * r + r - 1``) and B
    ``(out, r * E)`` (expert ``e``'s block: columns ``e, E + e, 2E + e, ...``, PEFT's
    ``reshape(out, r, E)``), and the delta is PEFT's ``einsum`` of them in the factors' dtype times
    ``scaling``: ``(E, out, in)`` when ``swapped`` (transformers' experts stored ``(E, out, in)``),
    else ``(E, in, out)``. A wrapper's delta is cast to W's dtype before the addition."""

    a: str  # lora_A key
    b: str  # lora_B key
    scaling: float
    wrapper: bool = False  # a ParamWrapper (LoRA on a parameter), not lora.Linear
    experts: int = 1  # the wrapper's num_experts
    swapped: bool = False  # the wrapped parameter is (E, out, in)

    def merged(self, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``weight`` with this layer's delta from the full factors ``a`` and ``b`` added (a new
        tensor of ``weight``'s dtype and shape)."""
        if self.experts == 1:
            dtype = b.dtype
            if dtype in (torch.float16, torch.bfloat16):
                delta = ((b.float() @ a.float()) * self.scaling).to(dtype)
            else:
                delta = (b @ a) * self.scaling
        else:
            a3 = a.reshape(self.experts, -1, a.shape[-1])  # (E, r, in)
            b3 = b.reshape(b.shape[0], -1, self.experts)  # (out, r, E)
            spec = "o r e, e r i -> e o i" if self.swapped else "o r e, e r i -> e i o"
            delta = torch.einsum(spec, b3, a3) * self.scaling
        if self.wrapper:
            delta = delta.to(weight.dtype)
        return (weight + delta).to(weight.dtype)


def lora_merges(model: nn.Module, adapter: str) -> dict[str, Merge]:
    """``{base weight key: Merge}`` of every LoRA layer of ``adapter``: plain LoRA on linear layers
    and PEFT's ``ParamWrapper`` (LoRA on a parameter, e.g. fused MoE experts; nested wrappers each
    merge into their own parameter).

    Raises:
        NotImplementedError: a tuner or layer that is neither (named, with the reason).
    """
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    config = getattr(model, "peft_config", {}).get(adapter)
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None)))
    if kind != "LORA":
        raise NotImplementedError(f"adapters='merged' merges LoRA adapters; adapter {adapter!r} is {kind} "
                                  "(use adapters='only')")
    out: dict[str, Merge] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, LoraLayer) or adapter not in getattr(mod, "lora_A", {}):
            continue
        factors = (f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight", float(mod.scaling[adapter]))
        if isinstance(mod, ParamWrapper):
            key, merge = _wrapper_merge(name, mod, factors)
            out[key] = merge
            continue
        base = mod.get_base_layer()
        why = None
        if type(base) is not nn.Linear:
            why = f"its base layer is {type(base).__name__}, not torch.nn.Linear"
        elif getattr(mod, "use_dora", {}).get(adapter, False):
            why = "it uses DoRA"
        elif getattr(mod, "fan_in_fan_out", False):
            why = "it has fan_in_fan_out=True"
        elif getattr(mod, "lora_bias", {}).get(adapter, False):
            why = "it has a LoRA bias"
        elif getattr(mod, "merged_adapters", []):
            why = f"adapters {mod.merged_adapters} are already merged into it"
        if why is not None:
            raise NotImplementedError(f"adapters='merged': LoRA layer {name!r}: {why}; fsdptk merges plain LoRA "
                                      "on linear layers and PEFT's ParamWrapper (target_parameters) "
                                      "(use adapters='only' for this model)")
        out[f"{name}.base_layer.weight"] = Merge(*factors)
    return out


def _wrapper_merge(name: str, mod: Any, factors: tuple[str, str, float]) -> tuple[str, Merge]:
    """The wrapped parameter's key (under every nested wrapper's ``base_layer``) and its
    :class:`Merge`, read as PEFT 0.21's ``ParamWrapper.update_layer`` / ``get_delta_weight`` do.

    Raises:
        NotImplementedError: adapters already merged into it, or a parameter dtype PEFT merges
            through its low-precision path (float8), named.
    """
    path, inner = name, mod
    while hasattr(inner, "base_layer"):
        path, inner = f"{path}.base_layer", inner.base_layer
    param = getattr(inner, mod.parameter_name)
    why = None
    if getattr(mod, "merged_adapters", []):
        why = f"adapters {mod.merged_adapters} are already merged into it"
    elif param.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        why = f"its parameter {mod.parameter_name!r} is {param.dtype} (PEFT merges it in higher precision)"
    if why is not None:
        raise NotImplementedError(f"adapters='merged': PEFT ParamWrapper {name!r}: {why}; use adapters='only' "
                                  "for this model")
    swapped = param.dim() == 3 and not getattr(inner, "is_transposed", False)
    return f"{path}.{mod.parameter_name}", Merge(*factors, wrapper=True, experts=int(mod.num_experts),
                                                 swapped=swapped)

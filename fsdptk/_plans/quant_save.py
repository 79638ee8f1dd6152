"""Quantized saves: which checkpoint tensors a save quantizes, the file layout they take, and the
``quantization_config`` the release carries (the plan of ``save_safetensors(quantize=...)``).

Planned from shapes alone, before any tensor moves, the same on every rank. The tensors themselves
are quantized later, on the writer, by the dequantizing leaves' inverse
(:mod:`fsdptk._engine.sources.quant`, :mod:`fsdptk._engine.sources.quantize`).

Which tensors, by default, follows the releases (DeepSeek-V3/R1, Qwen3-*-FP8, gpt-oss): FP8
quantizes the linear weights of the decoder layers (the 2-D ``weight`` of every ``nn.Linear``
under ``layers.<i>``, and the experts' weights there, per expert or fused), never embeddings, the
head, norms, biases or the MoE routers (``gate``, ``router``, ``shared_expert_gate``); MXFP4
quantizes gpt-oss's fused experts (``mlp.experts.gate_up_proj`` / ``down_proj``). A
``quantize_if(name, tensor) -> bool`` predicate replaces the rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from fsdptk._engine.sources import TensorMeta
from fsdptk._engine.sources.quant import block_size_problem, scale_grid
from fsdptk._engine.sources.quantize import MXFP4_GROUP

__all__ = ["QUANTIZE_CHOICES", "QuantFormat", "QuantizedPlan", "quant_format", "plan_quantized", "scale_key"]

QUANTIZE_CHOICES = ("fp8", "fp8-ue8m0", "mxfp4")
ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})
_IN_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
_GPT_OSS_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")

QuantizeIf = Callable[[str, torch.Tensor], bool]


def scale_key(key: str) -> str:
    """The FP8 scales' key of weight ``key`` (as the releases and fsdptk's reader name them).

    Example:
        >>> scale_key("model.layers.0.mlp.down_proj.weight"), scale_key("mlp.experts.down_proj")
        ('model.layers.0.mlp.down_proj.weight_scale_inv', 'mlp.experts.down_proj_scale_inv')
    """
    return key[:-len(".weight")] + ".weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"


@dataclass(frozen=True)
class QuantFormat:
    """One release format.

    Args:
        method: ``"fp8"`` (e4m3 with block scales) or ``"mxfp4"`` (gpt-oss's blocks and scales).
        block: FP8's ``(rows, columns)`` per scale (MXFP4: groups of 32, fixed).
        ue8m0: FP8 scales rounded up to powers of two (``scale_fmt: "ue8m0"``).
    """

    method: Literal["fp8", "mxfp4"]
    block: tuple[int, int] = (128, 128)
    ue8m0: bool = False

    def problem(self, meta: TensorMeta) -> str | None:
        """Why a tensor of ``meta`` cannot take this format, or ``None``."""
        if not meta.dtype.is_floating_point:
            return f"it is {meta.dtype}, not floating"
        if len(meta.shape) < 2:
            return f"it has shape {list(meta.shape)}; {self.method} quantizes tensors of at least 2 dims"
        if self.method == "mxfp4" and meta.shape[-2] % MXFP4_GROUP:
            return (f"its dim -2 ({meta.shape[-2]}, shape {list(meta.shape)}) is not a multiple of "
                    f"{MXFP4_GROUP}, MXFP4's group")
        return None

    def file_metas(self, key: str, meta: TensorMeta) -> dict[str, TensorMeta]:
        """The checkpoint tensors that weight ``key`` becomes in this format.

        Example:
            >>> fmt = QuantFormat("fp8", (128, 128))
            >>> {k: (m.shape, m.dtype) for k, m in fmt.file_metas("w.weight", TensorMeta((576, 7168), torch.bfloat16)).items()}
            {'w.weight': ((576, 7168), torch.float8_e4m3fn), 'w.weight_scale_inv': ((5, 56), torch.float32)}
        """
        shape = tuple(meta.shape)
        if self.method == "fp8":
            return {key: TensorMeta(shape, torch.float8_e4m3fn),
                    scale_key(key): TensorMeta(scale_grid(shape, self.block), torch.float32)}
        *lead, cols, rows = shape
        groups = (*lead, rows, cols // MXFP4_GROUP)
        return {key + "_blocks": TensorMeta((*groups, 16), torch.uint8),
                key + "_scales": TensorMeta(groups, torch.uint8)}

    def config(self, not_converted: list[str]) -> dict[str, Any]:
        """The ``quantization_config`` of ``config.json`` (as the releases write it).

        Example:
            >>> QuantFormat("fp8", (128, 128), ue8m0=True).config(["lm_head"])  # doctest: +NORMALIZE_WHITESPACE
            {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
             'weight_block_size': [128, 128], 'modules_to_not_convert': ['lm_head'], 'scale_fmt': 'ue8m0'}
        """
        if self.method == "mxfp4":
            return {"quant_method": "mxfp4", "modules_to_not_convert": list(not_converted)}
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": list(self.block), "modules_to_not_convert": list(not_converted)}
        if self.ue8m0:
            out["scale_fmt"] = "ue8m0"
        return out


def quant_format(quantize: Any, block_size: Any, quantize_if: Any = None) -> QuantFormat | None:
    """``save_safetensors``' ``quantize`` / ``block_size`` / ``quantize_if`` checked, as a format
    (``None``: no quantization).

    Raises:
        ValueError: ``quantize`` is not one of :data:`QUANTIZE_CHOICES` or ``None``; ``block_size``
            is not two positive ints (``None`` is accepted where no FP8 block is sized: ``quantize``
            ``None`` or ``"mxfp4"``); each names the argument and its value.
        TypeError: ``quantize_if`` is neither ``None`` nor callable.

    Example:
        >>> quant_format("fp8-ue8m0", (128, 64))
        QuantFormat(method='fp8', block=(128, 64), ue8m0=True)
        >>> quant_format(None, None) is None, quant_format("mxfp4", None)
        (True, QuantFormat(method='mxfp4', block=(128, 128), ue8m0=False))
        >>> quant_format("int8", (128, 128))
        Traceback (most recent call last):
        ValueError: quantize must be None, 'fp8', 'fp8-ue8m0' or 'mxfp4', got 'int8'
    """
    if quantize is not None and (not isinstance(quantize, str) or quantize not in QUANTIZE_CHOICES):
        raise ValueError(f"quantize must be None, 'fp8', 'fp8-ue8m0' or 'mxfp4', got {quantize!r}")
    fp8 = quantize in ("fp8", "fp8-ue8m0")
    if block_size is not None or fp8:  # None: no FP8 block to size (unquantized, or MXFP4's fixed groups)
        problem = block_size_problem(block_size)
        if problem is not None:
            raise ValueError(f"block_size must be two positive ints (block rows, block columns)"
                             f"{'' if fp8 else ' or None'}: {problem}")
    if quantize_if is not None and not callable(quantize_if):
        raise TypeError(f"quantize_if must be a callable (name, tensor) -> bool or None, got {quantize_if!r}")
    if quantize is None:
        return None
    if quantize == "mxfp4":
        return QuantFormat("mxfp4")
    return QuantFormat("fp8", (int(block_size[0]), int(block_size[1])), ue8m0=quantize == "fp8-ue8m0")


@dataclass(frozen=True)
class QuantizedPlan:
    """A quantized save's layout: ``metas`` (every checkpoint tensor, quantized ones as their
    weight and scales), ``written`` (the keys written in their own dtype, not cast: the quantized
    weights and their scales), ``config`` (the ``quantization_config``), ``chosen`` (the
    checkpoint keys quantized, in order)."""

    metas: dict[str, TensorMeta]
    written: dict[str, torch.dtype]
    config: dict[str, Any]
    chosen: tuple[str, ...]


def _is_linear_weight(model: nn.Module, owner: str) -> bool:
    module_name, _, leaf = owner.rpartition(".")
    if leaf != "weight":
        return False
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    return isinstance(module, nn.Linear) and module_name.rpartition(".")[2] not in ROUTER_NAMES


def _default(model: nn.Module, fmt: QuantFormat, key: str, owner: str, meta: TensorMeta) -> bool:
    """The releases' rule (module docstring) for checkpoint ``key`` of model tensor ``owner``."""
    if fmt.problem(meta) is not None or not _IN_LAYER.search(owner) or "bias" in key.rpartition(".")[2]:
        return False
    if fmt.method == "mxfp4":
        return key == owner and owner.endswith(_GPT_OSS_EXPERTS) and len(meta.shape) == 3
    if ".experts." in owner and (key.endswith(".weight") or len(meta.shape) >= 3):
        return True
    return len(meta.shape) == 2 and _is_linear_weight(model, owner)


def _chosen_by(quantize_if: QuantizeIf, key: str, meta: TensorMeta) -> bool:
    got = quantize_if(key, torch.empty(meta.shape, dtype=meta.dtype, device="meta"))
    if not isinstance(got, bool):
        raise TypeError(f"quantize_if({key!r}, tensor) returned {got!r}; it must return a bool")
    return got


def _module(key: str) -> str:
    return key.rpartition(".")[0]


def plan_quantized(model: nn.Module, fmt: QuantFormat, metas: Mapping[str, TensorMeta],
                   owners: Mapping[str, str], quantize_if: QuantizeIf | None = None) -> QuantizedPlan:
    """The layout of a quantized save of ``model``.

    Args:
        model: the model (for the module types of the default rule).
        fmt: the format.
        metas: the unquantized save's checkpoint tensors (key -> shape and the dtype written).
        owners: checkpoint key -> the model key it is written from.
        quantize_if: ``(checkpoint key, meta tensor of its shape and dtype) -> bool``, replacing
            the default rule for every floating tensor.

    Raises:
        ValueError: ``quantize_if`` chose a tensor the format cannot take (named, with why);
            nothing to quantize (``mxfp4`` of a model without gpt-oss experts, names the model).
        TypeError: ``quantize_if`` returned something other than a bool.
    """
    chosen: list[str] = []
    for key, meta in metas.items():
        if quantize_if is None:
            take = _default(model, fmt, key, owners.get(key, key), meta)
        else:
            take = meta.dtype.is_floating_point and _chosen_by(quantize_if, key, meta)
            problem = fmt.problem(meta) if take else None
            if problem is not None:
                raise ValueError(f"quantize_if chose {key!r} for {fmt.method}, but {problem}")
        if take:
            chosen.append(key)
    if not chosen:
        name = type(model).__name__
        if fmt.method == "mxfp4" and quantize_if is None:
            raise ValueError(
                f"quantize='mxfp4' writes gpt-oss's MXFP4 experts (3-D '...mlp.experts.gate_up_proj' and "
                f"'...mlp.experts.down_proj' under layers.<i>); {name} has none: use quantize='fp8', or "
                "choose the tensors with quantize_if")
        raise ValueError(f"quantize={fmt.method!r}: no tensor of {name} is quantized "
                         f"({'quantize_if chose none' if quantize_if is not None else 'no linear weight under layers.<i>'}); "
                         "choose the tensors with quantize_if, or save with quantize=None")
    picked = set(chosen)
    out: dict[str, TensorMeta] = {}
    written: dict[str, torch.dtype] = {}
    for key, meta in metas.items():
        if key in picked:
            parts = fmt.file_metas(key, meta)
            out.update(parts)
            written.update({k: m.dtype for k, m in parts.items()})
        else:
            out[key] = meta
    converted = {_module(k) for k in chosen}
    kept = [m for m in dict.fromkeys(_module(k) for k, meta in metas.items()
                                     if k not in picked and meta.dtype.is_floating_point)
            if m and m not in converted and not any(c.startswith(m + ".") for c in converted)]
    return QuantizedPlan(metas=out, written=written, config=fmt.config(kept), chosen=tuple(chosen))

"""NF4 (torchao ``NF4Tensor``) support: the only fsdptk code that imports torchao, lazily. Public as
:mod:`fsdptk.nf4`; here, in ``_core``, so the engine's NF4 layouts use it without importing a public
module.

NF4 parameters (QLoRA's frozen base weights) are loaded, sharded and gathered like any other
parameter. Their quantisation statistics (``scaler_mean``, the double-quantised scalers) are per
tensor, so a shard is never quantised on its own: loading re-quantises the FULL tensor with the
parameter's own ``block_size`` / ``scaler_block_size`` and then takes this rank's dim-0 chunk with
torchao's own split (the layout FSDP2 uses for NF4); gathering dequantises each shard to the
original dtype. Both torchao layouts are supported: ``torchao.quantization`` (0.18+) and the older
``torchao.dtypes.nf4tensor``.

Detection (:func:`is_nf4`) never imports torchao, so a model without NF4 never loads it.

Examples:
    >>> import torch
    >>> from fsdptk.nf4 import to_nf4, is_nf4, dequantize
    >>> q = to_nf4(torch.randn(16, 64, dtype=torch.bfloat16), block_size=64, scaler_block_size=8)
    >>> is_nf4(q), dequantize(q).dtype
    (True, torch.bfloat16)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any, cast

import torch

_MODULES = ("torchao.quantization", "torchao.dtypes.nf4tensor", "torchao.dtypes")


def _torchao_nf4() -> Any:
    """The torchao module that defines ``NF4Tensor`` and ``to_nf4`` (new path first)."""
    errors = []
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:  # pragma: no cover - depends on the installed torchao
            errors.append(f"{name}: {e}")
            continue
        if hasattr(mod, "NF4Tensor") and hasattr(mod, "to_nf4"):
            return mod
    raise ImportError(  # pragma: no cover - depends on the installed torchao
        "NF4 support needs torchao (pip install torchao); tried " + "; ".join(errors or _MODULES)
    )


def is_nf4(tensor: Any) -> bool:
    """Tell whether ``tensor`` is a torchao ``NF4Tensor`` (not a DTensor wrapping one).

    Never imports torchao: an NF4Tensor can only exist once torchao has been imported.

    Args:
        tensor: any object.

    Returns:
        bool: whether it is an ``NF4Tensor``.

    Examples:
        >>> import torch
        >>> from fsdptk.nf4 import is_nf4
        >>> is_nf4(torch.zeros(2))
        False
    """
    # O(1): a plain tensor, or torchao never imported (importing any torchao module imports "torchao")
    if not isinstance(tensor, torch.Tensor) or type(tensor) is torch.Tensor or "torchao" not in sys.modules:
        return False
    return any(
        c.__name__ == "NF4Tensor" and c.__module__.startswith("torchao") for c in type(tensor).__mro__
    )


def to_nf4(tensor: torch.Tensor, block_size: int = 64, scaler_block_size: int = 256) -> torch.Tensor:
    """Quantise ``tensor`` to NF4 with torchao (either module path).

    Args:
        tensor: a floating tensor (its dtype is kept as the NF4 tensor's original dtype).
        block_size: elements per quantisation block.
        scaler_block_size: blocks per double-quantisation block.

    Returns:
        torch.Tensor: an ``NF4Tensor``.

    Raises:
        ImportError: when torchao is not installed.

    Examples:
        >>> import torch
        >>> from fsdptk.nf4 import to_nf4
        >>> to_nf4(torch.randn(16, 64), 64, 8).shape
        torch.Size([16, 64])
    """
    return _torchao_nf4().to_nf4(tensor, block_size, scaler_block_size)


def nf4_block_sizes(tensor: torch.Tensor) -> tuple[int, int]:
    """Return ``(block_size, scaler_block_size)`` of an NF4 tensor.

    Args:
        tensor: an ``NF4Tensor``.

    Returns:
        tuple[int, int]: the block sizes it was quantised with.

    Examples:
        >>> import torch
        >>> from fsdptk.nf4 import to_nf4, nf4_block_sizes
        >>> nf4_block_sizes(to_nf4(torch.randn(16, 64), 64, 8))
        (64, 8)
    """
    nf4: Any = tensor  # an NF4Tensor: torchao adds these attributes
    return int(nf4.block_size), int(nf4.scaler_block_size)


def quantize_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Quantise a FULL tensor with the block sizes and original dtype of the NF4 tensor ``like``.

    Args:
        full: the full-precision full tensor (any float dtype; cast to ``like.dtype`` first).
        like: an ``NF4Tensor`` (a shard, or a meta tensor) giving block sizes and dtype.

    Returns:
        torch.Tensor: the full ``NF4Tensor``.

    Raises:
        ValueError: when torchao rejects the shape for these block sizes (names both).

    Examples:
        >>> import torch
        >>> from fsdptk.nf4 import to_nf4, quantize_like
        >>> like = to_nf4(torch.zeros(16, 64, dtype=torch.bfloat16), 64, 8)
        >>> quantize_like(torch.randn(16, 64), like).dtype
        torch.bfloat16
    """
    block, scaler_block = nf4_block_sizes(like)
    try:
        return to_nf4(full.to(like.dtype), block, scaler_block)
    except AssertionError as e:
        raise ValueError(
            f"cannot quantise a tensor of shape {tuple(full.shape)} to NF4 with block_size={block}, "
            f"scaler_block_size={scaler_block}: {e}"
        ) from e


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """Dequantise an ``NF4Tensor`` to a plain tensor of its original dtype and shape.

    Args:
        tensor: an ``NF4Tensor`` (full or a shard).

    Returns:
        torch.Tensor: a plain tensor.

    Examples:
        >>> import torch
        >>> from fsdptk.nf4 import to_nf4, dequantize
        >>> dequantize(to_nf4(torch.randn(16, 64), 64, 8)).shape
        torch.Size([16, 64])
    """
    nf4: Any = tensor  # an NF4Tensor
    return nf4.get_original_weight()


def chunk(tensor: torch.Tensor, path: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Take nested dim-0 chunks of an NF4 tensor, torchao's split (the layout FSDP2 uses).

    Args:
        tensor: a full ``NF4Tensor``.
        path: ``[(num_chunks, index), ...]``, applied in order (one per sharded mesh dim).

    Returns:
        torch.Tensor: the chunk, an ``NF4Tensor`` whose inner tensors are fresh copies.

    Raises:
        ValueError: when torchao cannot split the tensor evenly (names shape and chunks).

    Examples:
        >>> import torch
        >>> from fsdptk.nf4 import to_nf4, chunk
        >>> chunk(to_nf4(torch.randn(16, 64), 64, 8), [(2, 1)]).shape
        torch.Size([8, 64])
    """
    out = tensor
    for num, index in path:
        if out.dim() == 0 or out.size(0) % num:  # torchao would silently mis-split
            raise ValueError(
                f"cannot split an NF4 tensor of shape {list(out.shape)} into {num} dim-0 chunks: "
                f"NF4 shards must be even (dim 0 divisible by {num})"
            )
        try:
            out = torch.chunk(out, num, dim=0)[index]
        except AssertionError as e:
            raise ValueError(
                f"cannot split an NF4 tensor of shape {list(out.shape)} into {num} dim-0 chunks "
                f"(torchao needs every block count divisible by the chunk count): {e}"
            ) from e
    return from_inner_tensors([t.clone() for t in inner_tensors(out)], out)


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors an ``NF4Tensor`` is made of, in ``__tensor_flatten__`` order.

    Args:
        tensor: an ``NF4Tensor``.

    Returns:
        list[torch.Tensor]: its inner tensors (quantised data, scalers, ...).

    Examples:
        >>> import torch
        >>> from fsdptk.nf4 import to_nf4, inner_tensors
        >>> [t.dtype for t in inner_tensors(to_nf4(torch.randn(16, 64), 64, 8))][0]
        torch.uint8
    """
    names, _ = cast(Any, tensor).__tensor_flatten__()
    return [getattr(tensor, n) for n in names]


def from_inner_tensors(parts: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Rebuild an ``NF4Tensor`` from inner tensors laid out like ``like`` (same shape and blocks).

    Args:
        parts: inner tensors, in :func:`inner_tensors` order, on the device wanted.
        like: an ``NF4Tensor`` with the wanted outer shape and block sizes (may be on meta).

    Returns:
        torch.Tensor: the ``NF4Tensor`` on the parts' device.

    Examples:
        >>> import torch
        >>> from fsdptk.nf4 import to_nf4, inner_tensors, from_inner_tensors, dequantize
        >>> q = to_nf4(torch.randn(16, 64), 64, 8)
        >>> dequantize(from_inner_tensors(inner_tensors(q), q)).equal(dequantize(q))
        True
    """
    names, ctx = cast(Any, like).__tensor_flatten__()
    ctx = dict(ctx)
    meta = ctx.get("tensor_meta")
    if meta is not None and parts and hasattr(meta, "_replace"):
        ctx["tensor_meta"] = meta._replace(device=parts[0].device)
    elif meta is not None and parts and hasattr(meta, "device"):  # pragma: no cover - old torchao
        import dataclasses

        ctx["tensor_meta"] = dataclasses.replace(meta, device=parts[0].device)
    inner = dict(zip(names, parts))
    return cast(Any, type(like)).__tensor_unflatten__(inner, ctx, like.size(), like.stride())

"""NF4 (torchao ``NF4Tensor``) support: detection, quantisation, chunks and inner tensors.

fsdptk loads, shards and gathers NF4 parameters like any other; these are the helpers it uses,
public for users who build NF4 models. torchao is imported lazily, on first use (never by
:func:`is_nf4`). The implementation lives in ``fsdptk._core.nf4`` (the engine uses it too).

Examples:
    >>> import torch
    >>> from fsdptk.nf4 import to_nf4, is_nf4, dequantize
    >>> q = to_nf4(torch.randn(16, 64), 64, 8)
    >>> is_nf4(q), is_nf4(dequantize(q))
    (True, False)
"""

from __future__ import annotations

from fsdptk._core.nf4 import (
    chunk,
    dequantize,
    from_inner_tensors,
    inner_tensors,
    is_nf4,
    nf4_block_sizes,
    quantize_like,
    to_nf4,
)

__all__ = [
    "is_nf4",
    "to_nf4",
    "nf4_block_sizes",
    "quantize_like",
    "dequantize",
    "chunk",
    "inner_tensors",
    "from_inner_tensors",
]

"""The wire format of the engine: flat byte buffers of aligned pieces, and buckets of tensors.

A bucket is a run of consecutive tensors whose full bytes add up to about ``bucket_bytes``; for
each bucket a rank's pieces travel as ONE flat ``uint8`` buffer, each piece at a 16-byte aligned
offset so that any dtype can be viewed out of it without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024  # small enough that packing overlaps sending
# without src_rank0 no tensor moves, so the status agreement is the only collective of the data
# phase: it runs once per this many buckets (16 MiB buckets: every 256 MiB of full tensors)
LOCAL_AGREE_BUCKETS = 16
ALIGN = 16  # byte alignment of every piece inside a flat buffer (any dtype can be viewed)


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def aligned(n: int) -> int:
    """``n`` rounded up to the piece alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def packed_size(parts: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """Bytes of a flat buffer holding pieces of these ``(shape, dtype)``s."""
    return sum(aligned(nbytes(s, d)) for s, d in parts)


def pack(buf: torch.Tensor, off: int, t: torch.Tensor) -> int:
    """Copy ``t`` into ``buf`` at byte ``off``; the offset of the next piece."""
    n = t.numel() * t.element_size()
    if n:
        buf[off : off + n].view(t.dtype).view(t.shape).copy_(t)
    return off + aligned(n)


def unpack(buf: torch.Tensor | None, off: int, shape: Sequence[int], dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, int]:
    """The piece of ``shape``/``dtype`` at byte ``off`` of ``buf`` on ``device`` (a view when
    already there), and the offset of the next piece."""
    n = nbytes(shape, dtype)
    if n == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=device), off
    assert buf is not None
    t = buf[off : off + n].view(dtype).view(tuple(shape))
    if t.device != device:
        t = t.to(device)
    return t, off + aligned(n)


def buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Greedy consecutive buckets of indices; a tensor larger than a bucket travels alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if cur and total + n > bucket_bytes:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        out.append(cur)
    return out

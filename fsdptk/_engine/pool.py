"""Reused CPU memory for one gather (:func:`fsdptk._engine.collect`): the full tensors a
destination yields and the flat buffers that cross the wire, taken from blocks that an earlier
bucket of the same call used and nobody holds any more.

Why: a fresh CPU tensor of more than glibc's mmap threshold (at most 32 MiB, and every block of
128 KiB or more where ``MALLOC_MMAP_THRESHOLD_`` says so) is fresh pages, and the first write to
each page is a fault: filling fresh memory costs about 2.5x filling warm memory on this project's
machine (a 256 MiB copy: 0.196 s fresh, 0.079 s reused). A weight source streams the whole model
every step, so fresh full tensors would pay that on every byte of every pass.

Safe by construction: a block is reused only while its storage has no user but the pool
(:func:`fsdptk._core.compat.storage_users`), so a consumer that keeps a yielded tensor, or any view
of it, keeps its block out of the pool; the tensors a consumer holds are never written over. A
block is reused only for a request of exactly its size (a model's tensors repeat layer after layer,
so exact sizes recur, and no request pins a larger block). Before a new block is made, free blocks
are dropped (those of sizes no later request needs first, then the oldest) until every block, free
or held, and the new one add up to at most ``cap``. A gather's own pool lives for one call (its
memory is returned when the call's generator ends) and its cap is about the peak the gather has
without it (the bucket being filled and the one the consumer holds), so it saves time and adds no
memory. A pool the caller keeps between calls (``weight_source(keep_buffers=True)``) is given
about two of the largest tensors, so that a pass after the first writes into warm memory only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from fsdptk._core.compat import storage_users

__all__ = ["Pool"]


class Pool:
    """Exact-size CPU blocks, reused once nothing but the pool holds them.

    Args:
        cap: the bytes the blocks, free and held, may add up to when a new one is made (free
            blocks are dropped to make room: first those of sizes no later request in ``expected``
            needs, then the oldest; held blocks stay, so a consumer that keeps everything goes
            over it, as it would without the pool).
        expected: the byte sizes of the requests to come, as far as the caller knows them (one
            entry per request; the rest are unforeseen).

    Examples:
        >>> pool = Pool(cap=1 << 20, expected=[64, 64, 64, 64])
        >>> a = pool.take((4, 4), torch.float32)
        >>> ptr = a.data_ptr()
        >>> del a  # the caller is done with it: its block may serve the next request of 64 bytes
        >>> pool.take((2, 8), torch.float32).data_ptr() == ptr
        True
        >>> kept = pool.take((16,), torch.float32)  # held by the caller: never handed out again
        >>> pool.take((16,), torch.float32).data_ptr() == kept.data_ptr()
        False
    """

    def __init__(self, cap: int, expected: Iterable[int] = ()) -> None:
        self.cap = cap
        self._expected = Counter(expected)
        self._blocks: dict[int, list[tuple[int, torch.Tensor]]] = {}  # size -> (creation number, block)
        self._made = 0
        self._knows = storage_users(torch.empty(0)) is not None  # this torch says who holds a storage
        self.reused = 0  # bytes served from reused blocks (for tests and profiles)

    def prepare(self, cap: int, expected: Iterable[int] = ()) -> None:
        """Start another call with the blocks kept from the last (a pool kept between calls:
        ``weight_source(keep_buffers=True)``): its cap and expected sizes, free blocks over the cap
        dropped (those no request of the call needs first)."""
        self.cap = cap
        self._expected = Counter(expected)
        self._trim(0)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype`` (a reused block when one of exactly
        its bytes is free)."""
        n = 1
        for s in shape:
            n *= int(s)
        size = n * dtype.itemsize
        self._expected[size] -= 1
        if size == 0 or not self._knows:  # nothing to reuse, or no way to know who holds a block
            return torch.empty(tuple(shape), dtype=dtype)
        block = next((b for _, b in self._blocks.get(size, ()) if storage_users(b) == 1), None)
        if block is None:
            self._trim(size)
            block = torch.empty(size, dtype=torch.uint8)
            self._made += 1
            self._blocks.setdefault(size, []).append((self._made, block))
        else:
            self.reused += size
        return block.view(dtype).view(tuple(shape))

    def trim(self) -> None:
        """Drop free blocks until the blocks add up to at most ``cap`` (the end of a call: what a
        pool kept between calls holds until the next)."""
        self._trim(0)

    def nbytes(self) -> int:
        """The bytes of every block, free or held."""
        return sum(size * len(bs) for size, bs in self._blocks.items())

    def _trim(self, new: int) -> None:
        """Drop free blocks while every block and ``new`` more bytes add up to over ``cap``: those no
        expected request needs first, then the oldest."""
        total = self.nbytes() + new
        if total <= self.cap:
            return
        free = [(self._expected[size] > 0, made, size) for size, bs in self._blocks.items()
                for made, b in bs if storage_users(b) == 1]
        gone: set[int] = set()
        for _, made, size in sorted(free):  # not expected first, then the oldest
            if total <= self.cap:
                break
            gone.add(made)
            total -= size
        for size in list(self._blocks):
            self._blocks[size] = [(m, b) for m, b in self._blocks[size] if m not in gone]
            if not self._blocks[size]:
                del self._blocks[size]

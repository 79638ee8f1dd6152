"""Reused CPU memory for one gather (:func:`fsdptk._engine.collect`): the flat buffers that cross
the wire and, where the consumer opted in, the full tensors a destination yields, taken from blocks
that an earlier bucket (or, kept between calls, an earlier call) used and nobody holds any more.

Why: a fresh CPU tensor of more than glibc's mmap threshold (at most 32 MiB, and every block of
128 KiB or more where ``MALLOC_MMAP_THRESHOLD_`` says so) is fresh pages, and the first write to
each page is a fault: filling fresh memory costs about 2.5x filling warm memory on this project's
machine (a 256 MiB copy: 0.196 s fresh, 0.079 s reused). A weight source streams the whole model
every step, so fresh full tensors would pay that on every byte of every pass.

The consumer contract (what may be reused):

- Memory the engine never handed out (its flat send and receive buffers) is reused whenever nothing
  holds it: the gather's own pool, every call.
- Memory it handed out (a yielded full tensor) is the consumer's, whatever the consumer does with
  it (keeps a view, its storage object, a raw pointer, shares it with another process), so by
  default it is never taken from a pool. Reusing it is an opt-in of the caller
  (``weight_source(keep_buffers=True)``, or fsdptk's own file writer, which drops each tensor once
  written): such a block is reused once no tensor, view or Python storage object holds it
  (:func:`fsdptk._core.compat.storage_users`); raw pointers are the consumer's to keep valid (it
  holds the tensor while it uses one); and a block whose storage was shared with another process
  (``share_memory_()``, or sent through a ``torch.multiprocessing`` queue, which does that) is never
  reused: the pool forgets it, so it is freed when the last holder lets go.

A block is reused only for a request of exactly its size (a model's tensors repeat layer after
layer, so exact sizes recur, and no request pins a larger block). Before a new block is made, free
blocks are dropped (those of sizes no later request needs first, then the oldest) until every
block, free or held, and the new one add up to at most ``cap``. A gather's own pool lives for one
call (its memory is returned when the call's generator ends) and its cap is about the peak the
gather has without it, so it saves time and adds no memory. A pool the caller keeps between calls
ends each call with :meth:`Pool.trim`: blocks, free or still held, are dropped (forgotten, when
held: freed once their holder lets go) until they add up to at most ``cap``, so what it keeps
between calls is within ``cap`` whenever the consumer drops its tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from fsdptk._core.compat import storage_users

__all__ = ["Pool"]

SMALL = 128 * 1024  # glibc's default mmap threshold: malloc serves smaller blocks from its heap, warm


class Pool:
    """Exact-size CPU blocks, reused once nothing but the pool holds them.

    Args:
        cap: the bytes the blocks, free and held, may add up to when a new one is made (free
            blocks are dropped to make room: first those of sizes no later request in ``expected``
            needs, then the oldest; held blocks stay, so a consumer that keeps everything goes
            over it within a call, as it would without the pool), and at the end of a call
            (:meth:`trim`: held blocks are forgotten too).
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
        >>> storage = pool.take((16,), torch.float32).untyped_storage()  # its storage object, kept
        >>> pool.take((16,), torch.float32).data_ptr() == storage.data_ptr()
        False
        >>> shared = pool.take((4, 4), torch.float32).share_memory_()  # sent to another process
        >>> ptr = shared.data_ptr()
        >>> del shared
        >>> pool.take((4, 4), torch.float32).data_ptr() == ptr  # forgotten: never written over
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
        self._forget_shared(size)
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
        """The end of a call: what a pool kept between calls holds until the next. Blocks shared
        with another process are forgotten; then blocks are dropped until they add up to at most
        ``cap``, free or held (a held one is forgotten: it is freed when its holder lets go): those
        under ``SMALL`` bytes first (malloc serves them warm from its heap), then the oldest."""
        self._forget_shared()
        self._trim(0, end=True)

    def nbytes(self) -> int:
        """The bytes of every block, free or held."""
        return sum(size * len(bs) for size, bs in self._blocks.items())

    def _forget_shared(self, size: int | None = None) -> None:
        """Forget every block (of ``size``, or all) whose storage was shared with another process:
        never reused, freed when its last holder lets go."""
        for s in [size] if size is not None else list(self._blocks):
            bs = self._blocks.get(s)
            if bs and any(b.untyped_storage().is_shared() for _, b in bs):
                kept = [(m, b) for m, b in bs if not b.untyped_storage().is_shared()]
                if kept:
                    self._blocks[s] = kept
                else:
                    del self._blocks[s]

    def _trim(self, new: int, end: bool = False) -> None:
        """Drop free blocks while every block and ``new`` more bytes add up to over ``cap``: those
        no expected request needs first, then the oldest. ``end`` (of a call): held blocks too, and
        those under ``SMALL`` bytes before the others."""
        total = self.nbytes() + new
        if total <= self.cap:
            return
        candidates = [(self._expected[size] > 0, end and size >= SMALL, made, size) for size, bs in self._blocks.items()
                      for made, b in bs if end or storage_users(b) == 1]
        gone: set[int] = set()
        for *_, made, size in sorted(candidates):
            if total <= self.cap:
                break
            gone.add(made)
            total -= size
        for size in list(self._blocks):
            self._blocks[size] = [(m, b) for m, b in self._blocks[size] if m not in gone]
            if not self._blocks[size]:
                del self._blocks[size]

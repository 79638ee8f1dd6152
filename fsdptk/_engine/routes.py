"""Routes of a gather: who sends which box of every item to its destination, bucket by bucket,
and each rank's point-to-point messages of a bucket. Pure functions of the agreed holdings: every
rank derives the same plan without looking at a tensor's values, and the sender's and the
receiver's list of one pair's messages are the same list, so every message is matched (the
point-to-point order of :mod:`fsdptk._engine.wire`; tests/test_engine.py simulates these plans).
:func:`fsdptk._engine.gather.collect` moves the bytes along them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fsdptk._engine.layouts import Box, box_shape, is_dim0_run
from fsdptk._engine.wire import buckets, is_direct, nbytes, packed_size


class Holdings(NamedTuple):
    """Who holds which part of every item, as :func:`~fsdptk._engine.gather.collect` agreed it (the same on every rank):
    the input of a ``dest`` callable."""

    boxes: list[list[Box | None]]  # per rank, per item: the box of the full tensor it holds, or None
    hosts: list[str]  # per rank: its host (host name and network namespace)


def _box_key(box: Box) -> tuple[Any, ...]:
    """A hashable key of a box (slices are not hashable before Python 3.12)."""
    return tuple((b.start, b.stop) if isinstance(b, slice) else ("at", *b) for b in box)


def choose_senders(holdings: Holdings, dests: Sequence[int]) -> list[list[Box | None]]:
    """Per rank, per item, the box it sends to the item's destination (or keeps, when it is the
    destination), ``None`` when it sends nothing: every distinct box once, from the destination
    itself when it holds it, else from a holder on the destination's host, else from the
    lowest-ranked holder. Pure: every rank derives the same answer from the agreed holdings.

    Examples:
        >>> b0, b1 = (slice(0, 2),), (slice(2, 4),)
        >>> h = Holdings(boxes=[[b0], [b1], [b0], [b1]], hosts=["a", "a", "b", "b"])
        >>> choose_senders(h, [3])  # rank 3 holds b1 and takes b0 from rank 2, on its own host
        [[None], [None], [(slice(0, 2, None),)], [(slice(2, 4, None),)]]
    """
    world = len(holdings.boxes)
    sends: list[list[Box | None]] = [[None] * len(dests) for _ in range(world)]
    for i, d in enumerate(dests):
        groups: dict[tuple[Any, ...], list[int]] = {}
        for r in range(world):
            b = holdings.boxes[r][i]
            if b is not None:
                groups.setdefault(_box_key(b), []).append(r)
        for holders in groups.values():
            near = [h for h in holders if holdings.hosts[h] == holdings.hosts[d]]
            r = d if d in holders else (near or holders)[0]
            sends[r][i] = holdings.boxes[r][i]
    return sends


class Transfer(NamedTuple):
    """One point-to-point message of a bucket of :func:`~fsdptk._engine.gather.collect`, as one of its two ends
    posts it.

    Both ends derive it from the agreed :class:`GatherPlan` (:func:`bucket_transfers`): the same
    bucket, peer, items, size and order per pair and direction, so every message is matched."""

    recv: bool  # this rank receives it (it is the items' destination); else it sends it
    peer: int  # the rank at the other end
    items: tuple[int, ...]  # the items whose pieces it carries, in order
    packed: bool  # the small pieces of ``items`` in one flat buffer; else one large dim-0 piece alone
    nbytes: int  # its size in bytes


class GatherPlan(NamedTuple):
    """Who sends what to whom in :func:`~fsdptk._engine.gather.collect`, bucket by bucket: the same on every rank,
    made from the agreed holdings by :func:`plan_gather` without looking at any tensor's values."""

    shapes: list[tuple[int, ...]]  # per item, its full shape
    dtypes: list[torch.dtype]  # per item, its dtype
    dests: list[int]  # per item, its destination rank
    sends: list[list[Box | None]]  # per rank, per item: the box it sends (its own, at the destination)
    direct: list[list[bool]]  # per rank, per item: its piece travels alone, received into the full tensor
    buckets: list[list[int]]  # the items of each bucket, in order


def plan_gather(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], holdings: Holdings,
                dests: Sequence[int], *, bucket_bytes: int, retained: bool, quantized: Sequence[bool],
                into_full: bool) -> GatherPlan:
    """The plan of the data phase of :func:`~fsdptk._engine.gather.collect`. Pure: every rank derives the same one.

    Args:
        shapes: per item, its full shape.
        dtypes: per item, its dtype.
        holdings: the agreed holdings (who holds which box).
        dests: per item, its destination rank.
        bucket_bytes: see :func:`~fsdptk._engine.gather.collect`.
        retained: see :func:`~fsdptk._engine.gather.collect`: only packed (or dequantised) pieces count toward
            buckets.
        quantized: per item, whether its layout dequantises (NF4: always packed, always counted).
        into_full: a receive can land in the (CPU) full tensor (a CPU transport), so a large dim-0
            piece travels alone.
    """
    full = [tuple(s) for s in shapes]
    sends = choose_senders(holdings, dests)
    world = len(sends)
    direct = [[b is not None and r != dests[i] and into_full and is_dim0_run(b, full[i])
               and is_direct(box_shape(b), dtypes[i]) for i, b in enumerate(sends[r])] for r in range(world)]
    if retained:  # only the packed (or dequantised) pieces add memory: the fulls are kept anyway
        sizes = [sum(nbytes(box_shape(b), dtypes[i]) for r in range(world)
                     if r != dests[i] and (b := sends[r][i]) is not None and (quantized[i] or not direct[r][i]))
                 for i in range(len(full))]
    else:
        sizes = [nbytes(shape, dtype) for shape, dtype in zip(full, dtypes)]
    return GatherPlan(shapes=full, dtypes=list(dtypes), dests=list(dests), sends=sends, direct=direct,
                      buckets=buckets(sizes, bucket_bytes, dests))


def _pair_transfers(plan: GatherPlan, bucket: Sequence[int], sender: int,
                    dest: int) -> list[tuple[tuple[int, ...], bool, int]]:
    """The messages ``sender`` sends ``dest`` in a bucket, in order, as ``(items, packed, nbytes)``:
    the small pieces in one flat buffer (when any has bytes), then each large dim-0 piece alone."""
    mine = [i for i in bucket if plan.dests[i] == dest and plan.sends[sender][i] is not None]
    small = tuple(i for i in mine if not plan.direct[sender][i])
    total = packed_size([(box_shape(b), plan.dtypes[i]) for i in small if (b := plan.sends[sender][i]) is not None])
    out = [(small, True, total)] if total else []
    return out + [((i,), False, nbytes(box_shape(b), plan.dtypes[i]))
                  for i in mine if plan.direct[sender][i] and (b := plan.sends[sender][i]) is not None]


def bucket_transfers(plan: GatherPlan, bucket: Sequence[int], rank: int) -> list[Transfer]:
    """``rank``'s messages of one bucket: per sender (ascending) what it receives, per destination
    (ascending) what it sends. Pure; the sender's and the receiver's lists of one pair are the same
    list (``_pair_transfers``), so both ends agree on every message. The engine posts them as
    one batch, in :func:`~fsdptk._engine.wire.posting_order` (receives first)."""
    world = len(plan.sends)
    out = [Transfer(True, r, items, packed, n) for r in range(world) if r != rank
           for items, packed, n in _pair_transfers(plan, bucket, r, rank)]
    dests = sorted({plan.dests[i] for i in bucket} - {rank})
    return out + [Transfer(False, d, items, packed, n) for d in dests
                  for items, packed, n in _pair_transfers(plan, bucket, rank, d)]

"""Owner rounds: pieces of each item travel to the item's owner, the owner computes on the full
item, and every holder gets its piece of the result back (the engine's third path, beside
:func:`~fsdptk._engine.scatter.distribute` and :func:`~fsdptk._engine.gather.collect`; used by
:class:`fsdptk.Muon`, whose plan in :mod:`fsdptk._plans.muon_plan` says who owns what).

Per bucket (:class:`OwnerBucket`, this rank's view of the agreed plan): every buffer is allocated
and every piece to send packed, then the bucket's status is agreed (before any byte moves); the
pieces go to the owners (one batch, receives first: :mod:`fsdptk._engine.wire`'s point-to-point
order), the owners compute, the results go back (a second batch, receives first). Both batches
hold messages every rank derived from the same plan, so the order argument of the wire module
holds for each. A failure after the agreement (an owner's computation) is recorded and the agreed
messages are still posted, so no peer waits for ever; it is raised at the next agreement, on every
rank. Nothing here writes anything but the caller's ``store``: a caller that applies results only
after the last agreement changes nothing when any rank failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fsdptk._core.dist import comm_errors
from fsdptk._engine.agree import Status
from fsdptk._engine.layouts import Box, box_shape, extract, place
from fsdptk._engine.wire import InFlight, Post, pack, unpack

__all__ = ["Message", "OwnerBucket", "OwnerWork", "owner_round"]


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a bucket, as one of its two ends posts it: the pieces of
    ``items`` (in order, each at its box) packed in one flat buffer."""

    recv: bool  # this rank receives it; else it sends it
    peer: int  # the rank at the other end
    items: tuple[int, ...]  # the items whose pieces it carries, in order
    boxes: tuple[Box, ...]  # per item, the box of its piece
    nbytes: int  # the flat buffer's size


@dataclass(frozen=True)
class OwnerBucket:
    """One bucket of an owner round as this rank sees it (from the agreed plan)."""

    owned: list[int]  # the items this rank owns
    kept: dict[int, Box] = field(default_factory=dict)  # owned items whose piece it has: the box
    held: dict[int, Box] = field(default_factory=dict)  # items of which it holds a piece, owned or
    # not (their results come back to it): the box
    there: list[Message] = field(default_factory=list)  # the pieces on the way to the owners
    back: list[Message] = field(default_factory=list)  # the results on the way back


class OwnerWork(Protocol):
    """What an owner round moves and computes (the caller's side)."""

    dtype: torch.dtype  # of every piece on the wire, every full item and every result

    def shape(self, i: int) -> tuple[int, ...]:
        """Item ``i``'s full shape."""

    def device(self, i: int) -> torch.device:
        """Where item ``i``'s full tensor and its pieces live."""

    def piece(self, i: int) -> torch.Tensor:
        """This rank's piece of item ``i`` (to send to its owner, or keep as its owner)."""

    def compute(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """The owner: the result of full item ``i`` (may consume ``full``)."""

    def store(self, i: int, piece: torch.Tensor) -> None:
        """This rank's piece of item ``i``'s result."""


def owner_round(buckets: Iterable[OwnerBucket], work: OwnerWork, status: Status, comm: torch.device) -> None:
    """Run the buckets (collective: every rank runs its view of the same buckets); failures are
    recorded in ``status`` and raised at its next agreement (the caller agrees after the last).

    Args:
        buckets: this rank's view of every bucket, in order.
        work: the pieces, the computation and where results go.
        status: the call's status (agreed once per bucket, before its bytes move).
        comm: the device of the flat buffers (the process group's).
    """
    for bucket in buckets:
        _bucket(bucket, work, status, comm)


def _bucket(b: OwnerBucket, work: OwnerWork, status: Status, comm: torch.device) -> None:
    fulls: dict[int, torch.Tensor] = {}
    there: list[tuple[Message, torch.Tensor]] = []
    back: list[tuple[Message, torch.Tensor]] = []
    if status.error is None:
        try:
            there = [(m, _buffer(m, work, comm)) for m in b.there]
            back = [(m, torch.empty(m.nbytes, dtype=torch.uint8, device=comm)) for m in b.back]
            for i in b.owned:
                fulls[i] = torch.empty(work.shape(i), dtype=work.dtype, device=work.device(i))
                if i in b.kept:
                    place(fulls[i], b.kept[i], work.piece(i))
        except Exception as exc:  # noqa: BLE001 - agreed just below
            status.fail(exc, "preparing a bucket")
    status.agree()
    _post(there, status)
    results: dict[int, torch.Tensor] = {}
    try:
        for m, buf in there:
            if m.recv:
                _unpack(buf, m, work, lambda i, box, t: place(fulls[i], box, t))
        for i in b.owned:
            results[i] = work.compute(i, fulls.pop(i))
            if i in b.held:
                work.store(i, extract(results[i], b.held[i]))
        for m, buf in back:
            if not m.recv:
                off = 0
                for i, box in zip(m.items, m.boxes):
                    off = pack(buf, off, extract(results[i], box))
    except Exception as exc:  # noqa: BLE001 - agreed at the next agreement (the messages still go)
        status.fail(exc, "computing its items")
    results.clear()  # the owner's full items of this bucket are dropped here
    fulls.clear()
    _post(back, status)
    try:
        for m, buf in back:
            if m.recv:
                _unpack(buf, m, work, lambda i, box, t: work.store(i, t))
    except Exception as exc:  # noqa: BLE001 - agreed at the next agreement
        status.fail(exc, "receiving its results")


def _buffer(m: Message, work: OwnerWork, comm: torch.device) -> torch.Tensor:
    """A message's flat buffer: packed with this rank's pieces when it sends it."""
    buf = torch.empty(m.nbytes, dtype=torch.uint8, device=comm)
    if not m.recv:
        off = 0
        for i in m.items:
            off = pack(buf, off, work.piece(i))
    return buf


def _post(messages: list[tuple[Message, torch.Tensor]], status: Status) -> None:
    """Post one exchange of a bucket as one batch, receives first, and wait for it."""
    flight = InFlight(status.waiter)
    try:
        with comm_errors(status.what):
            refused = flight.post_all(Post(m.recv, m.peer, buf) for m, buf in messages)
            flight.wait()
    finally:
        flight.drain_quietly()
    status.fail_post(refused)


def _unpack(buf: torch.Tensor, m: Message, work: OwnerWork, put: Callable[[int, Box, torch.Tensor], None]) -> None:
    off = 0
    for i, box in zip(m.items, m.boxes):
        t, off = unpack(buf, off, box_shape(box), work.dtype, work.device(i))
        put(i, box, t)

"""The plan of :class:`fsdptk.Muon`'s owner-based step: which rank orthogonalizes each matrix, and
which piece of it travels from whom to whom, bucket by bucket.

Pure functions of the agreed holdings (every rank's box of every parameter, its host): every rank
derives the same plan without looking at a tensor's values, and both ends of a message derive the
same message (the point-to-point order of :mod:`fsdptk._engine.wire`). :mod:`fsdptk.muon` moves
the bytes along it.

Design notes
------------
* A matrix is a 2-D parameter, or one expert ``e`` of a fused ``(E, a, b)`` expert tensor (its
  ``(a, b)`` slice). A rank's piece of a matrix is its box of the parameter restricted to the
  matrix: for an expert, the box's dims 1-2 when the box's dim 0 holds ``e`` (a slice, or the
  index set of a ``_StridedShard``).
* Owners: the Newton-Schulz work of an ``(a, b)`` matrix is about ``a * b * min(a, b)``
  (:func:`ns_cost`); matrices go largest first to the rank that holds most of the matrix among
  those it fits on (their load stays within 5% of the mean), else to the least-loaded rank
  (longest processing time first): an expert held whole by one rank is orthogonalized where it
  lives, and no rank owns much more than its share.
* To the owner: every distinct box once, from the owner itself when it holds it, else from a
  holder on the owner's host, else the lowest-ranked holder
  (:func:`fsdptk._engine.routes.choose_senders`, the gather's own rule). Back: the owner sends
  every other holder (each replica) its box of the result.
* Everything on the wire is ``bfloat16``: Newton-Schulz starts with ``update.bfloat16()`` (an
  elementwise cast, the same bits on a shard as on the full matrix) and returns ``bfloat16``.
* Buckets: consecutive matrices, up to ``bucket_bytes`` of full ``bfloat16`` matrices per owner
  (:func:`fsdptk._engine.wire.buckets` with owners), so an owner holds one bucket of full
  matrices at a time and every owner works in every bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdptk._engine.layouts import Box, box_shape
from fsdptk._engine.owners import Message, OwnerBucket
from fsdptk._engine.routes import Holdings, choose_senders
from fsdptk._engine.wire import buckets, nbytes, packed_size

__all__ = ["Matrix", "Piece", "MuonPlan", "ns_cost", "matrices_of", "matrix_piece", "assign_owners",
           "plan_step", "to_owner_messages", "from_owner_messages", "bucket_view", "WIRE_DTYPE"]

WIRE_DTYPE = torch.bfloat16  # what Newton-Schulz reads and returns: the only dtype on the wire
_BALANCE_TOLERANCE = 0.05  # how far above the mean load a rank may go to own what it holds


@dataclass(frozen=True)
class Matrix:
    """One matrix Muon orthogonalizes on its own."""

    param: int  # the parameter's index in the step's list
    expert: int | None  # its dim-0 index in a fused (E, a, b) expert tensor; None: the parameter itself
    shape: tuple[int, int]  # the (a, b) of the matrix


@dataclass(frozen=True)
class Piece:
    """One rank's piece of one matrix."""

    local: tuple[int, ...]  # index of the piece in the rank's local tensor: (j,) for an expert, else ()
    box: Box  # the piece's box of the full (a, b) matrix


@dataclass(frozen=True)
class MuonPlan:
    """Who orthogonalizes which matrix and who sends what to whom: the same on every rank."""

    matrices: list[Matrix]
    owners: list[int]  # per matrix, the rank that orthogonalizes it
    pieces: list[list[Piece | None]]  # per rank, per matrix: its piece (None: it holds none)
    sends: list[list[bool]]  # per rank, per matrix: its piece is the one the owner gets (or keeps)
    buckets: list[list[int]]  # the matrices of each bucket, in order
    load: list[int]  # per rank, the Newton-Schulz work it owns (:func:`ns_cost` units)


def ns_cost(shape: Sequence[int]) -> int:
    """The Newton-Schulz work of an ``(a, b)`` matrix, up to a constant: ``a * b * min(a, b)``.

    Examples:
        >>> ns_cost((64, 16)), ns_cost((16, 64))
        (16384, 16384)
    """
    a, b = shape
    return a * b * min(a, b)


def matrices_of(shapes: Sequence[Sequence[int]]) -> list[Matrix]:
    """The matrices of parameters of these full shapes: a 2-D parameter is one, a 3-D one is ``E``
    fused experts (one ``(a, b)`` matrix each).

    Examples:
        >>> [(m.param, m.expert, m.shape) for m in matrices_of([(4, 3), (2, 5, 6)])]
        [(0, None, (4, 3)), (1, 0, (5, 6)), (1, 1, (5, 6))]
    """
    out: list[Matrix] = []
    for i, shape in enumerate(shapes):
        if len(shape) == 2:
            out.append(Matrix(param=i, expert=None, shape=(int(shape[0]), int(shape[1]))))
        else:
            out += [Matrix(param=i, expert=e, shape=(int(shape[1]), int(shape[2]))) for e in range(shape[0])]
    return out


def matrix_piece(box: Box | None, m: Matrix) -> Piece | None:
    """A rank's piece of matrix ``m`` given its box of the parameter (``None``: it holds none).

    Examples:
        >>> matrix_piece((slice(2, 4), slice(0, 5), slice(0, 6)), Matrix(1, 3, (5, 6)))
        Piece(local=(1,), box=(slice(0, 5, None), slice(0, 6, None)))
        >>> matrix_piece(((0, 2), slice(0, 5), slice(0, 6)), Matrix(1, 1, (5, 6))) is None
        True
    """
    if box is None:
        return None
    local: tuple[int, ...] = ()
    sub = box
    if m.expert is not None:
        d0, sub = box[0], box[1:]
        if isinstance(d0, slice):
            if not d0.start <= m.expert < d0.stop:
                return None
            local = (m.expert - d0.start,)
        else:
            if m.expert not in d0:
                return None
            local = (d0.index(m.expert),)
    if 0 in box_shape(sub):
        return None
    return Piece(local=local, box=sub)


def assign_owners(costs: Sequence[int], held: Sequence[Sequence[int]], world: int) -> list[int]:
    """The owner of every matrix: largest first, to the rank holding most of it among the ranks it
    still fits on (their load stays within a small tolerance of the mean), else to the
    least-loaded rank (longest processing time first).

    Args:
        costs: per matrix, its Newton-Schulz work (:func:`ns_cost`).
        held: per matrix, per rank, how many of its elements the rank holds.
        world: the number of ranks.

    Examples:
        >>> assign_owners([8, 8, 8, 8], [[1, 0], [1, 0], [0, 1], [0, 1]], 2)  # whole experts stay
        [0, 0, 1, 1]
        >>> assign_owners([8, 8, 8, 8], [[1, 1]] * 4, 2)
        [0, 1, 0, 1]
    """
    load = [0] * world
    owners = [0] * len(costs)
    capacity = (1 + _BALANCE_TOLERANCE) * sum(costs) / world
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        fits = [r for r in range(world) if load[r] + costs[i] <= capacity]
        if fits:
            r = max(fits, key=lambda r: (held[i][r], -load[r], -r))
        else:
            r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def plan_step(shapes: Sequence[Sequence[int]], boxes: Sequence[Sequence[Box | None]], hosts: Sequence[str],
              *, bucket_bytes: int) -> MuonPlan:
    """The plan of one step over parameters of these full ``shapes``.

    Args:
        shapes: per parameter, its full shape (2-D, or 3-D fused experts).
        boxes: per rank, per parameter, the box of the full parameter it holds (``None``: none).
        hosts: per rank, its host (a replica on the owner's host sends).
        bucket_bytes: full ``bfloat16`` matrix bytes per owner and bucket.
    """
    world = len(boxes)
    mats = matrices_of(shapes)
    pieces = [[matrix_piece(boxes[r][m.param], m) for m in mats] for r in range(world)]
    held = [[_numel(p.box) if (p := pieces[r][i]) is not None else 0 for r in range(world)]
            for i in range(len(mats))]
    costs = [ns_cost(m.shape) for m in mats]
    owners = assign_owners(costs, held, world)
    chosen = choose_senders(Holdings(boxes=[[p.box if p is not None else None for p in row] for row in pieces],
                                     hosts=list(hosts)), owners)
    load = [0] * world
    for i, o in enumerate(owners):
        load[o] += costs[i]
    sizes = [nbytes(m.shape, WIRE_DTYPE) for m in mats]
    return MuonPlan(matrices=mats, owners=owners, pieces=pieces,
                    sends=[[b is not None for b in row] for row in chosen],
                    buckets=buckets(sizes, bucket_bytes, owners), load=load)


def _numel(box: Box) -> int:
    n = 1
    for s in box_shape(box):
        n *= s
    return n


def _message(plan: MuonPlan, recv: bool, peer: int, ms: list[int], boxes: list[Box]) -> list[Message]:
    size = packed_size([(box_shape(b), WIRE_DTYPE) for b in boxes])
    return [Message(recv=recv, peer=peer, items=tuple(ms), boxes=tuple(boxes), nbytes=size)] if size else []


def _to_owner(plan: MuonPlan, bucket: Sequence[int], sender: int, owner: int) -> tuple[list[int], list[Box]]:
    ms = [i for i in bucket if plan.owners[i] == owner and sender != owner and plan.sends[sender][i]]
    return ms, [_box(plan, sender, i) for i in ms]


def _from_owner(plan: MuonPlan, bucket: Sequence[int], owner: int, holder: int) -> tuple[list[int], list[Box]]:
    ms = [i for i in bucket if plan.owners[i] == owner and holder != owner and plan.pieces[holder][i] is not None]
    return ms, [_box(plan, holder, i) for i in ms]


def _box(plan: MuonPlan, rank: int, i: int) -> Box:
    piece = plan.pieces[rank][i]
    assert piece is not None, "a planned piece is held"
    return piece.box


def to_owner_messages(plan: MuonPlan, bucket: Sequence[int], rank: int) -> list[Message]:
    """``rank``'s messages of a bucket on the way to the owners: per sender (ascending) what it
    receives as an owner, per owner (ascending) what it sends. The sender's and the owner's
    message of one pair is the same message (:func:`_to_owner`), so both ends agree on it.

    Examples:
        >>> b0, b1 = (slice(0, 2), slice(0, 4)), (slice(2, 4), slice(0, 4))
        >>> plan = plan_step([(4, 4)], [[(b0[0], b0[1])], [(b1[0], b1[1])]], ["h", "h"], bucket_bytes=64)
        >>> plan.owners, [(m.recv, m.peer, m.items) for m in to_owner_messages(plan, [0], 1 - plan.owners[0])]
        ([0], [(False, 0, (0,))])
    """
    world = len(plan.pieces)
    owners = sorted({plan.owners[i] for i in bucket})
    out: list[Message] = []
    if rank in owners:
        for s in range(world):
            out += _message(plan, True, s, *_to_owner(plan, bucket, s, rank))
    for o in owners:
        out += _message(plan, False, o, *_to_owner(plan, bucket, rank, o))
    return out


def from_owner_messages(plan: MuonPlan, bucket: Sequence[int], rank: int) -> list[Message]:
    """``rank``'s messages of a bucket on the way back: per owner (ascending) what it receives as
    a holder, then (as an owner) per holder (ascending) what it sends."""
    world = len(plan.pieces)
    owners = sorted({plan.owners[i] for i in bucket})
    out: list[Message] = []
    for o in owners:
        out += _message(plan, True, o, *_from_owner(plan, bucket, o, rank))
    if rank in owners:
        for h in range(world):
            out += _message(plan, False, h, *_from_owner(plan, bucket, rank, h))
    return out


def bucket_view(plan: MuonPlan, bucket: Sequence[int], rank: int) -> OwnerBucket:
    """``rank``'s view of one bucket, as :func:`fsdptk._engine.owners.owner_round` runs it."""
    held = {i: p.box for i in bucket if (p := plan.pieces[rank][i]) is not None}
    owned = [i for i in bucket if plan.owners[i] == rank]
    return OwnerBucket(owned=owned, kept={i: held[i] for i in owned if plan.sends[rank][i]}, held=held,
                       there=to_owner_messages(plan, bucket, rank), back=from_owner_messages(plan, bucket, rank))

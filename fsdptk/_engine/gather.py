"""Collect: local shards -> full CPU tensors on a destination rank (rank 0 unless told otherwise),
the gather direction of the engine.

Each item has a destination rank (default: rank 0; a save with many writers gives each writer the
items of its files). For every box of an item, one holder sends it: the destination itself when it
holds the box, else a holder on the destination's host, else the lowest-ranked holder, so a
replica (HSDP) sends from the destination's own host whenever it has one. Each sender sends
exactly its bytes of a bucket to each destination, point to point: small pieces in one flat buffer
per destination, large dim-0 pieces alone, received straight into the full tensors; each
destination places the rest and yields the bucket. A bucket holds up to ``bucket_bytes`` for every
destination (each destination holds one bucket at a time). Two buckets are in flight. The status
of every bucket is agreed before its bytes move (:mod:`fsdptk._engine.agree`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from fsdptk._core.compat import local_tensor
from fsdptk._core.dist import (
    all_gather_object,
    comm_device,
    comm_errors,
    error_payload,
    host_key,
    raise_lowest,
)
from fsdptk._core.dist import raise_problems as _raise
from fsdptk._core.dist import world as _world
from fsdptk._engine.agree import Status, fingerprint, guarded, hand_over
from fsdptk._engine.layouts import Box, Layout, box_shape, is_dim0_run, layout_of, place
from fsdptk._engine.wire import (
    DEFAULT_BUCKET_BYTES,
    InFlight,
    buckets,
    irecv,
    is_direct,
    isend,
    nbytes,
    pack,
    packed_size,
    unpack,
)


class _ItemView(NamedTuple):
    """This rank's view of one item (local: the box travels, the rest stays)."""

    layout: Layout | None  # None: not a tensor
    box: Box | None  # the box of the full tensor this rank holds (None: it holds none)
    problem: str | None  # why the item cannot be gathered, or None


class _GatherView(NamedTuple):
    """What each rank sends in :func:`collect`'s one object exchange."""

    fingerprint: str | None  # of its items (fqns, shapes, dtypes, layout kinds) and destinations
    boxes: list[Box | None]  # per item, the box it holds (None: it holds none)
    problems: list[tuple[str, str]]  # (exception type name, message naming the key)
    error: Any  # error_payload of its local failure, or None
    host: str  # its host (host name and network namespace): replicas on a destination's host send


class Holdings(NamedTuple):
    """Who holds which part of every item, as :func:`collect` agreed it (the same on every rank):
    the input of a ``dest`` callable."""

    boxes: list[list[Box | None]]  # per rank, per item: the box of the full tensor it holds, or None
    hosts: list[str]  # per rank: its host (host name and network namespace)


Dest = Sequence[int] | Callable[[Holdings], Sequence[int]] | None


def _collect_view(t: object) -> _ItemView:
    """This rank's :class:`_ItemView` of one item."""
    if not isinstance(t, torch.Tensor):
        return _ItemView(None, None, f"expected a tensor, got {type(t).__name__}")
    layout = layout_of(t)
    local = local_tensor(t)
    if local.is_meta:
        return _ItemView(layout, None, f"is on the meta device (shape {list(t.shape)}); load or initialise it first")
    if local.layout != torch.strided:
        return _ItemView(layout, None,
                         f"has layout {local.layout}: only dense (torch.strided) tensors can be gathered")
    return _ItemView(layout, layout.held_box(), None)


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


def _resolve_dest(dest: Dest, holdings: Holdings, n: int) -> list[int]:
    """The destination rank of every item (every rank computes the same)."""
    world = len(holdings.boxes)
    if dest is None:
        return [0] * n
    out = list(dest(holdings) if callable(dest) else dest)
    bad = [d for d in out if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < world]
    if len(out) != n or bad:
        raise ValueError(f"collect: dest must give one rank in [0, {world}) per item ({n} items); got "
                         f"{len(out)} destinations" + (f", bad ones {bad[:5]}" if bad else ""))
    return out


def collect(
    items: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    retained: bool = False,
    failed: BaseException | None = None,
    dest: Dest = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Turn local shards into full CPU tensors on each item's destination rank, one bucket at a time.

    Each shard owner sends exactly its bytes of a bucket to the destination, point to point (a
    gather, never an all-gather; no barrier): small pieces in one flat buffer per destination,
    large dim-0 pieces alone. Of the replicas of a box (HSDP, plain tensors) one sends: the
    destination itself when it holds the box (no communication), else one on the destination's
    host, else the lowest-ranked (:func:`choose_senders`). Each destination yields the bucket's
    full tensors of its items (CPU, original dtype, NF4 dequantised, fresh memory not shared with
    the model), in item order; a rank with none in a bucket yields ``[]``. A bucket holds up to
    ``bucket_bytes`` of full tensors for every destination, so each destination's memory beyond
    the shards is one bucket (full tensors plus the received buffers; senders: their packed
    pieces), and every destination receives in every bucket. Consistency of the items is checked
    first with one object collective, so a mismatch is an error on every rank, not a hang; then
    the status of every bucket is agreed before its bytes move (see the module docstring): a
    failure on any rank raises the same error on every rank. A caller whose own code fails on one
    rank while consuming (a file write) calls ``generator.throw(exc)`` so the other ranks raise
    ``exc``.

    Args:
        items: ``(fqn, tensor)`` pairs in the same order on every rank: DTensors (any mesh,
            ``_StridedShard`` included), plain tensors, NF4 tensors or DTensors wrapping NF4.
        bucket_bytes: full-tensor bytes per bucket and destination: bounds the full tensors a
            destination holds for one bucket and every rank's packed pieces.
        retained: the caller keeps every bucket (it builds the whole state dict), so the full
            tensors are not counted toward ``bucket_bytes``, only the packed pieces: large dim-0
            shards received into place then move in few buckets, with few status agreements.
        failed: the caller's own pre-flight error on this rank (a bad argument), carried in the
            metadata exchange so that every rank raises the lowest failing rank's error with no
            agreement of the caller's own; ``items`` is not looked at on a rank that passes it.
        dest: the destination rank of every item: ``None`` (rank 0 for all), one rank per item
            (the same on every rank), or a callable given the agreed :class:`Holdings` (which
            rank holds which box, and each rank's host) that returns them; it runs on every rank
            after the exchange and must be deterministic.

    Returns:
        Iterator[list[tuple[str, torch.Tensor]]]: buckets; every rank must exhaust the generator.

    Raises:
        ValueError: on every rank, when items (or given destinations) differ between ranks, a
            tensor is on ``meta``, or a destination is not a rank.
        Exception: any rank's failure (reading a shard, the caller's thrown-in error), on every
            rank: the lowest failing rank's error, named after that rank.
        RuntimeError: the communication itself failed (a rank died), naming the operation.
        Exception: ``failed`` (the lowest failing rank's), on every rank.

    Examples:
        >>> import torch
        >>> from fsdptk._engine import collect
        >>> [[(k, v.shape) for k, v in b] for b in collect([("w", torch.ones(2, 3))])]
        [[('w', torch.Size([2, 3]))]]
    """
    world, _ = _world()
    views: list[_ItemView] = []
    problems: list[tuple[str, str]] = []
    fp, error = None, failed
    listed: list[tuple[str, torch.Tensor]] = []
    try:  # local work: a failure here is agreed below, with the metadata
        if failed is not None:
            raise failed
        listed = list(items)
        items = listed
        views = [_collect_view(t) for _, t in items]
        problems = [("ValueError", f"{fqn!r} {v.problem}") for (fqn, _), v in zip(items, views) if v.problem]
        given = None if dest is None or callable(dest) else tuple(dest)
        fp = fingerprint([*((fqn, tuple(t.shape), str(t.dtype), type(v.layout).__name__)
                            for (fqn, t), v in zip(items, views)), ("dest", given)])
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = e
    payloads = all_gather_object(_GatherView(fingerprint=fp, boxes=[v.box for v in views], problems=problems,
                                             error=error_payload(error), host=host_key()))
    raise_lowest([p.error for p in payloads], error)
    diff = [r for r, p in enumerate(payloads) if p.fingerprint != payloads[0].fingerprint]
    all_problems = [(k, (f"rank {r}: " if world > 1 else "") + m) for r, p in enumerate(payloads)
                    for k, m in p.problems]
    if diff:
        all_problems.append(("ValueError", f"the items (fqns, shapes, dtypes) or destinations differ between "
                             f"rank 0 and ranks {diff}"))
    _raise(all_problems, "cannot gather the state")
    holdings = Holdings(boxes=[p.boxes for p in payloads], hosts=[p.host for p in payloads])
    dests = _resolve_dest(dest, holdings, len(listed))
    sends = choose_senders(holdings, dests)
    status = Status("gather")
    layouts = [v.layout for v in views if v.layout is not None]
    assert len(layouts) == len(listed), "every item is a tensor (agreed just above)"
    yield from guarded(_collect_buckets(listed, layouts, sends, dests, bucket_bytes, retained, status), status)


def _collect_buckets(items: list[tuple[str, torch.Tensor]], layouts: list[Layout],
                     sends: list[list[Box | None]], dests: list[int], bucket_bytes: int, retained: bool,
                     status: Status) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The data phase of :func:`collect`: per bucket, pack, agree, then move the bytes.

    A sender's small pieces for one destination travel packed in one flat buffer; a large dim-0
    piece travels alone, from the shard itself, and its destination receives it straight into the
    full tensor's memory (over a CPU transport). Pipelined: a sender packs bucket k+1 while bucket
    k is on the wire (two buckets in flight); a destination places its own pieces of bucket k while
    the others' bytes arrive, and yields bucket k before bucket k+1 is agreed, so a failure of the
    caller's code (a file write) stops the senders at the next bucket. Once a bucket is agreed
    every rank posts its transfers of it, and every posted transfer is waited for, on the error
    paths too."""
    world, rank = _world()
    comm = comm_device() if world > 1 else torch.device("cpu")
    into_full = comm.type == "cpu"  # a receive can land in the (CPU) full tensors
    direct = [[b is not None and r != dests[i] and into_full and is_dim0_run(b, t.shape)
               and is_direct(box_shape(b), t.dtype) for i, (b, (_, t)) in enumerate(zip(sends[r], items))]
              for r in range(world)]
    if retained:  # only the packed (or dequantised) pieces add memory: the fulls are kept anyway
        sizes = [sum(nbytes(box_shape(b), t.dtype) for r in range(world)
                     if r != dests[i] and (b := sends[r][i]) is not None
                     and (layouts[i].quantized or not direct[r][i]))
                 for i, (_, t) in enumerate(items)]
    else:
        sizes = [nbytes(t.shape, t.dtype) for _, t in items]
    flight = InFlight(status.waiter)  # the previous bucket's transfers
    held: tuple[list[int], dict[int, torch.Tensor], dict[int, torch.Tensor]] | None = None  # a destination's
    try:
        for bucket in buckets(sizes, bucket_bytes, dests):
            if held is not None:  # bucket k-1: it arrived while this rank placed its own pieces
                with comm_errors(status.what):
                    flight.wait()
                yield from _collect_hand_over(items, sends, direct, *held, status)
                held = None
            mine = [i for i in bucket if dests[i] == rank]
            outgoing: dict[int, list[torch.Tensor]] = {}
            incoming: dict[int, list[torch.Tensor]] = {}
            fulls: dict[int, torch.Tensor] = {}
            bufs: dict[int, torch.Tensor] = {}
            if status.error is None:
                try:
                    fulls = {i: torch.empty(tuple(items[i][1].shape), dtype=items[i][1].dtype) for i in mine}
                    bufs, incoming = _collect_recv_buffers(items, mine, sends, direct, fulls, comm)
                    outgoing = _collect_pack(items, layouts, bucket, dests, sends[rank], direct[rank], comm,
                                             status)
                except Exception as exc:  # noqa: BLE001 - agreed just below
                    status.fail(exc)
            status.agree()
            with comm_errors(status.what):
                flight.wait()  # bucket k-1 is out: its buffers are free (done above on a destination)
                refused = flight.post_all(isend, [(d, t) for d, ts in sorted(outgoing.items()) for t in ts])
                refused = flight.post_all(irecv, [(r, t) for r, ts in sorted(incoming.items()) for t in ts]) \
                    or refused
            status.fail_post(refused)
            del outgoing, incoming
            if mine:
                _collect_own(items, layouts, mine, sends[rank], fulls, status)  # while the bytes arrive
                held = (mine, fulls, bufs)
            else:
                yield from hand_over([[]], status)
            del fulls, bufs
        with comm_errors(status.what):
            flight.wait()
        if held is not None:
            yield from _collect_hand_over(items, sends, direct, *held, status)
        status.agree()
    finally:
        flight.drain_quietly()


def _collect_pack(items: list[tuple[str, torch.Tensor]], layouts: list[Layout], bucket: list[int],
                  dests: list[int], sends: list[Box | None], direct: list[bool], comm: torch.device,
                  status: Status) -> dict[int, list[torch.Tensor]]:
    """A sender: its messages of a bucket per destination (``{}`` when it sends none): its small
    pieces for that destination in one flat buffer, then each large dim-0 piece as it is (no copy
    when contiguous on ``comm``)."""
    rank = _world()[1]
    out: dict[int, list[torch.Tensor]] = {}
    for d in sorted({dests[i] for i in bucket if sends[i] is not None and dests[i] != rank}):
        mine = [i for i in bucket if dests[i] == d and sends[i] is not None]
        total = packed_size([(box_shape(b), items[i][1].dtype) for i in mine
                             if (b := sends[i]) is not None and not direct[i]])
        buf = torch.empty(total, dtype=torch.uint8, device=comm) if total else None
        off, alone = 0, []
        for i in mine:
            try:
                local = layouts[i].send_local()
                if direct[i]:
                    alone.append(local.to(comm).contiguous())
                elif buf is not None:
                    off = pack(buf, off, local)
            except Exception as exc:
                status.fail(exc, f"reading its shard of {items[i][0]!r}")
                raise
        msgs = ([buf] if buf is not None else []) + alone
        if msgs:
            out[d] = msgs
    return out


def _collect_recv_buffers(items: list[tuple[str, torch.Tensor]], mine: list[int],
                          sends: list[list[Box | None]], direct: list[list[bool]], fulls: dict[int, torch.Tensor],
                          comm: torch.device) -> tuple[dict[int, torch.Tensor], dict[int, list[torch.Tensor]]]:
    """A destination: per sender, the flat buffer of its small pieces, and its messages in send
    order (that buffer, then a view of the full tensor for each large dim-0 piece)."""
    rank = _world()[1]
    bufs, msgs = {}, {}
    for r in range(len(sends)):
        if r == rank:
            continue
        total = packed_size([(box_shape(b), items[i][1].dtype)
                             for i in mine if (b := sends[r][i]) is not None and not direct[r][i]])
        if total:
            bufs[r] = torch.empty(total, dtype=torch.uint8, device=comm)
        views = [fulls[i][b[0]] for i in mine if direct[r][i] and (b := sends[r][i]) is not None]
        if total or views:
            msgs[r] = ([bufs[r]] if total else []) + views
    return bufs, msgs


def _collect_own(items: list[tuple[str, torch.Tensor]], layouts: list[Layout], mine: list[int],
                 sends: list[Box | None], fulls: dict[int, torch.Tensor], status: Status) -> None:
    """A destination: place its own pieces of a bucket (a failure is agreed at the next boundary)."""
    if status.error is not None:
        return
    name = None
    try:
        for i in mine:
            box = sends[i]
            if box is not None:
                name = items[i][0]
                place(fulls[i], box, layouts[i].send_local().cpu())
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"reading its shard of {name!r}")


def _collect_hand_over(items: list[tuple[str, torch.Tensor]], sends: list[list[Box | None]],
                       direct: list[list[bool]], mine: list[int], fulls: dict[int, torch.Tensor],
                       bufs: dict[int, torch.Tensor], status: Status,
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A destination: unpack a bucket that has arrived (its large pieces are already in place) and
    yield it."""
    if status.error is not None:
        return
    name = None
    try:
        for r, buf in bufs.items():
            off = 0
            for i in mine:
                box = sends[r][i]
                if box is not None and not direct[r][i]:
                    name = items[i][0]
                    piece, off = unpack(buf, off, box_shape(box), items[i][1].dtype, torch.device("cpu"))
                    place(fulls[i], box, piece)
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"assembling {name!r}")
        return
    yield from hand_over([[(items[i][0], fulls[i]) for i in mine]], status)

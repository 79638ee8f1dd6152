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

A rank may both send and receive in one bucket (many destinations); the plan of every bucket's
messages is a pure function of the agreed holdings (:mod:`fsdptk._engine.routes`),
and each rank posts its messages of a bucket as one batch, receives first: the point-to-point
order of :mod:`fsdptk._engine.wire`, under which transfers cannot block each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch

from fsdptk._core.arguments import ArgumentsView, check_arguments
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
from fsdptk._engine.layouts import Box, Layout, box_shape, layout_of, place
from fsdptk._engine.pool import Pool
from fsdptk._engine.routes import GatherPlan, Holdings, Transfer, bucket_transfers, plan_gather
from fsdptk._engine.wire import DEFAULT_BUCKET_BYTES, InFlight, Post, pack, unpack

__all__ = ["collect", "Holdings", "Dest"]


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
    arguments: ArgumentsView | None  # the call's per-rank arguments that change the exchange


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
    arguments: ArgumentsView | None = None,
    pool: Pool | None = None,
    reuse_yielded: bool = False,
    wire_dtypes: Sequence[torch.dtype | None] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Turn local shards into full CPU tensors on each item's destination rank, one bucket at a time.

    Each shard owner sends exactly its bytes of a bucket to the destination, point to point (a
    gather, never an all-gather; no barrier): small pieces in one flat buffer per destination,
    large dim-0 pieces alone. Of the replicas of a box (HSDP, plain tensors) one sends: the
    destination itself when it holds the box (no communication), else one on the destination's
    host, else the lowest-ranked (:func:`~fsdptk._engine.routes.choose_senders`). Each destination
    yields the bucket's full tensors of its items (CPU, original dtype, NF4 dequantised, fresh
    memory not shared with the model), in item order; a rank with none in a bucket yields ``[]``. A bucket holds up to
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
        arguments: the calling function's per-rank arguments that change what the ranks exchange
            (:func:`fsdptk._core.arguments.arguments_view`), carried in the same exchange and
            compared first: ranks that differ get one ValueError naming each argument and every
            rank's value.
        pool: the :class:`~fsdptk._engine.pool.Pool` to take memory from, kept by the caller
            between calls so that a later call writes into warm memory (its flat buffers, and its
            full tensors with ``reuse_yielded``); ``None``: one for this call, for the flat
            buffers that cross the wire (none with ``retained``).
        reuse_yielded: the full tensors may be views of blocks an earlier bucket (or call) yielded
            and nothing holds any more: the consumer is the caller's own code, which drops each
            tensor once used (a file writer), or the caller's consumer opted in to a stated
            contract (``weight_source(keep_buffers=True)``). ``False`` (default): every yielded
            tensor is fresh memory, the consumer's whatever it does with it (keeps its storage, a
            raw pointer, shares it with another process); see :mod:`fsdptk._engine.pool`.
        wire_dtypes: per item, the floating dtype its pieces travel in and its full tensor is
            yielded in (each holder casts its own piece before it is packed or sent: a bf16 stream
            of an fp32 model moves half the bytes; a cast is elementwise, so the full tensor is the
            cast of the full tensor, bit for bit); ``None`` (or an entry ``None``, an integer or
            NF4 tensor): its own dtype. The same on every rank (checked with the items).

    Returns:
        Iterator[list[tuple[str, torch.Tensor]]]: buckets; every rank drives the generator to its
        end, or closes it (``close()``, or dropping it after a ``break``): a rank that leaves early
        still takes part in the next status agreement, where every other rank raises a
        RuntimeError naming it.

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
        casts = [None] * len(listed) if wire_dtypes is None else list(wire_dtypes)
        if len(casts) != len(listed):
            raise ValueError(f"wire_dtypes has {len(casts)} entries for {len(listed)} items")
        fp = fingerprint([*((fqn, tuple(t.shape), str(t.dtype), type(v.layout).__name__, str(c))
                            for (fqn, t), v, c in zip(items, views, casts)), ("dest", given)])
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = e
    payloads = all_gather_object(_GatherView(fingerprint=fp, boxes=[v.box for v in views], problems=problems,
                                             error=error_payload(error), host=host_key(), arguments=arguments))
    if any(p.arguments is not None for p in payloads):  # first: a disagreement explains the rest
        check_arguments([p.arguments or ArgumentsView(call="(no arguments sent)", values=()) for p in payloads])
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
    status = Status("gather")
    layouts: list[Layout] = [v.layout for v in views if v.layout is not None]
    assert len(layouts) == len(listed), "every item is a tensor (agreed just above)"
    dtypes = []
    for i, ((_, t), c) in enumerate(zip(listed, casts)):
        if c is not None and c != t.dtype and c.is_floating_point and t.dtype.is_floating_point \
                and not layouts[i].quantized:
            layouts[i] = cast(Layout, _CastOnSend(layouts[i], c))  # send_local and quantized: all a gather reads
            dtypes.append(c)
        else:
            dtypes.append(t.dtype)
    yield from guarded(_collect_buckets(listed, layouts, holdings, dests, bucket_bytes, retained, status, pool,
                                        reuse_yielded, dtypes), status)


class _CastOnSend:
    """A layout whose local piece is cast to ``dtype`` before it is packed, sent or placed."""

    def __init__(self, inner: Layout, dtype: torch.dtype) -> None:
        self.inner, self.dtype = inner, dtype
        self.quantized = inner.quantized

    def send_local(self) -> torch.Tensor:
        return self.inner.send_local().to(self.dtype)


def _collect_buckets(items: list[tuple[str, torch.Tensor]], layouts: list[Layout], holdings: Holdings,
                     dests: list[int], bucket_bytes: int, retained: bool,
                     status: Status, kept: Pool | None = None, reuse_yielded: bool = False,
                     dtypes: Sequence[torch.dtype] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The data phase of :func:`collect`: per bucket, pack, agree, then move the bytes.

    A sender's small pieces for one destination travel packed in one flat buffer; a large dim-0
    piece travels alone, from the shard itself, and its destination receives it straight into the
    full tensor's memory (over a CPU transport). Every rank posts its messages of a bucket as one
    batch, receives first (:func:`~fsdptk._engine.routes.bucket_transfers`; the point-to-point order of
    :mod:`fsdptk._engine.wire`), so a rank that both sends and receives cannot block a peer that
    does too. Pipelined: a sender packs bucket k+1 while bucket k is on the wire (two buckets in
    flight); a destination places its own pieces of bucket k while the others' bytes arrive, and
    yields bucket k before bucket k+1 is agreed, so a failure of the caller's code (a file write)
    stops the senders at the next bucket. Once a bucket is agreed every rank posts its transfers
    of it, and every posted transfer is waited for, on the error paths too."""
    world, rank = _world()
    comm = comm_device() if world > 1 else torch.device("cpu")
    dtypes = [t.dtype for _, t in items] if dtypes is None else dtypes  # what travels (wire_dtypes)
    plan = plan_gather([tuple(t.shape) for _, t in items], dtypes, holdings, dests,
                       bucket_bytes=bucket_bytes, retained=retained, quantized=[lay.quantized for lay in layouts],
                       into_full=comm.type == "cpu")  # a receive can land in the (CPU) full tensors
    # reused CPU memory (not when the caller keeps every bucket: nothing would come back to it):
    # the flat buffers that cross the wire, and the full tensors only where the consumer's memory
    # may be reused (reuse_yielded: fsdptk's own file writer, or weight_source(keep_buffers=True));
    # otherwise every yielded tensor is fresh memory, the consumer's (fsdptk._engine.pool). A pool
    # of this call only: within the peak the gather has without it (the bucket being filled, or
    # its largest tensor, and the one the consumer still holds), so it saves time and adds no
    # memory; a model whose tensors outgrow the bucket then drops its largest block for the layers
    # and faults the largest tensors in afresh. A pool the caller keeps between calls
    # (weight_source(keep_buffers=True)): 2 x max(bucket, largest tensor) - bucket, enough for the
    # largest tensor and a layer's tensors, so that a pass after the first writes into warm memory
    # only; trimmed to that at the end of the call, blocks the consumer still holds included.
    sizes = [_nbytes(s, d) for i, (s, d) in enumerate(zip(plan.shapes, plan.dtypes)) if plan.dests[i] == rank]
    biggest = max([bucket_bytes, *sizes])
    cap = keep_cap(bucket_bytes, sizes) if kept is not None else biggest + bucket_bytes
    pool = None if retained else kept or Pool(cap=cap)
    if pool is not None:
        pool.prepare(cap, sizes if reuse_yielded else ())
    fulls_from = pool if reuse_yielded else None
    flight = InFlight(status.waiter)  # the previous bucket's transfers
    held: tuple[list[int], dict[int, torch.Tensor], list[tuple[Transfer, torch.Tensor]]] | None = None
    try:
        for bucket in plan.buckets:
            if held is not None:  # bucket k-1: it arrived while this rank placed its own pieces
                with comm_errors(status.what):
                    flight.wait()
                yield from _collect_hand_over(items, plan, *held, status)
                held = None
            mine = [i for i in bucket if plan.dests[i] == rank]
            posts: list[Post] = []
            fulls: dict[int, torch.Tensor] = {}
            received: list[tuple[Transfer, torch.Tensor]] = []
            if status.error is None:
                try:
                    fulls = {i: _empty(fulls_from, plan.shapes[i], plan.dtypes[i]) for i in mine}
                    posts, received = _collect_messages(items, layouts, plan, bucket, fulls, comm, status, pool)
                except Exception as exc:  # noqa: BLE001 - agreed just below
                    status.fail(exc)
            status.agree()
            with comm_errors(status.what):
                flight.wait()  # bucket k-1 is out: its buffers are free (done above on a destination)
                refused = flight.post_all(posts)
            status.fail_post(refused)
            del posts
            if mine:
                _collect_own(items, layouts, mine, plan.sends[rank], fulls, status)  # while the bytes arrive
                held = (mine, fulls, received)
            else:
                yield from hand_over([[]], status)
            del fulls, received
        with comm_errors(status.what):
            flight.wait()
        if held is not None:
            yield from _collect_hand_over(items, plan, *held, status)
            held = None  # nothing of the last bucket is held here once handed over
        status.agree()
    finally:
        flight.drain_quietly()
        if kept is not None and pool is not None:
            pool.trim()  # what the caller keeps until its next call: within the cap


def keep_cap(bucket_bytes: int, sizes: Sequence[int]) -> int:
    """The bytes a :class:`~fsdptk._engine.pool.Pool` kept between calls holds at the end of a call
    (``weight_source(keep_buffers=True)``): ``2 * max(bucket_bytes, largest) - bucket_bytes``,
    ``largest`` the largest of ``sizes`` (the full tensors this rank receives).

    Examples:
        >>> keep_cap(16, [4, 8]), keep_cap(16, [40])
        (16, 64)
    """
    biggest = max([bucket_bytes, *sizes])
    return 2 * biggest - bucket_bytes


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _empty(pool: Pool | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device | None = None
           ) -> torch.Tensor:
    """Uninitialised memory (on the CPU unless ``device`` says otherwise): from ``pool`` (reused)
    when there is one and it is CPU memory."""
    if pool is not None and (device is None or device.type == "cpu"):
        return pool.take(shape, dtype)
    return torch.empty(tuple(shape), dtype=dtype, device=device or "cpu")


def _collect_messages(items: list[tuple[str, torch.Tensor]], layouts: list[Layout], plan: GatherPlan,
                      bucket: list[int], fulls: dict[int, torch.Tensor], comm: torch.device, status: Status,
                      pool: Pool | None = None) -> tuple[list[Post], list[tuple[Transfer, torch.Tensor]]]:
    """This rank's messages of a bucket, as :func:`~fsdptk._engine.routes.bucket_transfers` plans
    them: what it sends (its small pieces for a destination packed into one flat buffer; a large
    dim-0 piece as it is, no copy when contiguous on ``comm``) and the memory it receives into (a
    flat buffer per sender; a view of the full tensor per large piece); and the received flat
    buffers to unpack."""
    rank = _world()[1]
    posts: list[Post] = []
    received: list[tuple[Transfer, torch.Tensor]] = []
    for t in bucket_transfers(plan, bucket, rank):
        if t.recv:
            if t.packed:
                buf = _empty(pool, (t.nbytes,), torch.uint8, comm)
                received.append((t, buf))
            else:
                box = plan.sends[t.peer][t.items[0]]
                assert box is not None, "a planned piece has a box"
                buf = fulls[t.items[0]][box[0]]
            posts.append(Post(True, t.peer, buf))
        else:
            posts.append(Post(False, t.peer, _collect_pack(items, layouts, t, comm, status, pool)))
    return posts, received


def _collect_pack(items: list[tuple[str, torch.Tensor]], layouts: list[Layout], t: Transfer, comm: torch.device,
                  status: Status, pool: Pool | None = None) -> torch.Tensor:
    """A sender: the tensor of one planned message: its small pieces packed in one flat buffer, or
    its one large dim-0 piece as it is (no copy when contiguous on ``comm``)."""
    buf = _empty(pool, (t.nbytes,), torch.uint8, comm) if t.packed else None
    off = 0
    for i in t.items:
        try:
            local = layouts[i].send_local()
            if buf is None:
                return local.to(comm).contiguous()
            off = pack(buf, off, local)
        except Exception as exc:
            status.fail(exc, f"reading its shard of {items[i][0]!r}")
            raise
    assert buf is not None
    return buf


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


def _collect_hand_over(items: list[tuple[str, torch.Tensor]], plan: GatherPlan, mine: list[int],
                       fulls: dict[int, torch.Tensor], received: list[tuple[Transfer, torch.Tensor]],
                       status: Status) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A destination: unpack a bucket that has arrived (its large pieces are already in place) and
    yield it."""
    if status.error is not None:
        return
    name = None
    try:
        for t, buf in received:
            off = 0
            for i in t.items:
                box = plan.sends[t.peer][i]
                assert box is not None, "a planned piece has a box"
                name = items[i][0]
                piece, off = unpack(buf, off, box_shape(box), plan.dtypes[i], torch.device("cpu"))
                place(fulls[i], box, piece)
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"assembling {name!r}")
        return
    yield from hand_over([[(items[i][0], fulls[i]) for i in mine]], status)

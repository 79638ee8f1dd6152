"""Collect: local shards -> full CPU tensors on rank 0 only (the gather direction of the engine).

Each shard owner (one replica per replicate group) sends exactly its bytes of a bucket to rank 0,
point to point: small pieces in one flat buffer, large dim-0 pieces alone, received straight into
the full tensors; rank 0 places the rest and yields the bucket. Two buckets are in flight.
The status of every bucket is agreed before its bytes move (:mod:`fsdptk._engine.agree`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from fsdptk._core.compat import local_tensor
from fsdptk._core.dist import all_gather_object, comm_device, comm_errors, error_payload, raise_lowest
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
    box: Box | None  # the box of the full tensor this rank sends (None: it sends none)
    problem: str | None  # why the item cannot be gathered, or None


class _GatherView(NamedTuple):
    """What each rank sends in :func:`collect`'s one object exchange."""

    fingerprint: str | None  # of its items (fqns, shapes, dtypes, layout kinds)
    boxes: list[Box | None]  # per item, the box it sends (None: it sends none)
    problems: list[tuple[str, str]]  # (exception type name, message naming the key)
    error: Any  # error_payload of its local failure, or None


def _collect_view(t: object, rank: int) -> _ItemView:
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
    return _ItemView(layout, layout.send_box(rank), None)


def collect(
    items: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    retained: bool = False,
    failed: BaseException | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Turn local shards into full CPU tensors on rank 0, one bucket at a time.

    Each shard owner (one replica per replicate group) sends exactly its bytes of a bucket as one
    flat buffer to rank 0 (point to point: a gather, never an all-gather; no barrier); plain
    tensors are taken from rank 0 with no communication. Rank 0 yields the bucket's full tensors
    (CPU, original dtype, NF4 dequantised, fresh memory not shared with the model); the other ranks
    yield ``[]`` per bucket. Memory beyond the shards: one bucket (rank 0: full tensors plus the
    received buffers; other ranks: their packed pieces). Consistency of the items is checked first
    with one object collective, so a mismatch is an error on every rank, not a hang; then the
    status of every bucket is agreed before its bytes move (see the module docstring): a failure
    on any rank raises the same error on every rank. A caller whose own code fails on one rank
    while consuming (a file write) calls ``generator.throw(exc)`` so the other ranks raise ``exc``.

    Args:
        items: ``(fqn, tensor)`` pairs in the same order on every rank: DTensors (any mesh,
            ``_StridedShard`` included), plain tensors, NF4 tensors or DTensors wrapping NF4.
        bucket_bytes: full-tensor bytes per bucket: bounds the full tensors rank 0 holds for one
            bucket and every rank's packed pieces.
        retained: the caller keeps every bucket (it builds the whole state dict), so the full
            tensors are not counted toward ``bucket_bytes``, only the packed pieces: large dim-0
            shards received into place then move in few buckets, with few status agreements.
        failed: the caller's own pre-flight error on this rank (a bad argument), carried in the
            metadata exchange so that every rank raises the lowest failing rank's error with no
            agreement of the caller's own; ``items`` is not looked at on a rank that passes it.

    Returns:
        Iterator[list[tuple[str, torch.Tensor]]]: buckets; every rank must exhaust the generator.

    Raises:
        ValueError: on every rank, when items differ between ranks or a tensor is on ``meta``.
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
    world, rank = _world()
    views: list[_ItemView] = []
    problems: list[tuple[str, str]] = []
    fp, error = None, failed
    listed: list[tuple[str, torch.Tensor]] = []
    try:  # local work: a failure here is agreed below, with the metadata
        if failed is not None:
            raise failed
        listed = list(items)
        items = listed
        views = [_collect_view(t, rank) for _, t in items]
        problems = [("ValueError", f"{fqn!r} {v.problem}") for (fqn, _), v in zip(items, views) if v.problem]
        fp = fingerprint((fqn, tuple(t.shape), str(t.dtype), type(v.layout).__name__)
                          for (fqn, t), v in zip(items, views))
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = e
    payloads = all_gather_object(_GatherView(fingerprint=fp, boxes=[v.box for v in views], problems=problems,
                                             error=error_payload(error)))
    raise_lowest([p.error for p in payloads], error)
    diff = [r for r, p in enumerate(payloads) if p.fingerprint != payloads[0].fingerprint]
    all_problems = [(k, (f"rank {r}: " if world > 1 else "") + m) for r, p in enumerate(payloads)
                    for k, m in p.problems]
    if diff:
        all_problems.append(("ValueError", f"the items (fqns, shapes, dtypes) differ between rank 0 and ranks {diff}"))
    _raise(all_problems, "cannot gather the state")
    status = Status("gather")
    layouts = [v.layout for v in views if v.layout is not None]
    assert len(layouts) == len(listed), "every item is a tensor (agreed just above)"
    yield from guarded(_collect_buckets(listed, layouts, [p.boxes for p in payloads], bucket_bytes, retained,
                                        status), status)


def _collect_buckets(items: list[tuple[str, torch.Tensor]], layouts: list[Layout],
                     boxes: list[list[Box | None]], bucket_bytes: int, retained: bool, status: Status,
                     ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The data phase of :func:`collect`: per bucket, pack, agree, then move the bytes.

    A sender's small pieces travel packed in one flat buffer; a large dim-0 piece travels alone,
    from the shard itself, and rank 0 receives it straight into the full tensor's memory (over a
    CPU transport). Pipelined: a sender packs bucket k+1 while bucket k is on the wire (two buckets
    in flight); rank 0 places its own pieces of bucket k while the others' bytes arrive, and
    yields bucket k before bucket k+1 is agreed, so a failure of the caller's code (a file write)
    stops the senders at the next bucket. Once a bucket is agreed every rank posts its transfers of it, and
    every posted transfer is waited for, on the error paths too."""
    world, rank = _world()
    comm = comm_device() if world > 1 else torch.device("cpu")
    into_full = comm.type == "cpu"  # a receive can land in the (CPU) full tensors
    direct = [[b is not None and into_full and is_dim0_run(b, t.shape)
               and is_direct(box_shape(b), t.dtype) for b, (_, t) in zip(boxes[r], items)] for r in range(world)]
    if retained:  # only the packed (or dequantised) pieces add memory: the fulls are kept anyway
        sizes = [sum(nbytes(box_shape(b), t.dtype) for r in range(1, world)
                     if (b := boxes[r][i]) is not None and (layouts[i].quantized or not direct[r][i]))
                 for i, (_, t) in enumerate(items)]
    else:
        sizes = [nbytes(t.shape, t.dtype) for _, t in items]
    flight = InFlight(status.waiter)  # the previous bucket's transfers
    held: tuple[list[int], dict[int, torch.Tensor], dict[int, torch.Tensor]] | None = None  # rank 0
    try:
        for bucket in buckets(sizes, bucket_bytes):
            if rank == 0 and held is not None:  # bucket k-1: it arrived while rank 0 placed its own
                with comm_errors(status.what):
                    flight.wait()
                yield from _collect_hand_over(items, boxes, direct, *held, status)
                held = None
            msgs: dict[int, list[torch.Tensor]] = {}
            fulls: dict[int, torch.Tensor] = {}
            bufs: dict[int, torch.Tensor] = {}
            if status.error is None:
                try:
                    if rank == 0:
                        fulls = {i: torch.empty(tuple(items[i][1].shape), dtype=items[i][1].dtype) for i in bucket}
                        bufs, msgs = _collect_recv_buffers(items, bucket, boxes, direct, fulls, world, comm)
                    else:
                        msgs = _collect_pack(items, layouts, bucket, boxes[rank], direct[rank], comm, status)
                except Exception as exc:  # noqa: BLE001 - agreed just below
                    status.fail(exc)
            status.agree()
            if rank != 0:
                with comm_errors(status.what):
                    flight.wait()  # bucket k-1 is out: its buffer is free
                    refused = flight.post_all(isend, [(0, t) for t in msgs.get(rank, [])])
                status.fail_post(refused)
                del msgs
                yield from hand_over([[]], status)
                continue
            with comm_errors(status.what):
                refused = flight.post_all(irecv, [(r, t) for r, ts in msgs.items() for t in ts])
            status.fail_post(refused)
            _collect_own(items, layouts, bucket, boxes[0], fulls, status)  # while the bytes arrive
            held = (bucket, fulls, bufs)
            del msgs, fulls, bufs
        with comm_errors(status.what):
            flight.wait()
        if held is not None:
            yield from _collect_hand_over(items, boxes, direct, *held, status)
        status.agree()
    finally:
        flight.drain_quietly()


def _collect_pack(items: list[tuple[str, torch.Tensor]], layouts: list[Layout], bucket: list[int],
                  boxes: list[Box | None], direct: list[bool], comm: torch.device, status: Status,
                  ) -> dict[int, list[torch.Tensor]]:
    """A sender: its messages of a bucket (``{}`` when it owns none of them): its small pieces in
    one flat buffer, then each large dim-0 piece as it is (no copy when contiguous on ``comm``)."""
    rank = _world()[1]
    mine = [i for i in bucket if boxes[i] is not None]
    total = packed_size([(box_shape(b), items[i][1].dtype) for i in mine
                         if (b := boxes[i]) is not None and not direct[i]])
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
    return {rank: msgs} if msgs else {}


def _collect_recv_buffers(items: list[tuple[str, torch.Tensor]], bucket: list[int],
                          boxes: list[list[Box | None]], direct: list[list[bool]], fulls: dict[int, torch.Tensor],
                          world: int, comm: torch.device,
                          ) -> tuple[dict[int, torch.Tensor], dict[int, list[torch.Tensor]]]:
    """Rank 0: per sender, the flat buffer of its small pieces, and its messages in send order
    (that buffer, then a view of the full tensor for each large dim-0 piece)."""
    bufs, msgs = {}, {}
    for r in range(1, world):
        total = packed_size([(box_shape(b), items[i][1].dtype)
                             for i in bucket if (b := boxes[r][i]) is not None and not direct[r][i]])
        if total:
            bufs[r] = torch.empty(total, dtype=torch.uint8, device=comm)
        views = [fulls[i][b[0]] for i in bucket if direct[r][i] and (b := boxes[r][i]) is not None]
        if total or views:
            msgs[r] = ([bufs[r]] if total else []) + views
    return bufs, msgs


def _collect_own(items: list[tuple[str, torch.Tensor]], layouts: list[Layout], bucket: list[int],
                 boxes: list[Box | None], fulls: dict[int, torch.Tensor], status: Status) -> None:
    """Rank 0: place its own pieces of a bucket (a failure is agreed at the next boundary)."""
    if status.error is not None:
        return
    name = None
    try:
        for i in bucket:
            box = boxes[i]
            if box is not None:
                name = items[i][0]
                place(fulls[i], box, layouts[i].send_local().cpu())
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"reading its shard of {name!r}")


def _collect_hand_over(items: list[tuple[str, torch.Tensor]], boxes: list[list[Box | None]],
                       direct: list[list[bool]], bucket: list[int], fulls: dict[int, torch.Tensor],
                       bufs: dict[int, torch.Tensor], status: Status,
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Rank 0: unpack a bucket that has arrived (its large pieces are already in place) and yield it."""
    if status.error is not None:
        return
    name = None
    try:
        for r, buf in bufs.items():
            off = 0
            for i in bucket:
                box = boxes[r][i]
                if box is not None and not direct[r][i]:
                    name = items[i][0]
                    piece, off = unpack(buf, off, box_shape(box), items[i][1].dtype, torch.device("cpu"))
                    place(fulls[i], box, piece)
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"assembling {name!r}")
        return
    yield from hand_over([[(items[i][0], fulls[i]) for i in bucket]], status)

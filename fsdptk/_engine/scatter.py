"""Distribute: full tensors -> this rank's shards (the load direction of the engine).

Without ``src_rank0`` each rank reads its own piece of a source it can read (no tensor moves; a
lazy source is read shard-on-read). With ``src_rank0`` rank 0 reads one tensor at a time and sends
each rank only its bytes of a bucket, point to point: small pieces packed into one flat buffer per
rank, large ones alone from and into their final memory, two buckets in flight. The status of
every bucket is agreed before its bytes move (:mod:`fsdptk._engine.agree`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fsdptk._core.dist import comm_device, comm_errors
from fsdptk._core.dist import world as _world
from fsdptk._engine.agree import LoadPlan, Status, guarded, hand_over
from fsdptk._engine.layouts import Reads, box_shape, is_dim0_run
from fsdptk._engine.sources import Source, as_source
from fsdptk._engine.wire import (
    DEFAULT_BUCKET_BYTES,
    LOCAL_AGREE_BUCKETS,
    InFlight,
    Post,
    buckets,
    is_direct,
    nbytes,
    pack,
    packed_size,
    unpack,
)


def distribute(
    plan: LoadPlan,
    source: Mapping[str, Any] | Source,
    *,
    device: torch.device | str,
    release: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn full tensors into this rank's shards, yielding ``(fqn, value)`` in ``plan.keys`` order.

    ``value`` is of the target's kind: a DTensor with the target's mesh and placements (local shard
    on ``device``), a plain full tensor on ``device``, an ``NF4Tensor``, or a DTensor wrapping this
    rank's NF4 chunk (the FULL tensor is quantised with the target's block sizes, then chunked).

    Without ``src_rank0`` each rank slices its own piece of the source it can read: no tensor
    moves; a source with ``get_slice`` is read shard-on-read (only the local box). With
    ``src_rank0`` rank 0 reads one tensor at a time and sends each rank its bytes of a bucket: the
    small pieces packed into one flat buffer per rank, each large piece alone from a view of the
    full tensor into the receiver's final local tensor (zero-copy for dim-0 shards of matching
    dtype); bucket k+1 is packed while bucket k is on the wire (one extra bucket of memory). Either way every rank must exhaust the generator (it runs
    collectives): the status of every bucket is agreed before its bytes move (see the module
    docstring), so a failure on any rank raises the same error on every rank, and a value is
    yielded only once every rank has read its bucket. If the caller's own code fails on one rank
    while consuming, ``generator.throw(exc)`` makes the other ranks raise ``exc`` too (a caller
    that just drops the generator still lets them raise, with a generic message).

    Replicated (non-DTensor) targets read by every rank from its own source (no ``src_rank0``)
    are compared across ranks by a checksum carried in the bucket agreements (no extra
    collective): different values raise a ValueError naming the keys instead of leaving the ranks
    silently different. With ``src_rank0`` they are rank 0's values on every rank.

    Args:
        plan: from :func:`agree` (same ``source`` and ``src_rank0``).
        source: the source passed to :func:`agree`.
        device: where the outputs are allocated (``meta`` targets are materialised here).
        release: drop each source entry (``del source[key]``, when the Mapping supports it) right
            after use, so the caller's memory shrinks as the load proceeds. This MUTATES ``source``.
        bucket_bytes: bounds the memory one bucket adds beyond the caller's source and the
            outputs: full-tensor bytes of what rank 0 reads from a lazy source (or converts), and
            the packed pieces. Pieces sent from a tensor the source already holds (a ``dict``) and
            received into the outputs add nothing, so such a model moves in few buckets. Without
            ``src_rank0`` the status is agreed every 16 buckets (nothing is sent).

    Returns:
        Iterator[tuple[str, torch.Tensor]]: ``(fqn, value)`` pairs (plain tensors, not Parameters).

    Raises:
        ValueError: when torchao cannot quantise or split an NF4 tensor (names the shape), or
            replicated targets would differ between ranks (names the keys and ranks); on every rank.
        Exception: a read failing on any rank (the source raising, a file gone), on every rank:
            the lowest failing rank's error, named after that rank and the key it was reading.
        RuntimeError: the communication itself failed (a rank died), naming the operation.

    Examples:
        >>> import torch
        >>> from fsdptk._engine import agree, distribute
        >>> src = {"w": torch.ones(2, 3)}
        >>> plan = agree([("w", torch.empty(2, 3, dtype=torch.bfloat16, device="meta"))], src)
        >>> [(k, v.dtype) for k, v in distribute(plan, src, device="cpu")]
        [('w', torch.bfloat16)]
    """
    device = torch.device(device)
    src = as_source(source)
    world, rank = _world()
    if plan.src_rank0 and world > 1:
        status = Status("load (scatter from rank 0)")
        body = _distribute_scatter(plan, src, device, release, bucket_bytes, world, rank, status)
    else:
        status = Status("load", check_replicas=world > 1 and not plan.src_rank0)
        body = _distribute_local(plan, src, device, release, bucket_bytes, status)
    yield from guarded(body, status)


def _distribute_local(plan: LoadPlan, source: Source, device: torch.device, release: bool,
                      bucket_bytes: int, status: Status) -> Iterator[tuple[str, torch.Tensor]]:
    """Each rank reads its own pieces; no tensor moves, only the status is agreed per bucket."""
    entries = plan.entries
    sizes = [nbytes(lay.shape, plan.out_dtype(f, lay)) for f, lay in entries]
    reads = Reads(source)
    for bucket in buckets(sizes, bucket_bytes * LOCAL_AGREE_BUCKETS):
        out = []
        for i in bucket if status.error is None else ():
            fqn, lay = entries[i]
            try:
                local = lay.read_local(source, fqn, plan.out_dtype(fqn, lay), device, release, reads)
                if lay.replicated:
                    status.replica(fqn, lay.replica_tensors(local))
                if release:
                    source.release(fqn)
            except Exception as exc:  # noqa: BLE001 - agreed just below
                status.fail(exc, f"reading {fqn!r}")
                break
            out.append((fqn, lay.wrap(local)))
        status.agree()
        yield from hand_over(out, status)
        del out
    status.agree()


def _rank0_pieces(plan: LoadPlan, i: int, source: Source, world: int,
                  comm: torch.device) -> list[list[torch.Tensor]]:
    """Rank 0: read one full tensor and cut every rank's pieces out of it."""
    fqn, lay = plan.entries[i]
    layouts = plan.layouts or []
    return lay.cut(source.read(fqn), [layouts[r][i].local for r in range(world)], plan.out_dtype(fqn, lay), comm)


def _extra_bytes(plan: LoadPlan, i: int, direct: list[list[list[bool]]], world: int, comm: torch.device,
                 device: torch.device) -> int:
    """What entry ``i`` adds to memory while its bucket is on the wire, beyond the caller's source
    and the outputs: this is what ``bucket_bytes`` bounds.

    Rank 0 reads (or converts, or quantises) the full tensor unless its source already holds it,
    contiguous, in the output dtype, on the communication device: then the only extra bytes are
    the pieces that are packed (or copied to be contiguous), on rank 0 and on their receiver.
    Large dim-0 pieces are sent from views of the full tensor and received into the outputs, so a
    model of such tensors held in a dict moves in one bucket with one status agreement. When the
    outputs live on another device than the transport's (gloo with a CUDA ``device``), every
    received piece is a staging copy, so everything counts.
    """
    fqn, lay = plan.entries[i]
    dtype = plan.out_dtype(fqn, lay)
    meta = plan.metas[fqn]
    if lay.quantized or meta.held_on != comm.type or meta.dtype != dtype or device.type != comm.type:
        return nbytes(lay.shape, dtype)
    layouts = plan.layouts or []
    return sum(nbytes(box_shape(layouts[r][i].local), dtype) for r in range(1, world)
               if not (direct[r][i][0] and is_dim0_run(layouts[r][i].local, lay.shape)))


def _distribute_scatter(plan: LoadPlan, source: Source, device: torch.device, release: bool,
                        bucket_bytes: int, world: int, rank: int, status: Status,
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0 sends each rank exactly its bytes of a bucket, point to point (a scatter without
    padding): the small pieces packed into one flat buffer per rank, each large piece on its own
    (sent from a view of the full tensor when it is contiguous there, received straight into the
    receiver's final local tensor). Buckets are sized by the memory they add
    (:func:`_extra_bytes`), not by the bytes they move.

    Pipelined two buckets deep: rank 0 reads and packs bucket k+1 while bucket k is on the wire
    (then waits for k before sending k+1), and copies its own pieces of a bucket while that
    bucket's sends are on the wire; a receiver posts its receives of bucket k+1 before it unpacks
    and yields bucket k. Everything that can fail before bytes move (rank 0's reads and packing,
    the receive buffers) happens before the bucket's status agreement; a failure after it (rank
    0's own copies, a receiver's unpacking) is agreed at the next one, before anything of that
    bucket is yielded anywhere. Once a bucket is agreed every rank posts its transfers of it, and
    every posted transfer is waited for, on the error paths too."""
    comm = comm_device()
    entries = plan.entries
    layouts = plan.layouts or []
    parts = [[lay.wire_parts(layouts[r][i].local, layouts[r][i].parts, plan.out_dtype(f, lay)) for i, (f, lay) in enumerate(entries)]
             for r in range(world)]
    direct = [[[is_direct(s, d, lay.quantized) for s, d in parts[r][i]] for i, (_, lay) in enumerate(entries)]
              for r in range(world)]
    extra = [_extra_bytes(plan, i, direct, world, comm, device) for i in range(len(entries))]
    flight = InFlight(status.waiter)  # the previous bucket's transfers
    held: tuple[list[int], list[torch.Tensor]] | None = None  # a receiver: the previous bucket
    try:
        for bucket in buckets(extra, bucket_bytes):
            msgs: dict[int, list[torch.Tensor]] = {}
            own: list[tuple[str, Any, list[torch.Tensor]]] = []
            if status.error is None:
                try:
                    if rank == 0:
                        msgs, own = _scatter_pack(plan, bucket, source, parts, direct, world, comm, release,
                                                  status)
                    else:
                        msgs = {rank: _scatter_recv_buffers(bucket, parts[rank], direct[rank], comm)}
                except Exception as exc:  # noqa: BLE001 - agreed just below
                    status.fail(exc)
            status.agree()
            with comm_errors(status.what):  # one batch per bucket (wire's point-to-point order);
                # only rank 0 sends, so no rank both sends and receives and no wait can cycle
                if rank == 0:
                    flight.wait()  # bucket k-1 is out: its buffers are free
                    refused = flight.post_all(Post(False, r, t) for r, ts in msgs.items() for t in ts)
                else:
                    posted = InFlight(status.waiter)
                    refused = posted.post_all(Post(True, 0, t) for t in msgs.get(rank, []))
                    flight.wait()  # bucket k-1 has arrived (bucket k's receives are already posted)
                    flight = posted
            status.fail_post(refused)
            if rank == 0:
                yield from _scatter_own(own, device, status)  # while the bucket is on the wire
            elif held is not None:
                yield from _scatter_hand_over(plan, *held, parts[rank], direct[rank], device, status)
            held = (bucket, msgs.get(rank, [])) if rank != 0 else None
            del msgs, own
        with comm_errors(status.what):
            flight.wait()
        status.agree()  # the last bucket's unpacking (a receiver's) is agreed before it is yielded
        if held is not None:
            yield from _scatter_hand_over(plan, *held, parts[rank], direct[rank], device, status)
        status.agree()
    finally:
        flight.drain_quietly()


def _scatter_own(own: list[tuple[str, Any, list[torch.Tensor]]], device: torch.device, status: Status,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0: copy its own pieces of a bucket into fresh memory on ``device`` and yield them (a
    failure is recorded, yields nothing more, and is agreed at the next boundary)."""
    if status.error is not None:
        return
    out = []
    for fqn, lay, pieces in own:
        try:
            mine = [torch.empty(p.shape, dtype=p.dtype, device=device).copy_(p) for p in pieces]
            out.append((fqn, lay.wrap(lay.assemble(mine))))
        except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
            status.fail(exc, f"copying its own piece of {fqn!r}")
            return
    yield from hand_over(out, status)


def _scatter_hand_over(plan: LoadPlan, bucket: list[int], received: list[torch.Tensor], parts: list[Any],
                       direct: list[list[bool]], device: torch.device, status: Status,
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver: unpack a bucket that has arrived and yield it (nothing when a rank failed)."""
    if status.error is not None:
        return
    try:
        out = _scatter_unpack(plan, bucket, parts, direct, received, device)
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"unpacking a bucket of {[plan.entries[i][0] for i in bucket]}")
        return
    yield from hand_over(out, status)


def _scatter_recv_buffers(bucket: list[int], parts: list[Any], direct: list[list[bool]],
                          comm: torch.device) -> list[torch.Tensor]:
    """A receiver: its messages of a bucket, in send order (the flat buffer of its small pieces,
    then one final local tensor per large piece)."""
    size = packed_size([p for i in bucket for p, d in zip(parts[i], direct[i]) if not d])
    msgs = [torch.empty(size, dtype=torch.uint8, device=comm)] if size else []
    msgs += [torch.empty(s, dtype=dt, device=comm) for i in bucket for (s, dt), d in zip(parts[i], direct[i]) if d]
    return msgs


def _scatter_pack(plan: LoadPlan, bucket: list[int], source: Source, parts: list[list[Any]],
                  direct: list[list[list[bool]]], world: int, comm: torch.device, release: bool,
                  status: Status,
                  ) -> tuple[dict[int, list[torch.Tensor]], list[tuple[str, Any, list[torch.Tensor]]]]:
    """Rank 0: read a bucket; every other rank's messages (its small pieces packed into one flat
    buffer, then each large piece as it is: a view of the full tensor when contiguous there), and
    its own pieces as cut (copied by :func:`_scatter_own` once the messages are on the wire)."""
    sizes = [packed_size([p for i in bucket for p, d in zip(parts[r][i], direct[r][i]) if not d])
             for r in range(world)]
    bufs = {r: torch.empty(sizes[r], dtype=torch.uint8, device=comm) for r in range(1, world) if sizes[r]}
    offs = dict.fromkeys(bufs, 0)
    alone: dict[int, list[torch.Tensor]] = {r: [] for r in range(1, world)}
    own = []
    for i in bucket:
        fqn, lay = plan.entries[i]
        try:
            pieces = _rank0_pieces(plan, i, source, world, comm)
        except Exception as exc:
            status.fail(exc, f"reading {fqn!r}")
            raise
        if release:
            source.release(fqn)
        own.append((fqn, lay, pieces[0]))
        for r in range(1, world):
            for piece, d in zip(pieces[r], direct[r][i]):
                if d:  # zero-copy when the piece is a contiguous view of the full tensor
                    alone[r].append(piece.to(comm).contiguous())
                elif r in bufs:  # (no buffer: all of its pieces are empty)
                    offs[r] = pack(bufs[r], offs[r], piece)
        del pieces
    msgs = {r: ([bufs[r]] if r in bufs else []) + alone[r] for r in range(1, world)}
    return {r: m for r, m in msgs.items() if m}, own


def _scatter_unpack(plan: LoadPlan, bucket: list[int], parts: list[Any], direct: list[list[bool]],
                    received: list[torch.Tensor], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """A receiver: its outputs of a bucket: views out of the flat buffer (copies when ``device``
    is not the communication device), and the large pieces as received."""
    has_buf = packed_size([p for i in bucket for p, d in zip(parts[i], direct[i]) if not d]) > 0
    buf = received[0] if has_buf else None
    alone = iter(received[1:] if has_buf else received)
    out, off = [], 0
    for i in bucket:
        fqn, lay = plan.entries[i]
        tensors = []
        for (shape, dtype), d in zip(parts[i], direct[i]):
            if d:
                t = next(alone)
                tensors.append(t if t.device == device else t.to(device))
            else:
                t, off = unpack(buf, off, shape, dtype, device)
                tensors.append(t)
        out.append((fqn, lay.wrap(lay.assemble(tensors))))
    return out

"""Distribute: full tensors -> this rank's shards (the load direction of the engine).

Without ``src_rank0`` each rank reads its own piece of a source it can read (no tensor moves; a
lazy source is read shard-on-read). With ``src_rank0`` rank 0 reads one tensor at a time, packs
each rank's bytes of a bucket into one flat buffer per rank and sends it point to point: each rank
receives only its bytes. The status of every bucket is agreed before its bytes move
(:mod:`fsdptk._engine.agree`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from fsdptk._dist import _comm_device, comm_errors
from fsdptk._dist import world as _world
from fsdptk._engine.agree import LoadPlan, Status, guarded, hand_over
from fsdptk._engine.sources import Source, as_source
from fsdptk._engine.wire import (
    DEFAULT_BUCKET_BYTES,
    LOCAL_AGREE_BUCKETS,
    buckets,
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
    ``src_rank0`` rank 0 reads one tensor at a time, packs each rank's bytes of a bucket into one
    flat buffer per rank and scatters. Either way every rank must exhaust the generator (it runs
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
        bucket_bytes: target size (full-tensor bytes) of one scatter; bounds rank 0's extra memory.
            Without ``src_rank0`` the status is agreed every 16 buckets (nothing is sent).

    Returns:
        Iterator[tuple[str, torch.Tensor]]: ``(fqn, value)`` pairs (plain tensors, not Parameters).

    Raises:
        ValueError: when torchao cannot quantise or split an NF4 tensor (names the shape), or
            replicated targets would differ between ranks (names the keys and ranks); on every rank.
        Exception: a read failing on any rank (the source raising, a file gone), on every rank:
            the lowest failing rank's error, named after that rank and the key it was reading.
        RuntimeError: the communication itself failed (a rank died), naming the operation.

    Example:
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
    entries = plan._entries
    sizes = [nbytes(lay.shape, plan.out_dtype(f, lay)) for f, lay in entries]
    for bucket in buckets(sizes, bucket_bytes * LOCAL_AGREE_BUCKETS):
        out = []
        for i in bucket if status.error is None else ():
            fqn, lay = entries[i]
            try:
                local = lay.read_local(source, fqn, plan.out_dtype(fqn, lay), device, release)
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
    fqn, lay = plan._entries[i]
    layouts = plan._layouts or []
    return lay.cut(source.read(fqn), [layouts[r][i][0] for r in range(world)], plan.out_dtype(fqn, lay), comm)


def _distribute_scatter(plan: LoadPlan, source: Source, device: torch.device, release: bool,
                        bucket_bytes: int, world: int, rank: int, status: Status,
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0 sends each rank exactly its bytes of a bucket (one flat buffer per rank, point to
    point: a scatter without padding); rank 0's own pieces never touch a buffer. Everything that
    can fail (rank 0's reads and packing, the receive buffers) happens before the bucket's status
    agreement; a receiver's unpacking failure is agreed at the next one."""
    comm = _comm_device()
    entries = plan._entries
    layouts = plan._layouts or []
    parts = [[lay.wire_parts(*layouts[r][i], plan.out_dtype(f, lay)) for i, (f, lay) in enumerate(entries)]
             for r in range(world)]
    full_sizes = [nbytes(lay.shape, plan.out_dtype(f, lay)) for f, lay in entries]
    for bucket in buckets(full_sizes, bucket_bytes):
        sizes = [packed_size([p for i in bucket for p in parts[r][i]]) for r in range(world)]
        bufs: dict[int, torch.Tensor] = {}
        out: list[tuple[str, torch.Tensor]] = []
        if status.error is None:
            try:
                if rank == 0:
                    bufs, out = _scatter_pack(plan, bucket, source, sizes, world, comm, device, release,
                                              status)
                elif sizes[rank]:
                    bufs = {rank: torch.empty(sizes[rank], dtype=torch.uint8, device=comm)}
            except Exception as exc:  # noqa: BLE001 - agreed just below
                status.fail(exc)
        status.agree()
        with comm_errors(status.what):
            if rank == 0:
                works = [dist.isend(buf, dst=r) for r, buf in bufs.items()]
                for w in works:
                    w.wait()
            elif sizes[rank]:
                dist.recv(bufs[rank], src=0)
        if rank != 0 and status.error is None:
            try:
                out = _scatter_unpack(plan, bucket, parts[rank], bufs.get(rank), device)
            except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
                status.fail(exc, f"unpacking a bucket of {[entries[i][0] for i in bucket]}")
        del bufs
        yield from hand_over(out, status)
        del out
    status.agree()


def _scatter_pack(plan: LoadPlan, bucket: list[int], source: Source, sizes: list[int],
                  world: int, comm: torch.device, device: torch.device, release: bool, status: Status,
                  ) -> tuple[dict[int, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """Rank 0: read a bucket, pack every other rank's bytes, keep its own pieces as outputs."""
    bufs = {r: torch.empty(sizes[r], dtype=torch.uint8, device=comm) for r in range(1, world) if sizes[r]}
    offs = dict.fromkeys(bufs, 0)
    out = []
    for i in bucket:
        fqn, lay = plan._entries[i]
        try:
            pieces = _rank0_pieces(plan, i, source, world, comm)
        except Exception as exc:
            status.fail(exc, f"reading {fqn!r}")
            raise
        if release:
            source.release(fqn)
        own = [torch.empty(p.shape, dtype=p.dtype, device=device).copy_(p) for p in pieces[0]]
        out.append((fqn, lay.wrap(lay.assemble(own))))
        for r in bufs:
            for piece in pieces[r]:
                offs[r] = pack(bufs[r], offs[r], piece)
        del pieces
    return bufs, out


def _scatter_unpack(plan: LoadPlan, bucket: list[int], parts: list[Any], buf: torch.Tensor | None,
                    device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """A receiver: its outputs of a bucket, viewed out of (or copied from) the received buffer."""
    out, off = [], 0
    for i in bucket:
        fqn, lay = plan._entries[i]
        tensors = []
        for shape, dtype in parts[i]:
            t, off = unpack(buf, off, shape, dtype, device)
            tensors.append(t)
        out.append((fqn, lay.wrap(lay.assemble(tensors))))
    return out

"""Collect: local shards -> full CPU tensors on rank 0 only (the gather direction of the engine).

Each shard owner (one replica per replicate group) sends exactly its bytes of a bucket as one flat
buffer to rank 0, point to point; rank 0 places them into the full tensors and yields the bucket.
The status of every bucket is agreed before its bytes move (:mod:`fsdptk._engine.agree`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from fsdptk._compat import local_tensor
from fsdptk._dist import _comm_device, all_gather_object, comm_errors, error_payload, raise_lowest
from fsdptk._dist import raise_problems as _raise
from fsdptk._dist import world as _world
from fsdptk._engine.agree import Status, _fingerprint, guarded, hand_over
from fsdptk._engine.layouts import Box, Layout, box_shape, layout_of, place
from fsdptk._engine.wire import DEFAULT_BUCKET_BYTES, buckets, nbytes, pack, packed_size, unpack


def _collect_view(t: object, rank: int) -> tuple[Layout | None, Box | None, str | None]:
    """(layout, this rank's box if it sends, problem) for one item."""
    if not isinstance(t, torch.Tensor):
        return None, None, f"expected a tensor, got {type(t).__name__}"
    layout = layout_of(t)
    if local_tensor(t).is_meta:
        return layout, None, f"is on the meta device (shape {list(t.shape)}); load or initialise it first"
    return layout, layout.send_box(rank), None


def _plain_local(layout: Layout) -> torch.Tensor:
    """The local tensor a sender sends (NF4 dequantised)."""
    return layout.send_local()


def collect(
    items: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
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
        bucket_bytes: full-tensor bytes per bucket.

    Returns:
        Iterator[list[tuple[str, torch.Tensor]]]: buckets; every rank must exhaust the generator.

    Raises:
        ValueError: on every rank, when items differ between ranks or a tensor is on ``meta``.
        Exception: any rank's failure (reading a shard, the caller's thrown-in error), on every
            rank: the lowest failing rank's error, named after that rank.
        RuntimeError: the communication itself failed (a rank died), naming the operation.

    Example:
        >>> import torch
        >>> from fsdptk._engine import collect
        >>> [[(k, v.shape) for k, v in b] for b in collect([("w", torch.ones(2, 3))])]
        [[('w', torch.Size([2, 3]))]]
    """
    world, rank = _world()
    views: list[tuple[Layout | None, Box | None, str | None]] = []
    problems: list[tuple[str, str]] = []
    fp, error = None, None
    try:  # local work: a failure here is agreed below, with the metadata
        items = list(items)
        views = [_collect_view(t, rank) for _, t in items]
        problems = [("ValueError", f"{fqn!r} {p}") for (fqn, _), (_, _, p) in zip(items, views) if p]
        fp = _fingerprint((fqn, tuple(t.shape), str(t.dtype), type(v[0]).__name__)
                          for (fqn, t), v in zip(items, views))
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = e
    payloads = all_gather_object((fp, [v[1] for v in views], problems, error_payload(error)))
    raise_lowest([p[3] for p in payloads], error)
    diff = [r for r, p in enumerate(payloads) if p[0] != payloads[0][0]]
    all_problems = [(k, (f"rank {r}: " if world > 1 else "") + m) for r, p in enumerate(payloads) for k, m in p[2]]
    if diff:
        all_problems.append(("ValueError", f"the items (fqns, shapes, dtypes) differ between rank 0 and ranks {diff}"))
    _raise(all_problems, "cannot gather the state")
    status = Status("gather")
    layouts = [v[0] for v in views]
    yield from guarded(_collect_buckets(items, layouts, [p[1] for p in payloads], bucket_bytes, status),  # type: ignore[arg-type]
                       status)


def _collect_buckets(items: list[tuple[str, torch.Tensor]], layouts: list[Layout],
                     boxes: list[list[Box | None]], bucket_bytes: int, status: Status) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The data phase of :func:`collect`: per bucket, pack, agree, then move the bytes."""
    world, rank = _world()
    comm = _comm_device() if world > 1 else torch.device("cpu")
    sizes = [nbytes(t.shape, t.dtype) for _, t in items]
    for bucket in buckets(sizes, bucket_bytes):
        bufs: dict[int, torch.Tensor] = {}
        fulls: dict[int, torch.Tensor] = {}
        if status.error is None:
            try:
                if rank == 0:
                    fulls = {i: torch.empty(tuple(items[i][1].shape), dtype=items[i][1].dtype) for i in bucket}
                    bufs = _collect_recv_buffers(items, bucket, boxes, world, comm)
                else:
                    bufs = _collect_pack(items, layouts, bucket, boxes[rank], comm, rank, status)
            except Exception as exc:  # noqa: BLE001 - agreed just below
                status.fail(exc)
        status.agree()
        if rank == 0:
            out = _collect_rank0(items, layouts, bucket, boxes, fulls, bufs, status)
            if status.error is None:
                yield from hand_over([out], status)
            del out, fulls
            continue
        if bufs:
            with comm_errors(status.what):
                dist.send(bufs[rank], dst=0)
        del bufs
        yield from hand_over([[]], status)
    status.agree()


def _collect_pack(items: list[tuple[str, torch.Tensor]], layouts: list[Layout], bucket: list[int],
                  boxes: list[Box | None], comm: torch.device, rank: int, status: Status,
                  ) -> dict[int, torch.Tensor]:
    """A sender: its bytes of a bucket in one flat buffer (``{}`` when it owns none of them)."""
    mine = [i for i in bucket if boxes[i] is not None]
    total = packed_size([(box_shape(boxes[i]), items[i][1].dtype) for i in mine])  # type: ignore[arg-type]
    if total == 0:
        return {}
    buf = torch.empty(total, dtype=torch.uint8, device=comm)
    off = 0
    for i in mine:
        try:
            off = pack(buf, off, _plain_local(layouts[i]))
        except Exception as exc:
            status.fail(exc, f"reading its shard of {items[i][0]!r}")
            raise
    return {rank: buf}


def _collect_recv_buffers(items: list[tuple[str, torch.Tensor]], bucket: list[int],
                          boxes: list[list[Box | None]], world: int, comm: torch.device,
                          ) -> dict[int, torch.Tensor]:
    bufs = {}
    for r in range(1, world):
        total = packed_size([(box_shape(boxes[r][i]), items[i][1].dtype)  # type: ignore[arg-type]
                             for i in bucket if boxes[r][i] is not None])
        if total:
            bufs[r] = torch.empty(total, dtype=torch.uint8, device=comm)
    return bufs


def _collect_rank0(items: list[tuple[str, torch.Tensor]], layouts: list[Layout], bucket: list[int],
                   boxes: list[list[Box | None]], fulls: dict[int, torch.Tensor],
                   bufs: dict[int, torch.Tensor], status: Status,
                   ) -> list[tuple[str, torch.Tensor]]:
    """Rank 0: receive a bucket into its buffers while placing its own pieces, then unpack.

    A failure while placing is recorded (agreed at the next boundary); the receives complete
    either way, so the other ranks' sends never wait."""
    with comm_errors(status.what):
        works = [dist.irecv(buf, src=r) for r, buf in bufs.items()]
    name = None
    try:
        for i in bucket:  # rank 0's own pieces while the others' bytes arrive
            if boxes[0][i] is not None:
                name = items[i][0]
                place(fulls[i], boxes[0][i], _plain_local(layouts[i]).cpu())
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"reading its shard of {name!r}")
    with comm_errors(status.what):
        for w in works:
            w.wait()
    if status.error is not None:
        return []
    try:
        for r, buf in bufs.items():
            off = 0
            for i in bucket:
                if boxes[r][i] is not None:
                    name = items[i][0]
                    piece, off = unpack(buf, off, box_shape(boxes[r][i]), items[i][1].dtype,  # type: ignore[arg-type]
                                        torch.device("cpu"))
                    place(fulls[i], boxes[r][i], piece)
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"assembling {name!r}")
        return []
    return [(items[i][0], fulls[i]) for i in bucket]

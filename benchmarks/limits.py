"""The physical limits at a world size, measured in the same run as the methods.

One process group of ``world`` ranks (gloo over loopback, 1 torch thread each, like the methods)
times the collectives a loader or gatherer needs and the local copies and file reads it cannot
avoid. Bandwidths are in GB/s (10**9 bytes per second) of PAYLOAD:

- ``scatter``: rank 0 sends each other rank its 1/world of a buffer: (world-1)/world x S / t;
- ``broadcast``: every rank receives the full buffer: S / t (what a broadcast-then-slice loader pays);
- ``gather``: rank 0 receives (world-1)/world x S / t;
- ``all_gather``: each rank receives (world-1)/world x S / t;
- ``memcpy``: one thread copies S bytes in memory;
- ``file_read``: rank 0 reads the checkpoint file with ``readinto`` (page cache: warm, since the file
  was written or read moments before; a cold read from disk is slower);
- ``file_read_all``: every rank reads its own 1/world of the file at once (aggregate);
- ``file_write``: rank 0 writes S bytes to a file in the scratch directory (no fsync, as the
  writers measured here do not fsync either).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["measure_limits"]


def _timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, each between barriers."""
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _read_range(path: Path, start: int, length: int, buf: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        done = 0
        while done < length:
            n = f.readinto(buf[done:length])
            if not n:
                break
            done += n


def _collectives(n: int, reps: int) -> dict[str, float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    S, frac = n * 4, (world - 1) / world
    full = torch.ones(n) if rank == 0 else torch.empty(n)
    part = torch.empty(n // world)
    out = torch.empty(n)
    res = {}
    t = _timed(lambda: dist.scatter(part, list(full.chunk(world)) if rank == 0 else None, src=0), reps)
    res["scatter"] = frac * S / t / 1e9
    t = _timed(lambda: dist.broadcast(full, src=0), reps)
    res["broadcast"] = S / t / 1e9
    t = _timed(lambda: dist.gather(part, list(out.chunk(world)) if rank == 0 else None, dst=0), reps)
    res["gather"] = frac * S / t / 1e9
    t = _timed(lambda: dist.all_gather_into_tensor(out, part), reps)
    res["all_gather"] = frac * S / t / 1e9
    return res


def _memcpy(n: int, reps: int) -> float:
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # touch the pages first
    t = _timed(lambda: dst.copy_(src) if dist.get_rank() == 0 else None, reps)
    return n * 4 / t / 1e9


def _file_read(file: Path, reps: int) -> tuple[float, float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    size = file.stat().st_size
    buf = memoryview(bytearray(size if rank == 0 else 1))
    t = _timed(lambda: _read_range(file, 0, size, buf) if rank == 0 else None, reps)
    alone = size / t / 1e9
    per = -(-size // world)
    mine = memoryview(bytearray(per))
    start = rank * per
    t = _timed(lambda: _read_range(file, start, max(0, min(per, size - start)), mine), reps)
    return alone, size / t / 1e9


def _file_write(nbytes: int, scratch: Path, reps: int) -> float:
    rank = dist.get_rank()
    payload = bytes(nbytes) if rank == 0 else b""
    target = scratch / f"write-test-{os.getpid()}.bin"

    def write() -> None:
        if rank == 0:
            with open(target, "wb") as f:
                f.write(payload)

    t = _timed(write, reps)
    if rank == 0:
        target.unlink(missing_ok=True)
    return nbytes / t / 1e9


def measure_limits(nbytes: int, file: Path, scratch: Path, reps: int = 3) -> dict[str, float]:
    """Bandwidths (GB/s) of the operations above for a buffer of ``nbytes``; rank 0's view."""
    world = dist.get_world_size()
    n = (nbytes // 4 // world) * world
    res: dict[str, float] = {"buffer_GB": n * 4 / 1e9}
    res.update(_collectives(n, reps))
    res["memcpy"] = _memcpy(n, reps)
    res["file_read"], res["file_read_all"] = _file_read(file, reps)
    res["file_write"] = _file_write(n * 4, scratch, reps)
    return res

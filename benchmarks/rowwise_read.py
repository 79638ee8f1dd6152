"""Three ways to read a row-wise tensor-parallel shard out of a safetensors file (issue "Fair clocks").

Under FSDP x TP a rank's piece of a row-wise weight (``o_proj``, ``down_proj``: TP ``Shard(1)``,
FSDP ``Shard(0)``) is a block of rows and, of each row, a run of columns: not contiguous in the
file, so it is copied into the rank's local tensor. This compares, on one process and with the
file in the page cache, the time to read those pieces of every row-wise weight of a checkpoint:

- ``mapped``: what :func:`fsdptk.load_safetensors` does: the safetensors slice of the file mapped
  copy-on-write, copied into a fresh contiguous tensor;
- ``preadv``: the file read straight into the final tensor, row by row (``os.preadv`` with one
  buffer per row's run of columns and a scratch buffer for the columns in between);
- ``block``: one ``pread`` of the block of whole rows into a scratch tensor, then a copy of the
  columns.

Each method reads the same pieces (checked equal to ``mapped``); min of ``--repeats`` runs, each
from the same state (``gc.collect()``, every earlier output freed)::

    python -m benchmarks.rowwise_read DIR [--dp 2 --tp 2] [--repeats 5]

DIR is a ``save_pretrained`` directory of a Llama-style model (``python -m benchmarks hf --keep``
writes them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
IOV_MAX = 1024


def rowwise_tensors(directory: Path) -> list[dict[str, Any]]:
    """The row-wise weights of the checkpoint: file, key, shape, dtype, data offset."""
    found = []
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, entry in header.items():
            if key.endswith(("o_proj.weight", "down_proj.weight")) and entry["dtype"] in _DTYPES:
                found.append({"file": str(file), "key": key, "shape": entry["shape"],
                              "dtype": _DTYPES[entry["dtype"]], "offset": 8 + n + entry["data_offsets"][0]})
    return found


def box(shape: list[int], dp: int, tp: int, dp_rank: int, tp_rank: int) -> tuple[slice, slice]:
    """Rows of this FSDP rank, columns of this TP rank (even splits, as in the benchmark's models)."""
    rows, cols = shape[0] // dp, shape[1] // tp
    return slice(dp_rank * rows, (dp_rank + 1) * rows), slice(tp_rank * cols, (tp_rank + 1) * cols)


def mapped(jobs: list[dict[str, Any]], boxes: list[tuple[slice, slice]]) -> list[torch.Tensor]:
    from safetensors import safe_open

    handles: dict[str, Any] = {}
    out = []
    for job, (rows, cols) in zip(jobs, boxes):
        handle = handles.get(job["file"]) or handles.setdefault(job["file"], safe_open(job["file"], framework="pt"))
        piece = handle.get_slice(job["key"])[rows, cols]
        out.append(torch.empty(piece.shape, dtype=piece.dtype).copy_(piece))
    return out


def _with_files(read_one: Callable[[int, dict[str, Any], slice, slice], torch.Tensor]) -> Callable[..., list[torch.Tensor]]:
    """A method that opens each file once and reads every job's piece with ``read_one(fd, job, rows, cols)``."""

    def method(jobs: list[dict[str, Any]], boxes: list[tuple[slice, slice]]) -> list[torch.Tensor]:
        fds: dict[str, int] = {}
        try:
            return [read_one(fds.get(job["file"]) or fds.setdefault(job["file"], os.open(job["file"], os.O_RDONLY)),
                             job, rows, cols) for job, (rows, cols) in zip(jobs, boxes)]
        finally:
            for fd in fds.values():
                os.close(fd)

    return method


def _preadv_one(fd: int, job: dict[str, Any], rows: slice, cols: slice) -> torch.Tensor:
    item = job["dtype"].itemsize
    n_rows, width = rows.stop - rows.start, cols.stop - cols.start
    dest = torch.empty(n_rows, width, dtype=job["dtype"])
    view = memoryview(dest.view(torch.uint8).numpy()).cast("B")
    row_bytes, run = job["shape"][1] * item, width * item
    gap = memoryview(bytearray(row_bytes - run))  # the columns between two rows' runs
    iov: list[memoryview] = []
    for i in range(n_rows):
        iov.append(view[i * run:(i + 1) * run])
        if i + 1 < n_rows:
            iov.append(gap)
    pos = job["offset"] + rows.start * row_bytes + cols.start * item
    for j in range(0, len(iov), IOV_MAX):
        pos += os.preadv(fd, iov[j:j + IOV_MAX], pos)
    return dest


def _block_one(fd: int, job: dict[str, Any], rows: slice, cols: slice) -> torch.Tensor:
    item = job["dtype"].itemsize
    scratch = torch.empty(rows.stop - rows.start, job["shape"][1], dtype=job["dtype"])
    os.preadv(fd, [memoryview(scratch.view(torch.uint8).numpy()).cast("B")],
              job["offset"] + rows.start * job["shape"][1] * item)
    return scratch[:, cols].contiguous()


preadv = _with_files(_preadv_one)
block = _with_files(_block_one)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--dp", type=int, default=2, help="FSDP ranks (rows split)")
    p.add_argument("--tp", type=int, default=2, help="TP ranks (columns split)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    jobs = rowwise_tensors(args.directory)
    if not jobs:
        raise SystemExit(f"no o_proj / down_proj weights in {str(args.directory)!r}")
    boxes = [box(j["shape"], args.dp, args.tp, args.dp - 1, args.tp - 1) for j in jobs]
    for file in {j["file"] for j in jobs}:  # into the page cache, as the warm clock has it
        with open(file, "rb") as fh:
            while fh.read(1 << 24):
                pass
    reference = mapped(jobs, boxes)
    nbytes = sum(t.numel() * t.element_size() for t in reference)
    print(f"{len(jobs)} row-wise weights, {nbytes / 1e9:.3f} GB per rank (dp={args.dp}, tp={args.tp})")
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, fn in (("mapped", mapped), ("preadv", preadv), ("block", block)):
            gc.collect()
            t0 = time.perf_counter()
            got = fn(jobs, boxes)
            seconds = time.perf_counter() - t0
            if not all(torch.equal(a, b) for a, b in zip(got, reference)):
                raise SystemExit(f"{name} read other values than mapped")
            del got
            best[name] = min(best.get(name, float("inf")), seconds)
    for name, seconds in best.items():
        print(f"{name:7s} {seconds:.3f} s  {nbytes / seconds / 1e9:5.2f} GB/s  "
              f"{seconds / best['mapped']:.2f}x mapped")


if __name__ == "__main__":
    main()

"""``python -m benchmarks async-save``: how long a save blocks training, and what it costs the steps.

On an FSDP2 model of ``--size`` GB of fp32 parameters (``Linear(4096, 4096)`` layers, no bias),
gloo, one torch thread per rank, every method in the same processes:

- ``save_safetensors`` (fsdptk, synchronous: gather to rank 0, one HF safetensors directory);
- ``save_safetensors_async`` (fsdptk: the same files, written by a thread after a snapshot), a
  first save (``release_snapshot()`` before it, untimed: the snapshot is newly allocated), then
  ``save_safetensors_async (snapshot reused)``: the next save, right after, copying into the
  snapshot buffers the first one kept (the steady state of periodic saves);
- ``save_dcp_async`` (fsdptk: model state as a DCP directory, in the background), first and
  ``(snapshot reused)`` likewise;
- ``dcp.async_save`` (PyTorch DCP: ``get_model_state_dict`` then ``async_save`` on a gloo group
  of its own, the default thread executor and stager);
- ``dcp.save`` (PyTorch DCP, synchronous).

*blocked*: the call's wall time (what training waits for); *total*: from the call until the
files are complete (``wait()`` / ``future.result()``), with nothing else running. Both are the
maximum over ranks of each rank's time, between barriers; the tables show the minimum and the
median over ``--repeats``. DCP writes one file per rank and does
not gather; fsdptk's safetensors saves gather everything to rank 0 and write one HF checkpoint.

Then the training-step time (forward, backward, SGD step; batch ``--batch`` x 4096): ``--steps``
steps with no save, then steps while a background save runs (until every rank's save is done;
one small all-reduce per step decides), for ``save_safetensors_async`` and ``dcp.async_save``;
``--steps 0`` skips this part.

Example::

    python -m benchmarks async-save --size 1 --worlds 2 4
    python -m benchmarks async-save --size 1 --worlds 2 4 --repeats 3 --steps 0 \
        --methods save_safetensors save_safetensors_async "save_safetensors_async (snapshot reused)"
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

__all__ = ["METHODS", "main"]

WIDTH = 4096
REUSED = " (snapshot reused)"
METHODS = ["save_safetensors", "save_safetensors_async", "save_safetensors_async" + REUSED,
           "save_dcp_async", "save_dcp_async" + REUSED, "dcp.async_save", "dcp.save"]
OVERLAP = ["save_safetensors_async", "dcp.async_save"]


def _model(size_gb: float) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    layers = max(1, round(size_gb * 1e9 / (WIDTH * WIDTH * 4)))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, WIDTH ** -0.5)
    return model


class _Run:
    """One rank's side: the model, its optimizer, the save methods and a training step."""

    def __init__(self, size_gb: float, batch: int, work: Path) -> None:
        self.model = _model(size_gb)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.batch, self.work = batch, work
        self.dcp_group = dist.new_group(backend="gloo")  # DCP's async_save: off the training group
        self.gen = torch.Generator().manual_seed(dist.get_rank())

    def step(self) -> float:
        t0 = time.perf_counter()
        self.model(torch.randn(self.batch, WIDTH, generator=self.gen)).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def start(self, method: str, path: Path) -> Any:
        """Start a save; return what tells when it is complete (None when it already is)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        import fsdptk

        if method == "save_safetensors":
            fsdptk.save_safetensors(self.model, path)
            return None
        if method.startswith("save_safetensors_async"):
            return fsdptk.save_safetensors_async(self.model, path)
        if method.startswith("save_dcp_async"):
            return fsdptk.save_dcp_async(self.model, path)
        sd = {"model": get_model_state_dict(self.model)}
        if method == "dcp.save":
            dcp.save(sd, checkpoint_id=str(path))
            return None
        return dcp.async_save(sd, checkpoint_id=str(path), process_group=self.dcp_group)

    @staticmethod
    def done(handle: Any) -> bool:
        return handle is None or handle.done()

    @staticmethod
    def finish(handle: Any) -> None:
        if handle is None:
            return
        if hasattr(handle, "wait"):
            handle.wait()
        else:
            handle.result()

    def fresh(self, name: str) -> Path:
        path = self.work / name.replace(".", "_")
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        return path


def _warm_up(path: Path) -> None:
    """Once per process, untimed: a tiny save of each kind, so that no timed call pays for a
    one-time set-up (fsdptk's background gloo group is created by the first background save)."""
    import fsdptk

    tiny = nn.Linear(4, 4)
    fsdptk.save_safetensors_async(tiny, path / "st").wait()
    fsdptk.save_dcp_async(tiny, path / "dcp").wait()


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    run = _Run(args.size, args.batch, Path(args.work_dir) / f"w{world}")
    import fsdptk

    out: dict[str, Any] = {"save": {m: [] for m in args.methods}, "steps": {}}
    run.step()  # warm-up: FSDP's lazy init, first-touch of the gradients
    _warm_up(Path(args.work_dir) / f"w{world}" / "warm-up")
    for _ in range(args.repeats):
        for method in args.methods:
            path = run.fresh(method)
            if not method.endswith(REUSED):  # a first save allocates its snapshot
                fsdptk.release_snapshot()
            dist.barrier()
            t0 = time.perf_counter()
            handle = run.start(method, path)
            blocked = time.perf_counter() - t0
            run.finish(handle)
            total = time.perf_counter() - t0
            out["save"][method].append((_max(blocked), _max(total)))
    # training steps with no save, then while a background save runs
    out["steps"]["none"] = [_max(run.step()) for _ in range(args.steps)]
    for method in OVERLAP if args.steps else []:
        path = run.fresh(method)
        t0 = time.perf_counter()
        handle = run.start(method, path)
        blocked = time.perf_counter() - t0
        times = []
        while _max(0.0 if run.done(handle) else 1.0) > 0 and len(times) < 200:
            times.append(_max(run.step()))
        run.finish(handle)
        out["steps"][method] = times
        out["save"].setdefault(f"{method} (while training)", []).append(
            (_max(blocked), _max(time.perf_counter() - t0)))
    if rank == 0:
        q.put(out)
    dist.barrier()
    # no destroy_process_group: gloo is aborted once at exit (as benchmarks/worker.py does)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """All methods at ``world`` ranks: ``{"save": {method: [(blocked, total)]}, "steps": {...}}``."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _port(), args, q), nprocs=world, start_method="spawn")
    return q.get()


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def render(world: int, res: dict[str, Any], args: argparse.Namespace, before: str, after: str) -> str:
    """Markdown tables of one world size."""
    lines = [f"\n### {world} ranks, {args.size:g} GB model ({args.repeats} repeat(s); load average "
             f"before {before}, after {after})\n",
             "| method | blocked s min | blocked s median | total s min | total s median "
             "| min blocked / min sync safetensors total |", "|---|---|---|---|---|---|"]
    sync = res["save"].get("save_safetensors")
    sync_total = min(t for _, t in sync) if sync else float("nan")
    for method, runs in res["save"].items():
        blocked, total = [b for b, _ in runs], [t for _, t in runs]
        lines.append(f"| {method} | {min(blocked):.3f} | {statistics.median(blocked):.3f} | "
                     f"{min(total):.2f} | {statistics.median(total):.2f} | {min(blocked) / sync_total:.3f} |")
    lines += ["", "| training steps | steps | median step s | max step s |", "|---|---|---|---|"]
    for name, times in res["steps"].items():
        label = "no save" if name == "none" else f"while {name} runs"
        if times:
            lines.append(f"| {label} | {len(times)} | {statistics.median(times):.3f} | {max(times):.3f} |")
        else:
            lines.append(f"| {label} | 0 | - | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark at every world size and print the tables."""
    p = argparse.ArgumentParser(prog="python -m benchmarks async-save", description=__doc__.split("\n")[0])
    p.add_argument("--size", type=float, default=1.0, help="model size in GB (1e9 bytes) of fp32 parameters")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="training steps timed with no save (0: no step part)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, metavar="METHOD",
                   help=f"the saves to time, in this order (default: all of {METHODS}); a "
                        f"'{REUSED.strip()}' method runs right after its first save, added if missing")
    p.add_argument("--batch", type=int, default=8, help="rows per training step")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fsdptk-bench-async"))
    args = p.parse_args(argv)
    methods = []
    for m in args.methods:  # a reused-snapshot save needs its first save right before it
        if m.endswith(REUSED) and (not methods or methods[-1] != m.removesuffix(REUSED)):
            methods.append(m.removesuffix(REUSED))
        methods.append(m)
    args.methods = methods
    for world in args.worlds:
        before = _load()
        res = run(world, args)
        print(render(world, res, args, before, _load()), flush=True)
    shutil.rmtree(args.work_dir, ignore_errors=True)
    return 0

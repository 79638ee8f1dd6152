"""``python -m benchmarks quant-save``: an FP8 save of a sharded model beside the unquantized save
of the same model, and beside safetensors' own ``save_file`` writing the same bytes (issue 42).

One model of about ``--size`` GB of parameters in ``--dtype`` (``--model llama``: the benchmarks'
Llama-shaped model of :mod:`benchmarks.model`; ``qwen3-moe``: the transformers Qwen3-MoE of
``python -m benchmarks hf`` (:func:`benchmarks.hf_peer.qwen3_moe_config`, fp32 sizing), whose fused
experts are written as per-expert Hub tensors), built on ``meta`` on every rank, FSDP2 (one unit per
decoder layer, then the root), its shards filled with N(0, 0.02) values (norms 1). Methods, each run
in a fresh process group (:func:`benchmarks.runner.launch_workers`, gloo, one torch thread per rank):

- ``unquantized``: ``fsdptk.save_safetensors(model, dir, conversion="auto", writers=W)``;
- ``fp8``: the same with ``quantize="fp8"`` (e4m3 weights, float32 ``weight_scale_inv`` per
  128 x 128 block, the linear weights of the decoder layers only);
- ``fp8-ue8m0``: the same with ``quantize="fp8-ue8m0"`` (scales rounded up to powers of two);
- ``save_file (unquantized bytes)`` / ``save_file (fp8 bytes)``: the raw limit: rank 0 holds, before
  the clock, every tensor of the file(s) the ``unquantized`` / ``fp8`` method last wrote (read back
  and copied into anonymous memory) and writes them with ``safetensors.torch.save_file`` into one
  ``model.safetensors``, then ``fsync`` s it (fsdptk's commit fsyncs every file it writes); the other
  ranks wait at the barrier. No gather, no quantization, no plan: the file-write limit of those bytes.

Every method's clock starts from the same state: every process first runs every method once on a
tiny model of the same family (untimed; the same imports and first-call costs paid whatever the
method), then the target directory is removed, ``os.sync()`` flushes every dirty page (so no method
pays for the previous one's writeback), ``gc.collect()`` and ``malloc_trim`` run, and a barrier
starts the clock. glibc maps every block of 128 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``),
so freed tensors leave RSS at once.

Measured on every rank: wall time between barriers (the slowest rank's), bytes written to files
(``write_bytes`` of ``/proc/self/io``, :func:`benchmarks.measure.file_bytes_written`: the bytes this
rank dirtied in the page cache; with ``--writers`` above 1 each writer's share), peak RSS above the
RSS at the clock's start (``VmHWM`` reset through ``/proc/self/clear_refs`` just before; RSS from
:func:`benchmarks.measure.current_rss_bytes`), and, on rank 0 after the barrier, the total size of
the ``*.safetensors`` files in the directory. Order: for each world size, writers and repeat, every
method once, so a change in the machine's load hits every method alike; tables show the minimum
time over ``--repeats`` with the spread (min-max), peaks and bytes the maximum over repeats.

Example (a smoke run; then the issue's rows)::

    python -m benchmarks quant-save --size 0.02 --worlds 2 --writers 1 --repeats 1
    python -m benchmarks quant-save --size 1 --worlds 2 4 --writers 1 W --repeats 3 --json qs.json
    python -m benchmarks quant-save --model qwen3-moe --size 1 --worlds 2 4 --writers 1 W --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from .measure import current_rss_bytes, file_bytes_written, reset_peak, status_bytes

__all__ = ["METHODS", "LABELS", "main", "render"]

FSDPTK = {"unquantized": None, "fp8": "fp8", "fp8-ue8m0": "fp8-ue8m0"}
LIMITS = {"save_file_unquantized": "unquantized", "save_file_fp8": "fp8"}  # limit -> the method it re-writes
METHODS = [*FSDPTK, *LIMITS]
LABELS = {"unquantized": "fsdptk unquantized", "fp8": "fsdptk fp8", "fp8-ue8m0": "fsdptk fp8-ue8m0",
          "save_file_unquantized": "save_file (unquantized bytes)", "save_file_fp8": "save_file (fp8 bytes)"}
_MMAP_THRESHOLD = str(128 * 1024)


# ----------------------------------------------------------------------------------------------
# one rank (python -m benchmarks.quant_save SPEC.json, started by benchmarks.runner.launch_workers)
def _build(spec: dict[str, Any], tiny: bool) -> torch.nn.Module:
    """The sharded model of the spec (``tiny``: the warm-up model of the same family)."""
    import fsdptk

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    if spec["model"] == "llama":
        from .model import BenchConfig, build_model, config_for_size

        cfg = BenchConfig(256, 128, 256, 1, 2, 1, spec["dtype"]) if tiny else config_for_size(spec["size"], spec["dtype"])
        model = build_model(cfg, "meta")
    else:
        import transformers

        from fsdptk.hf import hf_meta_model

        from .hf_peer import qwen3_moe_config

        kw = qwen3_moe_config(spec["size"])
        if tiny:
            kw.update(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4)
        model = hf_meta_model(transformers.Qwen3MoeConfig(**kw)).to(dtype)
    fsdptk.shard_model(model, [fsdptk.get_shard_conditions], cpu_offload=False)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1234 + int(os.environ["RANK"]))
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.dim() <= 1:
                local.fill_(1.0)
            else:
                local.copy_(torch.empty(local.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))
    return model


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``directory``, in anonymous memory."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update({k: v.clone() for k, v in load_file(f).items()})
    return out


def _save_file(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "model.safetensors"
    save_file(tensors, str(target), metadata={"format": "pt"})
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _run_method(method: str, model: torch.nn.Module, out: Path, writers: int, held: dict | None) -> None:
    import torch.distributed as dist

    import fsdptk

    if method in FSDPTK:
        fsdptk.save_safetensors(model, out, conversion="auto", writers=writers, quantize=FSDPTK[method],
                                progress=False)
    elif dist.get_rank() == 0:
        _save_file(held or {}, out)


def _settle(out: Path) -> None:
    """The same state before every clock: no target, no dirty pages, no garbage, trimmed heap."""
    import ctypes

    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    dist.barrier()


def _file_summary(directory: Path) -> dict[str, Any]:
    """Bytes of the safetensors files, and their tensors by dtype (header only)."""
    import struct

    files = sorted(directory.glob("*.safetensors"))
    dtypes: dict[str, int] = {}
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for k, v in header.items():
            if k != "__metadata__":
                dtypes[v["dtype"]] = dtypes.get(v["dtype"], 0) + 1
    return {"file_bytes": sum(f.stat().st_size for f in files), "files": len(files), "dtypes": dtypes}


def _measured(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    rank, method, writers = dist.get_rank(), spec["method"], spec["writers"]
    work = Path(spec["work_dir"])
    tiny = _build(spec, tiny=True)  # warm-up: every method once, so every clock starts alike
    for m in FSDPTK:
        _run_method(m, tiny, work / "warm-up" / m, writers, None)
    held = _read_all(work / "warm-up" / "fp8") if rank == 0 else None
    _run_method("save_file_fp8", tiny, work / "warm-up" / "save_file", writers, held)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(work / "warm-up", ignore_errors=True)
    del tiny, held
    model = _build(spec, tiny=False)
    held = None
    if method in LIMITS and rank == 0:
        source = Path(spec["outputs"][LIMITS[method]])
        if not any(source.glob("*.safetensors")):
            raise FileNotFoundError(f"{method} re-writes what {LIMITS[method]!r} wrote, but {source} holds no file")
        held = _read_all(source)
    out = Path(spec["outputs"][method])
    _settle(out)
    if spec.get("record_modules"):
        modules = sorted(sys.modules)
    reset_peak()
    rss0, wb0 = current_rss_bytes(), file_bytes_written()
    t0 = time.perf_counter()
    _run_method(method, model, out, writers, held)
    own = time.perf_counter() - t0
    wb1, peak = file_bytes_written(), status_bytes("VmHWM")
    dist.barrier()
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    rec: dict[str, Any] = {"rank": rank, "seconds": float(wall), "own_seconds": own, "rss0": rss0,
                           "peak_above": peak - rss0, "write_bytes": wb1 - wb0 if wb0 >= 0 else None,
                           "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    if rank == 0:
        rec.update(_file_summary(out))
    if spec.get("record_modules"):
        rec["preclock_modules"] = modules
    return rec


def worker_main(spec_path: str) -> int:
    """One rank: join the group the runner describes, measure, write ``rank<r>.json``."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    code = 0
    try:
        dist.init_process_group("gloo")
        result.update(_measured(spec))
    except BaseException as e:  # noqa: BLE001 - reported to the runner, which kills the group
        result["error"] = f"{type(e).__name__}: {e}".strip()[:2000]
        traceback.print_exc()
        code = 1
    (Path(spec["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        dist.barrier()
    os._exit(code)  # as benchmarks/worker.py: no gloo teardown, nothing after the results matters


# ----------------------------------------------------------------------------------------------
# the driver
def _launch(spec: dict[str, Any], world: int, out: Path, timeout: float) -> Any:
    from .runner import launch_workers

    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = _MMAP_THRESHOLD  # read by the workers' malloc at start
    try:
        return launch_workers(spec, world, sys.executable, out, timeout, module="benchmarks.quant_save")
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def _writers(value: str, world: int) -> int:
    return world if value == "W" else int(value)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (world, writers, repeat, method) in fresh processes; the records."""
    work = Path(args.work_dir)
    cells: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for world in args.worlds:
        for writers in dict.fromkeys(_writers(w, world) for w in args.writers):
            key = f"w{world}-W{writers}"
            outputs = {m: str(work / key / m.replace(" ", "_")) for m in METHODS}
            cell: dict[str, Any] = {"world": world, "writers": writers, "runs": {m: [] for m in args.methods}}
            for rep in range(args.repeats):
                for method in args.methods:
                    spec = {"model": args.model, "size": args.size, "dtype": args.dtype, "method": method,
                            "writers": writers, "work_dir": str(work / key), "outputs": outputs}
                    res = _launch(spec, world, work / "runs" / key / f"{method}-r{rep}", args.timeout)
                    rec = {"status": res.status, "error": res.error, "ranks": res.ranks}
                    cell["runs"][method].append(rec)
                    what = f"{res.ranks[0]['seconds']:.3f} s" if res.status == "ok" else f"{res.status}: {res.error}"
                    print(f"[quant-save +{time.perf_counter() - t_start:5.0f}s] {world} ranks, writers {writers}, "
                          f"r{rep} {LABELS[method]:<30} {what}", flush=True)
            cells.append(cell)
    return {"cells": cells, "seconds": time.perf_counter() - t_start}


def _ok(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r["status"] == "ok"]


def _per_rank(runs: list[dict[str, Any]], field: str) -> list[float]:
    """``field`` of each rank, the maximum over the runs."""
    world = len(runs[0]["ranks"])
    return [max(r["ranks"][i][field] or 0 for r in runs) for i in range(world)]


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    good = _ok(runs)
    if not good:
        return None
    times = [r["ranks"][0]["seconds"] for r in good]
    return {"min": min(times), "max": max(times), "median": statistics.median(times),
            "write_bytes": _per_rank(good, "write_bytes"), "peak_above": _per_rank(good, "peak_above"),
            "file_bytes": good[-1]["ranks"][0]["file_bytes"], "dtypes": good[-1]["ranks"][0]["dtypes"],
            "model_bytes": good[-1]["ranks"][0]["model_bytes"]}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _mib(values: list[float]) -> str:
    return " / ".join(f"{v / 2**20:.1f}" for v in values)


def render(results: dict[str, Any]) -> str:
    """Markdown: one table per (world size, writers)."""
    lines = []
    for cell in results["cells"]:
        sums = {m: _summary(runs) for m, runs in cell["runs"].items()}
        model_bytes = next((s["model_bytes"] for s in sums.values() if s), 0)
        lines += ["", f"### {results['model']} {model_bytes / 1e9:.3f} GB {results['dtype']}, {cell['world']} ranks, "
                      f"writers {cell['writers']}, min of {results['repeats']}", "",
                  "| method | time s (min) | spread s | / unquantized | / save_file same bytes | files MB | "
                  "/ unquantized | written to files MiB per rank | peak RSS above start MiB per rank | "
                  "peak max / unquantized |", "|---|---|---|---|---|---|---|---|---|---|"]
        base = sums.get("unquantized")
        for m, s in sums.items():
            if s is None:
                errs = [r["error"] for r in cell["runs"][m] if r["error"]]
                lines.append(f"| {LABELS[m]} | {cell['runs'][m][0]['status']}: {(errs or ['?'])[0][:200]} "
                             "| | | | | | | | |")
                continue
            limit = sums.get("save_file_fp8" if m.startswith("fp8") else "save_file_unquantized") \
                if m in FSDPTK else None
            lines.append(
                f"| {LABELS[m]} | {s['min']:.3f} | {s['min']:.3f}-{s['max']:.3f} "
                f"| {_ratio(s['min'], base['min']) if base else '-'} | {_ratio(s['min'], limit['min']) if limit else '-'} "
                f"| {s['file_bytes'] / 1e6:.1f} | {_ratio(s['file_bytes'], base['file_bytes']) if base else '-'} "
                f"| {_mib(s['write_bytes'])} | {_mib(s['peak_above'])} "
                f"| {_ratio(max(s['peak_above']), max(base['peak_above'])) if base else '-'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks quant-save", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=["llama", "qwen3-moe"], default="llama",
                   help="llama: benchmarks/model.py; qwen3-moe: the hf mode's Qwen3-MoE, sized in fp32 "
                        "(2 layers at least: ~0.48 GB fp32, 0.24 GB bfloat16)")
    p.add_argument("--size", type=float, default=1.0, help="model size in GB (1e9 bytes) of parameters")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--writers", nargs="+", default=["1", "W"],
                   help="writers of each save: an int, or W (the world size)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS,
                   help="the limits re-write what their fsdptk method wrote: keep that method before them")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fsdptk-bench-quant-save"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (the saved checkpoints)")
    args = p.parse_args(argv)
    bad = [w for w in args.writers if w != "W" and not (w.isdigit() and int(w) >= 1)]
    if bad:
        p.error(f"--writers takes positive ints or W, got {bad}")
    for limit, source in LIMITS.items():
        if limit in args.methods and source not in args.methods[:args.methods.index(limit)]:
            p.error(f"{limit} re-writes the files of {source!r}: list {source!r} before it in --methods")
    too_many = [(w, x) for w in args.worlds for x in args.writers if x != "W" and int(x) > w]
    if too_many:
        p.error(f"writers above the world size: {too_many}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    res = run(args)
    results = {"model": args.model, "size_gb": args.size, "dtype": args.dtype, "repeats": args.repeats,
               "command": "python -m benchmarks quant-save " + " ".join(argv if argv is not None else sys.argv[2:]),
               **res, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                  "torch": torch.__version__, "platform": platform.platform()},
               "load_average": {"before": load_before, "after": os.getloadavg()}}
    print(render(results), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.keep:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    failed = sum(r["status"] != "ok" for c in res["cells"] for runs in c["runs"].values() for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))

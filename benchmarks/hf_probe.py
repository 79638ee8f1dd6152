"""``python -m benchmarks hf-probe``: the dense load (and save) beside transformers, timed as a user's loop sees it.

Issue 44's harness as a benchmark mode of its own. Each run of a method is a fresh gloo world of
plain processes (one torch thread each, ``OMP_NUM_THREADS=1``), every rank importing the same
modules before the clock, for both methods (:data:`ISSUE_IMPORTS`: torch, transformers' entry
points, ``fsdptk.hf``, ``fsdptk.sharding``, ``fsdptk.checkpoint``, ``fsdptk.tp``), glibc's default
malloc, then on every rank::

    dist.barrier(); t0 = clock(); model = <the call>; dist.barrier(); t1 = clock()

with the call one of

- ``transformers``: ``AutoModelForCausalLM.from_pretrained(path, distributed_config=
  DistributedConfig(fsdp_size=F, tp_size=T), dtype=torch.float32)``;
- ``fsdptk``: ``fsdptk.hf.from_pretrained(path, dims=ParallelDims(dp_shard=F, tp=T),
  dtype=torch.float32)``.

The run's load time is the slowest rank's ``t1 - t0``; ``--save`` times ``model.save_pretrained(dir)``
against ``fsdptk.save_safetensors(model, dir)`` the same way. Anonymous memory at the load's peak:
the driver reads every rank's ``RssAnon`` (``/proc/<pid>/status``, :func:`benchmarks.measure.
proc_status_bytes`) every ``--sample-ms`` from outside the ranks, and keeps the largest sample
inside the rank's load window (the ranks report ``t0`` / ``t1`` on the same monotonic clock).

The model: a transformers Llama written by ``save_pretrained`` when the run starts (so it is in the
page cache, as it is for a user who just wrote it): by default the issue's, hidden 2048, 10
layers, MLP 5632, 32 heads / 4 KV heads, vocab 32000, fp32 (2.29 GB); ``--hidden`` / ``--layers``
/ ... change it; ``--size S`` takes the shape ``python -m benchmarks hf`` uses for S GB instead
(width 1024, vocab 16384, layers fill the size: 42 layers at 2 GB).

The factors that separate this harness from ``python -m benchmarks hf``'s warm clock, each
switchable on its own (defaults: the issue's harness):

- ``--malloc default|mmap65536``: glibc's default, or ``MALLOC_MMAP_THRESHOLD_=65536`` (hf's);
- ``--gc none|collect``: ``gc.collect()`` before the clock (hf's) or not;
- ``--order alternate|transformers-first|fsdptk-first``: the methods' order within a repeat;
- ``--imports issue|union``: the issue's list, or hf's union (:data:`benchmarks.hf_worker.UNION_MODULES`
  and the model's modeling module);
- ``--clock barrier|rank``: the second barrier inside the clock (issue) or each rank's own call
  time, the barrier after the clock (hf's ``_phase``);
- ``--page-cache written|read``: the checkpoint written at the start only, or also read whole
  before every run (hf's);
- ``--threads 1|default``: one torch thread per rank, or torch's default.

Examples::

    python -m benchmarks hf-probe --hidden 256 --layers 2 --vocab 1024 --worlds 2 --repeats 1   # smoke
    python -m benchmarks hf-probe --worlds 2 4 --meshes fsdp fsdp-tp2 --repeats 3 --save \\
        --json benchmarks/results/hf_probe_issue.json
    python -m benchmarks hf-probe --worlds 2 --repeats 3 --malloc mmap65536   # one factor switched
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hf_worker import USER_IMPORTS, import_names

__all__ = ["FLOOR", "FLOOR_FSDPTK", "ISSUE_IMPORTS", "ISSUE_SHAPE", "METHODS", "CellStats", "spread", "pair_ratios", "summarize",
           "render", "parse_args", "main", "shape_of", "param_bytes", "import_self_seconds"]

METHODS = ("transformers", "fsdptk")
# --floor: the cost both calls share on first use in a fresh process, timed alone the same way:
# importing transformers' modeling code for the model (what either call imports inside its clock)
FLOOR = "imports-floor"
# the same imports with the collector as fsdptk.hf.from_pretrained runs it (inside its _gc_quiet; results
# files before that change have "imports-floor-nogc": the collector paused, the library's behaviour then)
FLOOR_FSDPTK = "imports-floor-fsdptk"
FLOORS = (FLOOR, FLOOR_FSDPTK)
# what a results file may hold (rendering older files too)
_REPORTED_FLOORS = (*FLOORS, "imports-floor-nogc")
# The issue's model: hidden 2048 x 10 layers, a TinyLlama-like Llama (GQA 32 / 4 heads), 2.29 GB fp32
ISSUE_SHAPE: dict[str, int] = {"hidden_size": 2048, "num_hidden_layers": 10, "intermediate_size": 5632,
                               "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000}
# what both methods import before the clock (the issue's harness): the names a user's script
# imports at its top for either call, and fsdptk's modules the issue lists
ISSUE_IMPORTS = USER_IMPORTS
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX",
               "MALLOC_MMAP_MAX_")


# ----------------------------------------------------------------------------------------------
# pure parts: shapes, statistics
def param_bytes(shape: dict[str, int]) -> int:
    """fp32 bytes of an untied Llama of ``shape`` (``LlamaConfig`` keys).

    Example:
        >>> round(param_bytes(ISSUE_SHAPE) / 1e9, 2)
        2.29
    """
    h, i, v, n = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    per_layer = 2 * h * h + 2 * kv * h + 3 * h * i + 2 * h
    return 4 * (2 * v * h + n * per_layer + h)


def shape_of(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LlamaConfig`` arguments of the run: ``--size`` (hf's shape) or the issue's shape with
    the ``--hidden`` / ``--layers`` / ... overrides.

    Example:
        >>> shape_of(parse_args(["--layers", "2"]))["num_hidden_layers"]
        2
    """
    if args.size is not None:
        from .hf_peer import llama_config

        return llama_config(args.size)
    shape: dict[str, Any] = dict(ISSUE_SHAPE)
    for key, value in (("hidden_size", args.hidden), ("num_hidden_layers", args.layers),
                       ("intermediate_size", args.intermediate), ("num_attention_heads", args.heads),
                       ("num_key_value_heads", args.kv_heads), ("vocab_size", args.vocab)):
        if value is not None:
            shape[key] = value
    shape.update(max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)
    return shape


@dataclass(frozen=True)
class CellStats:
    """Median and range of single runs' values."""

    median: float
    low: float
    high: float
    runs: int

    def text(self, fmt: str = "{:.2f}", unit: str = "") -> str:
        """``median (low-high)``, e.g. ``0.82x (0.62-1.10x)``."""
        if self.runs == 1:
            return fmt.format(self.median) + unit
        return f"{fmt.format(self.median)}{unit} ({fmt.format(self.low)}-{fmt.format(self.high)}{unit})"


def spread(values: list[float | None]) -> CellStats | None:
    """Median, min and max of the values that are not ``None`` (``None`` when there are none).

    Example:
        >>> spread([0.9, None, 0.7, 1.1])
        CellStats(median=0.9, low=0.7, high=1.1, runs=3)
    """
    xs = [float(x) for x in values if x is not None]
    if not xs:
        return None
    return CellStats(statistics.median(xs), min(xs), max(xs), len(xs))


def pair_ratios(ours: dict[int, float | None], theirs: dict[int, float | None]) -> list[float]:
    """Per-run ratios ``ours[r] / theirs[r]`` of the repeats both have (a run of each method per
    repeat, run back to back), in repeat order.

    Example:
        >>> pair_ratios({0: 1.0, 1: 2.0, 2: 3.0}, {0: 2.0, 1: 2.0})
        [0.5, 1.0]
    """
    return [ours[r] / theirs[r] for r in sorted(ours)  # type: ignore[operator]
            if r in theirs and ours[r] is not None and theirs[r]]


_FIELDS = ("load_s", "save_s", "peak_anon", "anon_after", "load_wo_imports_s")


def import_self_seconds(log: str, modules: set[str]) -> float:
    """Seconds of ``python -X importtime`` self time (its ``import time:`` lines in ``log``) spent
    importing ``modules``.

    Example:
        >>> log = ("import time: self [us] | cumulative | imported package\\n"
        ...        "import time:      1500 |       2500 |   a.b\\n"
        ...        "import time:      1000 |       1000 | a\\n")
        >>> import_self_seconds(log, {"a.b"})
        0.0015
    """
    total = 0
    for line in log.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        self_us, _, name = (part.strip() for part in line[len("import time:"):].split("|"))
        if name in modules and self_us.isdigit():
            total += int(self_us)
    return total / 1e6


def run_values(rec: dict[str, Any]) -> dict[str, float | None]:
    """One ok run's figures: load and save time (slowest rank), anonymous memory at the load's peak
    and after the load (largest rank).

    Example:
        >>> run_values({"status": "ok", "ranks": [{"load_s": 1.0, "peak_anon": 5, "anon_after": 4},
        ...                                       {"load_s": 1.5, "peak_anon": 3, "anon_after": 3}]})
        {'load_s': 1.5, 'save_s': None, 'peak_anon': 5.0, 'anon_after': 4.0, 'load_wo_imports_s': None}
    """
    ranks = rec["ranks"]
    out: dict[str, float | None] = {}
    for field in _FIELDS:
        xs = [r.get(field) for r in ranks]
        out[field] = float(max(xs)) if xs and all(x is not None for x in xs) else None
    return out


def summarize(records: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """(mesh, world) -> per method the spread of each field over its ok runs, and per field the
    spread of the per-run ratios fsdptk / transformers (runs paired by repeat) and the ratio of
    the medians.

    Example:
        >>> recs = [{"mesh": "fsdp", "world": 2, "repeat": r, "method": m, "status": "ok",
        ...          "ranks": [{"load_s": t}]} for r, (a, b) in enumerate([(2.0, 1.0), (2.0, 1.6)])
        ...         for m, t in (("transformers", a), ("fsdptk", b))]
        >>> cell = summarize(recs)[("fsdp", 2)]
        >>> cell["ratio"]["load_s"], cell["ratio_of_medians"]["load_s"]
        (CellStats(median=0.65, low=0.5, high=0.8, runs=2), 0.65)
    """
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    for rec in records:
        key = (rec["mesh"], rec["world"])
        cell = cells.setdefault(key, {"values": {m: {} for m in (*METHODS, *_REPORTED_FLOORS)}, "failed": []})
        if rec["status"] != "ok":
            cell["failed"].append(f"{rec['method']} r{rec['repeat']}: {rec['status']}: {rec.get('error')}")
            continue
        cell["values"][rec["method"]][rec["repeat"]] = run_values(rec)
    for cell in cells.values():
        vals = cell["values"]
        cell["stats"] = {m: {f: spread([v[f] for v in vals[m].values()]) for f in _FIELDS}
                         for m in (*METHODS, *_REPORTED_FLOORS)}
        cell["ratio"], cell["ratio_of_medians"] = {}, {}
        for f in _FIELDS:
            ours = {r: v[f] for r, v in vals["fsdptk"].items()}
            theirs = {r: v[f] for r, v in vals["transformers"].items()}
            cell["ratio"][f] = spread(list(pair_ratios(ours, theirs)))
            a, b = cell["stats"]["fsdptk"][f], cell["stats"]["transformers"][f]
            cell["ratio_of_medians"][f] = a.median / b.median if a and b and b.median else None
    return cells


def render(results: dict[str, Any]) -> str:
    """The probe's tables (markdown): per run, then per cell the median and range of single runs."""
    records = results["records"]
    lines = ["**Single runs** (s; slowest rank; GB: largest rank's `RssAnon` at the load's peak / after it):\n",
             "| mesh | ranks | repeat | method | load | save | anon at load's peak | anon after load | "
             "ratio load | ratio save | ratio anon peak |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["mesh"], r["world"], r["repeat"], r["method"]): r for r in records}
    for rec in records:
        if rec["status"] != "ok":
            lines.append(f"| {rec['mesh']} | {rec['world']} | {rec['repeat']} | {rec['method']} | "
                         f"{rec['status']}: {(rec.get('error') or '')[:120]} | | | | | | |")
            continue
        v = run_values(rec)
        ratio = ["", "", ""]
        other = by.get((rec["mesh"], rec["world"], rec["repeat"], "transformers"))
        if rec["method"] == "fsdptk" and other and other["status"] == "ok":
            o = run_values(other)
            ratio = [f"{v[f] / o[f]:.2f}x" if v[f] is not None and o[f] else "-"  # type: ignore[operator]
                     for f in ("load_s", "save_s", "peak_anon")]
        lines.append(f"| {rec['mesh']} | {rec['world']} | {rec['repeat']} | {rec['method']} | {_s(v['load_s'])} | "
                     f"{_s(v['save_s'])} | {_gb(v['peak_anon'])} | {_gb(v['anon_after'])} | " + " | ".join(ratio) + " |")
    lines += ["", "**Per cell**: median (min-max) of single runs; ratio: fsdptk / transformers per run (runs "
              "paired by repeat), median (min-max), and [the ratio of the medians]:\n",
              "| mesh | ranks | method | load s | save s | anon at load's peak GB | runs | load less its first-use "
              "imports s (--importtime) |", "|---|---|---|---|---|---|---|---|"]
    for (mesh, world), cell in sorted(summarize(records).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for m in (*METHODS, *_REPORTED_FLOORS):
            st = cell["stats"][m]
            if m in _REPORTED_FLOORS and st["load_s"] is None:
                continue
            lines.append(f"| {mesh} | {world} | {m} | {_st(st['load_s'])} | {_st(st['save_s'])} | "
                         f"{_st(st['peak_anon'], scale=1e9)} | {st['load_s'].runs if st['load_s'] else 0} | "
                         f"{_st(st['load_wo_imports_s'])} |")
        rs, rm = cell["ratio"], cell["ratio_of_medians"]
        lines.append(f"| {mesh} | {world} | **ratio** | {_rt(rs['load_s'], rm['load_s'])} | "
                     f"{_rt(rs['save_s'], rm['save_s'])} | {_rt(rs['peak_anon'], rm['peak_anon'])} | "
                     f"{rs['load_s'].runs if rs['load_s'] else 0} | "
                     f"{_rt(rs['load_wo_imports_s'], rm['load_wo_imports_s'])} |")
        for failed in cell["failed"]:
            lines.append(f"| {mesh} | {world} | failed | {failed[:160]} | | | | |")
    return "\n".join(lines) + "\n"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _st(st: CellStats | None, scale: float = 1.0) -> str:
    if st is None:
        return "-"
    return CellStats(st.median / scale, st.low / scale, st.high / scale, st.runs).text("{:.3f}" if scale == 1 else "{:.2f}")


def _rt(st: CellStats | None, of_medians: float | None) -> str:
    if st is None:
        return "-"
    return st.text("{:.2f}", "x") + (f" [{of_medians:.2f}x]" if of_medians is not None else "")


# ----------------------------------------------------------------------------------------------
# the driver
def _mesh_dims(mesh: str, world: int) -> tuple[int, int] | str:
    if mesh == "fsdp":
        return world, 1
    if world < 4 or world % 2:
        return f"FSDP x TP with tp = 2 needs an even world of at least 4 ranks, not {world}"
    return world // 2, 2


def _prepare(shape: dict[str, Any], work: Path, timeout: float, rewrite: bool) -> tuple[Path, bool]:
    """The checkpoint, written with ``save_pretrained`` (single process, seed 0) unless the work
    directory holds one of the same shape (and not ``rewrite``); whether it was written now."""
    ckpt = work / ("ckpt-" + "-".join(str(shape[k]) for k in ISSUE_SHAPE))
    meta = ckpt / "probe_shape.json"
    if not rewrite and meta.is_file() and json.loads(meta.read_text()) == shape:
        return ckpt, False
    shutil.rmtree(ckpt, ignore_errors=True)
    print(f"[probe] writing the {param_bytes(shape) / 1e9:.2f} GB Llama {ckpt} ({shape})", flush=True)
    code = ("import json, sys, torch, transformers\n"
            "torch.manual_seed(0)\n"
            "cfg = transformers.LlamaConfig(**json.loads(sys.argv[1]))\n"
            "transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", code, json.dumps(shape), str(ckpt)], check=True, timeout=timeout,
                   env=dict(os.environ, OMP_NUM_THREADS="2"))
    meta.write_text(json.dumps(shape))
    return ckpt, True


def _child_env(args: argparse.Namespace, world: int, rank: int, port: int) -> dict[str, str]:
    from .runner import REPO

    env = {k: v for k, v in os.environ.items() if k not in _MALLOC_ENV}
    if args.malloc == "mmap65536":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if args.threads == "1":
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    else:
        env.pop("OMP_NUM_THREADS", None)
        env.pop("MKL_NUM_THREADS", None)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return env


class _Sampler:
    """Reads every rank's ``RssAnon`` from outside every ``period`` seconds: (monotonic time, bytes)."""

    def __init__(self, pids: list[int], period: float) -> None:
        self.samples: list[list[tuple[float, int]]] = [[] for _ in pids]
        self._pids, self._period, self._stop = pids, period, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        if period > 0:
            self._thread.start()

    def _loop(self) -> None:
        from .measure import proc_status_bytes

        while not self._stop.is_set():
            for i, pid in enumerate(self._pids):
                value = proc_status_bytes(pid, "RssAnon")
                if value >= 0:
                    self.samples[i].append((time.monotonic(), value))
            self._stop.wait(self._period)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, rank: int, t0: float, t1: float) -> int | None:
        inside = [v for t, v in self.samples[rank] if t0 <= t <= t1]
        return max(inside) if inside else None


def _launch(spec: dict[str, Any], world: int, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    from .runner import REPO, free_port

    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(dict(spec, out_dir=str(out))))
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        logs.append(open(out / f"rank{rank}.log", "w"))  # noqa: SIM115 - closed below
        procs.append(subprocess.Popen([sys.executable, *(["-X", "importtime"] if args.importtime else []), "-m",
                                       "benchmarks.hf_probe", "--worker", str(spec_path)],
                                      cwd=REPO, env=_child_env(args, world, rank, port), stdout=logs[-1],
                                      stderr=subprocess.STDOUT, start_new_session=True))
    sampler = _Sampler([p.pid for p in procs], args.sample_ms / 1e3)
    start, status = time.monotonic(), "ok"
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() - start > args.timeout:
                status = "timeout"
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)  # its peers may be blocked in a collective
                status = "error"
                break
            time.sleep(0.05)
    finally:
        sampler.stop()
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        for log in logs:
            log.close()
    ranks, errors = [], []
    for rank in range(world):
        f = out / f"rank{rank}.json"
        r: dict[str, Any] = json.loads(f.read_text()) if f.is_file() else {"rank": rank, "error": "no result"}
        if r.get("error"):
            errors.append(f"rank {rank}: {r['error']}")
        elif args.sample_ms > 0:
            r["peak_anon"] = sampler.peak(rank, r["load_t0"], r["load_t1"])
            r["anon_samples_in_load"] = sum(r["load_t0"] <= t <= r["load_t1"] for t, _ in sampler.samples[rank])
        if args.importtime and not r.get("error"):  # the first-use imports inside this rank's load clock
            r["imports_in_load_s"] = import_self_seconds((out / f"rank{rank}.log").read_text(errors="replace"),
                                                         set(r["imported_in_load"]))
            r["load_wo_imports_s"] = r["load_s"] - r["imports_in_load_s"]
        ranks.append(r)
    if errors:
        status = "error"
    if status != "ok" and not errors:
        tail = (out / "rank0.log").read_text(errors="replace")[-400:] if (out / "rank0.log").is_file() else ""
        errors.append(tail.strip().splitlines()[-1] if tail.strip() else status)
    return {"status": status, "error": "; ".join(errors[:2]) or None, "ranks": ranks}


def _read_files(directory: Path) -> None:
    for f in sorted(directory.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def _order(args: argparse.Namespace, repeat: int) -> list[str]:
    if args.order == "transformers-first":
        order = list(METHODS)
    elif args.order == "fsdptk-first":
        order = list(METHODS[::-1])
    else:
        order = list(METHODS) if repeat % 2 == 0 else list(METHODS[::-1])
    return order + (list(FLOORS) if args.floor else [])


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    shape = shape_of(args)
    load_before = os.getloadavg()
    t_start = time.monotonic()
    ckpt, written = _prepare(shape, work, args.timeout, args.rewrite)
    records: list[dict[str, Any]] = []
    from .hf_peer import _git_commit, _versions

    versions, commit = _versions(), _git_commit()
    factors = {k: getattr(args, k) for k in ("malloc", "gc", "order", "imports", "clock", "page_cache", "threads",
                                             "sample_ms", "fsdptk_gc", "writers", "max_shard_size", "save_clock")}

    def meta(partial: bool) -> dict[str, Any]:
        return {"command": "python -m benchmarks hf-probe " + " ".join(args.argv),
                "date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": commit, "cpus": os.cpu_count(),
                "python": sys.version.split()[0], "versions": versions, "shape": shape,
                "model_bytes": param_bytes(shape), "factors": factors, "checkpoint_written_by_this_run": written,
                "loadavg_before": list(load_before), "loadavg_end": list(os.getloadavg()),
                "seconds": time.monotonic() - t_start, "partial": partial}

    for world in args.worlds:
        for mesh in args.meshes:
            dims = _mesh_dims(mesh, world)
            if isinstance(dims, str):
                print(f"[probe] {mesh} at {world} ranks: {dims}", flush=True)
                continue
            for rep in range(args.repeats):
                for method in _order(args, rep):
                    if args.page_cache == "read":
                        _read_files(ckpt)
                    spec = {"method": method, "ckpt": str(ckpt), "dp_shard": dims[0], "tp": dims[1],
                            "save": args.save, "gc": args.gc, "imports": args.imports, "clock": args.clock,
                            "fsdptk_gc": args.fsdptk_gc, "writers": args.writers,
                            "max_shard_size": args.max_shard_size, "save_clock": args.save_clock,
                            "threads": args.threads}
                    out = work / "runs" / f"{mesh}-w{world}-r{rep}-{method}"
                    shutil.rmtree(out, ignore_errors=True)
                    res = _launch(spec, world, out, args)
                    rec = {"method": method, "mesh": mesh, "world": world, "repeat": rep, **res}
                    records.append(rec)
                    _progress(rec)
                    shutil.rmtree(out / "saved", ignore_errors=True)
                    if args.json:  # what has run so far survives an interrupted run
                        _write(args.json, {"records": records, "meta": meta(partial=True)})
    if not args.keep:
        shutil.rmtree(work / "runs", ignore_errors=True)
    return {"records": records, "meta": meta(partial=False)}


def _progress(rec: dict[str, Any]) -> None:
    if rec["status"] == "ok":
        v = run_values(rec)
        what = (f"load {v['load_s']:.3f} s" + (f"  save {v['save_s']:.3f} s" if v["save_s"] is not None else "")
                + (f"  anon peak {v['peak_anon'] / 1e9:.2f} GB" if v["peak_anon"] is not None else "")
                + f"  anon after {v['anon_after'] / 1e9:.2f} GB")  # type: ignore[operator]
    else:
        what = f"{rec['status']}: {(rec.get('error') or '')[:300]}"
    print(f"[probe] {rec['mesh']:<8} W={rec['world']} r{rec['repeat']} {rec['method']:<12} {what}  "
          f"(loadavg {os.getloadavg()[0]:.2f})", flush=True)


# ----------------------------------------------------------------------------------------------
# one rank
def _worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(spec["out_dir"])
    try:
        rec = _rank(spec, rank, world)
    except Exception as e:  # noqa: BLE001 - reported to the driver
        import traceback

        traceback.print_exc()
        (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "error": f"{type(e).__name__}: {e}"[:2000]}))
        sys.stdout.flush()
        os._exit(1)
    (out / f"rank{rank}.json").write_text(json.dumps(rec))
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: gloo's teardown can abort at exit


def _rank(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    import torch

    if spec["threads"] == "1":
        torch.set_num_threads(1)
    import_names(ISSUE_IMPORTS)
    if spec["imports"] == "union":
        from .hf_worker import preclock_imports

        preclock_imports({"imports": "union", "method": spec["method"], "arch": "llama"})
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    import fsdptk
    import fsdptk.hf

    from .measure import status_bytes

    path, f, t = spec["ckpt"], spec["dp_shard"], spec["tp"]
    if spec.get("fsdptk_gc", "library") != "library":
        _swap_gc_quiet(spec["fsdptk_gc"])
    if spec["method"] in FLOORS:
        def load() -> Any:
            import contextlib

            from fsdptk.hf.pretrained import _gc_quiet

            with _gc_quiet() if spec["method"] == FLOOR_FSDPTK else contextlib.nullcontext():
                import transformers.models.llama.modeling_llama  # noqa: F401

        def save(model: Any, where: str) -> None:
            pass
    elif spec["method"] == "transformers":
        def load() -> Any:
            return transformers.AutoModelForCausalLM.from_pretrained(
                path, distributed_config=DistributedConfig(fsdp_size=f, tp_size=t), dtype=torch.float32)

        def save(model: Any, where: str) -> None:
            model.save_pretrained(where)
            if spec.get("save_clock") == "durable" and rank == 0:  # its files on disk, as fsdptk's commit does
                from .hf_worker import _fsync_tree

                _fsync_tree(Path(where))
    else:
        def load() -> Any:
            return fsdptk.hf.from_pretrained(path, dims=fsdptk.ParallelDims(dp_shard=f, tp=t), dtype=torch.float32)

        def save(model: Any, where: str) -> None:
            fsdptk.save_safetensors(model, where, writers=spec.get("writers", 1),
                                    max_shard_size=spec.get("max_shard_size", "5GB"))

    dist.init_process_group("gloo", rank=rank, world_size=world)
    rec: dict[str, Any] = {"rank": rank, "threads": torch.get_num_threads(), "anon_before": status_bytes("RssAnon")}
    before = set(sys.modules)
    model, (rec["load_t0"], rec["load_t1"], rec["load_s"]) = _timed(load, dist, spec)
    rec["imported_in_load"] = sorted(set(sys.modules) - before)  # the call's first-use imports
    rec["anon_after"] = status_bytes("RssAnon")
    rec["rss_after"] = status_bytes("VmRSS")
    if not spec["save"]:  # (a collection would change the save's start) what the load left that is garbage
        import gc

        rec["gc_after_load"] = gc.collect()
        rec["anon_after_collect"] = status_bytes("RssAnon")
    if spec["method"] in FLOORS:
        return rec
    rec["local_numel"] = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
    if spec["save"]:
        where = str(Path(spec["out_dir"]) / "saved")
        if spec.get("save_clock", "as-is") != "as-is":  # the disk's write-back queue empty for both methods
            os.sync()
        _, (_, _, rec["save_s"]) = _timed(lambda: save(model, where), dist, spec)
    return rec


def _swap_gc_quiet(mode: str) -> None:
    """An experiment on fsdptk's own call (``--fsdptk-gc``): instead of the library's
    ``_gc_quiet``, pause the collector for the call (``disable``: ``gc.disable()``, the library's
    behaviour before issue 44), leave it on (``on``) or freeze what exists when the call starts,
    unconditionally (``freeze``)."""
    import contextlib
    import gc
    from collections.abc import Iterator

    import fsdptk.hf.pretrained as pretrained

    @contextlib.contextmanager
    def frozen() -> Iterator[None]:
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()

    @contextlib.contextmanager
    def paused() -> Iterator[None]:
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was:
                gc.enable()

    swap = {"on": contextlib.nullcontext, "freeze": frozen, "disable": paused}[mode]
    pretrained._gc_quiet = swap  # type: ignore[assignment]


def _timed(fn: Any, dist: Any, spec: dict[str, Any]) -> tuple[Any, tuple[float, float, float]]:
    """``barrier, clock, fn(), barrier, clock`` (``clock: barrier``) or ``barrier, clock, fn(),
    clock, barrier`` (``clock: rank``); ``gc.collect()`` before the first barrier with ``gc: collect``."""
    import gc

    if spec["gc"] == "collect":
        gc.collect()
    dist.barrier()
    t0 = time.monotonic()
    result = fn()
    if spec["clock"] == "rank":
        t1 = time.monotonic()
        dist.barrier()
    else:
        dist.barrier()
        t1 = time.monotonic()
    return result, (t0, t1, t1 - t0)


# ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The probe's options (see the module's docstring).

    Example:
        >>> a = parse_args(["--worlds", "2", "4", "--malloc", "mmap65536"])
        >>> a.worlds, a.malloc, a.gc, a.meshes
        ([2, 4], 'mmap65536', 'none', ['fsdp'])
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks hf-probe", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    shape = p.add_argument_group("the model (default: the issue's Llama, hidden 2048 x 10 layers, 2.29 GB)")
    shape.add_argument("--size", type=float, default=None,
                       help="GB of fp32 parameters in the shape `python -m benchmarks hf` uses (width 1024, vocab 16384)")
    for name, key in (("--hidden", "hidden_size"), ("--layers", "num_hidden_layers"),
                      ("--intermediate", "intermediate_size"), ("--heads", "num_attention_heads"),
                      ("--kv-heads", "num_key_value_heads"), ("--vocab", "vocab_size")):
        shape.add_argument(name, type=int, default=None, help=f"{key} (default {ISSUE_SHAPE[key]})")
    p.add_argument("--worlds", type=int, nargs="+", default=[2], help="world sizes (ranks)")
    p.add_argument("--meshes", nargs="+", default=["fsdp"], choices=["fsdp", "fsdp-tp2"])
    p.add_argument("--repeats", type=int, default=3, help="runs of each method per cell")
    p.add_argument("--save", action="store_true", help="also time the save after the load")
    p.add_argument("--writers", type=int, default=1,
                   help="fsdptk's save: save_safetensors(writers=N) (1: its default, one file written by rank 0)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="fsdptk's save: save_safetensors(max_shard_size=...) (with --writers > 1, small enough that "
                        "there is a file per writer)")
    p.add_argument("--save-clock", default="as-is", choices=["as-is", "synced", "durable"],
                   help="as-is (the issue's harness): nothing before the save; synced: os.sync() before every save, "
                        "so neither clock includes (or skips) the write-back of what earlier runs left dirty; "
                        "durable: also fsync transformers' files inside its clock (fsdptk's save fsyncs its own)")
    p.add_argument("--floor", action="store_true",
                   help="also time, in the same fresh world, what both calls share on first use: importing "
                        "transformers' modeling code for the model (method imports-floor), and the same with the "
                        "collector as fsdptk's call runs it (imports-floor-fsdptk)")
    factors = p.add_argument_group("factors (default: the issue's harness; the alternative: python -m benchmarks hf's)")
    factors.add_argument("--malloc", default="default", choices=["default", "mmap65536"],
                         help="glibc's default malloc, or MALLOC_MMAP_THRESHOLD_=65536 in every rank")
    factors.add_argument("--gc", default="none", choices=["none", "collect"], help="gc.collect() before each clock")
    factors.add_argument("--order", default="alternate", choices=["alternate", "transformers-first", "fsdptk-first"],
                         help="the methods' order in each repeat (alternate: swapped every repeat)")
    factors.add_argument("--imports", default="issue", choices=["issue", "union"],
                         help="issue: the issue's modules before the clock; union: also python -m benchmarks hf's "
                              "union (its UNION_MODULES and modeling_llama)")
    factors.add_argument("--clock", default="barrier", choices=["barrier", "rank"],
                         help="barrier: barrier, clock, call, barrier, clock; rank: the rank's own call time")
    factors.add_argument("--page-cache", default="written", choices=["written", "read"],
                         help="written: the checkpoint written at the start only; read: also read whole before "
                              "every run")
    factors.add_argument("--threads", default="1", choices=["1", "default"],
                         help="one torch / OpenMP thread per rank, or torch's default")
    p.add_argument("--importtime", action="store_true",
                   help="run the ranks under python -X importtime and report each load's time less the self time "
                        "of the modules it imported inside its clock (the shared first-use imports)")
    p.add_argument("--fsdptk-gc", default="library", choices=["library", "disable", "on", "freeze"],
                   help="an experiment on fsdptk's call only: library: the library's own behaviour "
                        "(fsdptk.hf.pretrained._gc_quiet); disable: the collector paused for the call (the "
                        "library's behaviour before issue 44); on: left on; freeze: gc.freeze() at the call's start, "
                        "gc.unfreeze() at its end, whatever the caller froze")
    p.add_argument("--sample-ms", type=float, default=2.0,
                   help="period of the driver's RssAnon sampling of every rank (0: off, no peak)")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fsdptk-hf-probe"))
    p.add_argument("--keep", action="store_true", help="keep the runs' logs (the checkpoint is kept for the next "
                   "run of the same shape)")
    p.add_argument("--rewrite", action="store_true", help="write the checkpoint even if the work directory has it")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--from-json", default=None, help="do not run: print the tables of this result file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[2:] if argv is None else argv)
    if args.size is not None and any(getattr(args, k) is not None for k in
                                     ("hidden", "layers", "intermediate", "heads", "kv_heads", "vocab")):
        p.error("--size takes python -m benchmarks hf's shape; give it or --hidden/--layers/..., not both")
    return args


def _write(path: str, results: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        results = run(args)
        if args.json:
            _write(args.json, results)
            print(f"[probe] results: {args.json}", flush=True)
    meta = results["meta"]
    print(f"\n{meta['command']} ({meta['date']}, {meta['model_bytes'] / 1e9:.2f} GB, factors {meta['factors']}, "
          f"loadavg before {meta['loadavg_before'][0]:.2f} end {meta['loadavg_end'][0]:.2f})\n")
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

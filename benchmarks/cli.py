"""``python -m benchmarks``: run the suite, print the tables, optionally write the results page.

Examples::

    bash benchmarks/setup_peers.sh                       # once: .venv-peers with the peers + matplotlib
    .venv-peers/bin/python -m benchmarks --quick         # ~1 minute smoke run, tiny model, 2 ranks
    .venv-peers/bin/python -m benchmarks --sizes 0.5 1 --worlds 4 2 --repeats 2 --write-docs
    .venv-peers/bin/python -m benchmarks --from-json results.json --write-docs   # re-render only
    .venv-peers/bin/python -m benchmarks --from-json main.json --scaling-json scaling.json --write-docs
    .venv-peers/bin/python -m benchmarks --sizes 0.25 0.5 1 2 4 --worlds 2 4 8 --repeats 1 \
        --scenarios load_mem load_st gather save --write-docs   # scaling figures and tables as well
    .venv-peers/bin/python -m benchmarks --device cuda --write-docs   # on a GPU machine: NCCL, GPU section
    .venv-peers/bin/python -m benchmarks wire --worlds 2 4 --repeats 5   # load/gather vs raw p2p and DCP
    python -m benchmarks hosts --hosts 2 --per-host 2 --rate 1gbit   # root: simulated hosts, bytes across them
    .venv-peers/bin/python -m benchmarks async-save --size 1 --worlds 2 4  # background vs synchronous saves
    python -m benchmarks adapter-save --worlds 2     # LoRA adapter save vs accelerate's FSDP2 path
    python -m benchmarks hf --quick                  # transformers' distributed load/save beside fsdptk's
    python -m benchmarks hf-probe --worlds 2 4 --meshes fsdp fsdp-tp2 --save   # the same, timed as a user's loop
    python -m benchmarks weight-sync --size 1 --worlds 2 4   # weights out to an inference engine (issue 41)
    python -m benchmarks weight-sync --delta --size 1 --worlds 2 4   # only what changed: iter_patches (issue 50)
    python -m benchmarks quant-save --size 1 --worlds 2 4 --writers 1 W   # FP8 save vs unquantized (issue 42)

``--device cuda`` runs the same scenarios with each rank on its own GPU (``cuda:<rank>``) over NCCL:
shards are loaded onto / gathered from the GPUs, the in-memory full states the methods read are in
pinned host memory, and each rank reports ``torch.cuda.max_memory_allocated`` over the operation
beside time and peak RSS. World sizes default to what the machine's GPUs allow (4 and 2, or fewer);
the physical-limit run (gloo bandwidths) is skipped. Without CUDA it exits 1 with the reason.

With results at more than one model size or world size, ``--write-docs`` also draws a scaling
figure per scenario (time over size at ``--plot-world`` ranks; time, peak RSS and bytes sent per
rank beside the ideal over ranks at ``--plot-size`` GB) and adds a Scaling section with its table;
``--scaling-json`` draws these from a sweep of their own (the rest of the page from the main run).

Order of runs: for each world size, model size and repeat, every (scenario, method) once, so that
a change in the machine's background load hits every method alike. Methods that need torchtune or
accelerate run with the peers' python (``--peers-python``, default ``.venv-peers/bin/python``)
when the current interpreter lacks them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .methods import METHODS, NOT_APPLICABLE, SCENARIOS
from .model import GENERATOR_VERSION, config_for_size
from .report import render_tables, write_docs, write_gpu_section
from .runner import REPO, launch_ttfs, launch_workers

__all__ = ["main", "parse_args", "cuda_problem"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 0.02 GB model, 2 ranks, 1 repeat, small limit buffers (~1 minute)")
    p.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1.0], help="model sizes in GB (1e9 bytes)")
    p.add_argument("--worlds", type=int, nargs="+", default=None,
                   help="world sizes (ranks); default 4 2 (cuda: those the GPUs allow, one GPU per rank)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo, shards in host memory; cuda: NCCL, rank r on GPU r, CUDA peak memory too")
    p.add_argument("--repeats", type=int, default=2, help="runs of each (scenario, method, size, world)")
    p.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    p.add_argument("--methods", nargs="+", default=None,
                   help="only these methods (e.g. fsdptk dcp); default: all of each scenario")
    p.add_argument("--no-limits", dest="limits", action="store_false", help="skip the physical-limit run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fsdptk-bench"),
                   help="checkpoints and per-run logs (default: fsdptk-bench in the system's temporary directory)")
    p.add_argument("--json", default=None, help="write all results here (default: <work-dir>/results.json)")
    p.add_argument("--from-json", nargs="+", default=None,
                   help="do not run: load results from these files (several are merged, e.g. a main run and a scaling run)")
    p.add_argument("--scaling-json", nargs="+", default=None,
                   help="with --write-docs: draw the scaling figures and section from these result files alone "
                        "(a sweep over sizes and ranks), the rest of the page from the run or --from-json")
    p.add_argument("--write-docs", action="store_true", help="write docs/benchmarks.md and docs/img/*.png")
    p.add_argument("--docs", default=str(REPO / "docs" / "benchmarks.md"))
    p.add_argument("--notes", default=None, help="markdown file inserted into the results page")
    p.add_argument("--plot-world", type=int, default=4,
                   help="scaling figures: the world size of the plots over model size (the largest run when absent)")
    p.add_argument("--plot-size", type=float, default=1.0,
                   help="scaling figures: the model size (GB) of the plots over ranks (the nearest run)")
    p.add_argument("--peers-python", default=str(REPO / ".venv-peers" / "bin" / "python"))
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default 900, quick 120)")
    p.add_argument("--mem-headroom", type=float, default=0.85,
                   help="skip a run whose estimated memory exceeds this fraction of MemAvailable")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = [0.02], 1
        args.worlds = args.worlds or ([2] if args.device == "cpu" else None)  # cuda: what the GPUs allow
    args.timeout = args.timeout or (120.0 if args.quick else 900.0)
    return args


# ----------------------------------------------------------------------------------------------
def cuda_problem(args: argparse.Namespace) -> str | None:
    """Why ``--device cuda`` cannot run here (``None`` when it can); fills in the default worlds."""
    import torch

    if not torch.cuda.is_available():
        return (f"--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda})")
    if not torch.distributed.is_nccl_available():
        return f"--device cuda runs over NCCL, which torch {torch.__version__} was built without"
    gpus = torch.cuda.device_count()
    if args.worlds is None:
        args.worlds = sorted({min(gpus, 4), min(gpus, 2)}, reverse=True)
        if args.quick:
            args.worlds = [min(gpus, 2)]
    too_big = [w for w in args.worlds if w > gpus]
    if too_big:
        return f"--device cuda puts each rank on its own GPU: world size(s) {too_big} need more than the {gpus} GPU(s) here"
    return None


def _has(python: str, module: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec(module) is not None
    if not Path(python).exists():
        return False
    return subprocess.run([python, "-c", f"import importlib.util,sys; sys.exit(importlib.util.find_spec({module!r}) is None)"],
                          capture_output=True).returncode == 0


def _pick_python(needs: str, args: argparse.Namespace, cache: dict) -> tuple[str | None, str | None]:
    """The interpreter for a method and, when none can run it, why."""
    module = {"fsdptk": "fsdptk", "torch": "torch", "torchtune": "torchtune", "accelerate": "accelerate"}[needs]
    for py in (sys.executable, args.peers_python):
        key = (py, module)
        if key not in cache:
            cache[key] = _has(py, module)
        if cache[key]:
            return py, None
    return None, f"{module} is not installed in {sys.executable} nor in {args.peers_python} (bash benchmarks/setup_peers.sh)"


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


_EVERY_RANK_HOLDS = {("load_mem", "torchtune"), ("load_mem", "fsdptk_all"), ("load_st", "torchtune"),
                     ("optim_load", "torchtune")}


def _estimate_bytes(scenario: str, method: str, model_bytes: int, world: int) -> int:
    """A rough upper estimate of the run's total memory over all ranks (to skip hopeless runs)."""
    base = world * 450e6
    state = 3 * model_bytes if scenario.startswith("optim") else model_bytes  # params + AdamW's 2
    holders = world if (scenario, method) in _EVERY_RANK_HOLDS else 1
    payload = (2 * model_bytes if scenario.startswith("optim") else model_bytes) * holders
    transient = model_bytes if method in ("dcp", "accelerate", "torchtune") else 0.2 * model_bytes
    return int(base + state + payload + transient * (world if method != "fsdptk" else 1))


def _prepare(cfg, work: Path, args, seed: int = 0) -> Path:
    ckpt = work / f"ckpt-{cfg.nbytes() / 1e9:.3f}GB-{cfg.dtype}"
    meta = ckpt / "bench_meta.json"
    if meta.is_file():
        old = json.loads(meta.read_text())
        if old.get("cfg") == cfg.__dict__ and old.get("generator") == GENERATOR_VERSION:
            return ckpt
    shutil.rmtree(ckpt, ignore_errors=True)
    out = work / "runs" / f"prepare-{ckpt.name}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"scenario": "prepare", "cfg": cfg.__dict__, "ckpt_dir": str(ckpt), "seed": seed, "out_dir": str(out)}
    (out / "spec.json").write_text(json.dumps(spec))
    print(f"[bench] writing the {cfg.nbytes() / 1e9:.3f} GB checkpoint {ckpt}", flush=True)
    subprocess.run([sys.executable, "-m", "benchmarks.worker", str(out / "spec.json")], cwd=REPO, check=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    return ckpt


def _record(**kw) -> dict:
    return dict(kw)


def _methods_of(scenario: str, args: argparse.Namespace) -> list[str]:
    names = ["fsdptk"] if scenario == "ttfs" else list(METHODS[scenario])
    names += [m for (s, m) in NOT_APPLICABLE if s == scenario]
    if args.methods:
        names = [m for m in names if m in args.methods or any(m.startswith(x + "_") for x in args.methods)]
    return names


def run_suite(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cache: dict = {}
    records: list[dict] = []
    t_start = time.perf_counter()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for world in args.worlds:
        for size in args.sizes:
            cfg = config_for_size(size, args.dtype)
            ckpt = _prepare(cfg, work, args)
            meta = json.loads((ckpt / "bench_meta.json").read_text())
            common = {"world": world, "size_gb": size, "model_bytes": cfg.nbytes(), "file_bytes": meta["file_bytes"],
                      "cfg": cfg.__dict__}
            for rep in range(args.repeats):
                if args.limits and args.device == "cpu":
                    limit_bytes = min(cfg.nbytes(), 32 * 2**20 if args.quick else 256 * 2**20)
                    out = work / "runs" / stamp / f"limits-w{world}-{size}GB-r{rep}"
                    spec = {"scenario": "limits", "ckpt_dir": str(ckpt), "limit_bytes": limit_bytes,
                            "limit_reps": 1 if args.quick else 3}
                    res = launch_workers(spec, world, sys.executable, out, args.timeout)
                    records.append(_record(scenario="limits", method="gloo", repeat=rep, status=res.status,
                                           error=res.error, ranks=res.ranks, **common))
                    _progress(records[-1], t_start)
                for scenario in args.scenarios:
                    for method in _methods_of(scenario, args):
                        rec = _one(scenario, method, rep, world, cfg, ckpt, args, cache, work / "runs" / stamp, common)
                        records.append(rec)
                        _progress(rec, t_start)
    return {"records": records, "meta": _environment(args, time.perf_counter() - t_start)}


def _one(scenario, method, rep, world, cfg, ckpt, args, cache, runs: Path, common) -> dict:
    base = dict(scenario=scenario, method=method, repeat=rep, **common)
    reason = NOT_APPLICABLE.get((scenario, method))
    if reason:
        return dict(base, status="n/a", error=reason, ranks=[])
    needs = "fsdptk" if scenario == "ttfs" else METHODS[scenario][method].needs
    python, why = _pick_python(needs, args, cache)
    if python is None:
        return dict(base, status="n/a", error=why, ranks=[])
    est = _estimate_bytes(scenario, method, cfg.nbytes(), world)
    avail = _mem_available()
    if est > args.mem_headroom * avail:
        return dict(base, status="skipped", ranks=[],
                    error=f"needs ~{est / 1e9:.1f} GB, {avail / 1e9:.1f} GB available now")
    out = runs / f"{scenario}-{method}-w{world}-{common['size_gb']}GB-r{rep}"
    if scenario == "ttfs":
        if not (REPO / "examples" / "train_llama.py").is_file():
            return dict(base, status="n/a", error="examples/train_llama.py does not exist", ranks=[])
        res = launch_ttfs(world, python, out, ckpt, args.timeout, device=args.device)
    else:
        spec = {"scenario": scenario, "method": method, "cfg": cfg.__dict__, "ckpt_dir": str(ckpt),
                "device": args.device}
        res = launch_workers(spec, world, python, out, args.timeout)
    rec = dict(base, status=res.status, error=res.error, ranks=res.ranks, python=python, log_dir=str(out),
               wall_s=res.wall_s)
    if res.status == "ok" and scenario != "ttfs":
        shutil.rmtree(out / "scratch", ignore_errors=True)
    return rec


def _progress(rec: dict, t0: float) -> None:
    times = [r.get("time_s") for r in rec["ranks"] if r.get("time_s") is not None]
    what = f"{max(times):7.2f} s" if times else rec["status"]
    checks = {r.get("check") for r in rec["ranks"] if r.get("check")}
    check = "" if not checks or checks == {"ok"} else f" check: {sorted(map(str, checks))[0][:120]}"
    err = f" ({rec['error'][:160]})" if rec.get("error") and rec["status"] not in ("ok",) else ""
    print(f"[bench +{time.perf_counter() - t0:6.0f}s] W={rec['world']} {rec['size_gb']:g} GB r{rec['repeat']} "
          f"{rec['scenario']:<12} {rec['method']:<22} {what}{check}{err}", flush=True)


def _shown(path: str) -> str:
    """``path`` as the docs show it: relative to the repository when inside it."""
    try:
        return str(Path(path).absolute().relative_to(REPO))
    except ValueError:
        return str(path)


def _versions(python: str) -> dict:
    code = ("import importlib.metadata as m, json\nout={}\n"
            "for n in ('torch','fsdptk','torchtune','torchao','accelerate','safetensors'):\n"
            "    try: out[n]=m.version(n)\n    except Exception: out[n]=None\nprint(json.dumps(out))")
    try:
        return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout)
    except Exception:  # noqa: BLE001
        return {}


def _environment(args: argparse.Namespace, seconds: float) -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    pythons = {sys.executable} | ({args.peers_python} if Path(args.peers_python).exists() else set())
    return {
        "command": "python -m benchmarks " + " ".join(sys.argv[1:]),
        "python": _shown(sys.executable),
        "versions": {_shown(py): _versions(py) for py in sorted(pythons)},
        "cpus": os.cpu_count(), "mem_total_GB": _mem_total() / 1e9, "loadavg_end": load,
        "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": seconds, "quick": args.quick, "dtype": args.dtype, "device": args.device,
        **(_gpu_environment() if args.device == "cuda" else {}),
        "sizes": args.sizes, "worlds": args.worlds, "repeats": args.repeats,
    }


def _gpu_environment() -> dict:
    import torch

    nccl = torch.cuda.nccl.version()
    return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            "gpu_mem_GB": torch.cuda.get_device_properties(0).total_memory / 1e9}


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def merge_results(parts: list[dict]) -> dict:
    """One results dict from several runs: records concatenated, each run's environment kept."""
    metas = []
    for part in parts:
        m = part.get("meta", {})
        metas.extend(m if isinstance(m, list) else [m])
    return {"records": [r for part in parts for r in part["records"]], "meta": metas}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["wire"]:  # the wire benchmark: rank-0 load and gather beside a raw transfer
        from .wire import main as wire_main

        return wire_main(argv[1:])
    if argv[:1] == ["hosts"]:  # simulated hosts: bytes across hosts and time under a shaped link
        from .hosts import main as hosts_main

        return hosts_main(argv[1:])
    if argv[:1] == ["async-save"]:  # how long a save blocks training, and the steps beside it
        from .async_save import main as async_main

        return async_main(argv[1:])
    if argv[:1] == ["adapter-save"]:  # a LoRA adapter's save beside accelerate's path
        from .adapter_save import main as adapter_main

        return adapter_main(argv[1:])
    if argv[:1] == ["hf"]:  # transformers' distributed from_pretrained / save_pretrained; scaling
        from .hf_peer import main as hf_main

        return hf_main(argv[1:])
    if argv[:1] == ["hf-probe"]:  # issue 44's harness: a user's loop timing both loads, factor by factor
        from .hf_probe import main as hf_probe_main

        return hf_probe_main(argv[1:])
    if argv[:1] == ["weight-sync"] and "--delta" in argv[1:]:  # iter_patches beside a full pass, the wire, a compare
        from .weight_sync_delta import main as weight_sync_delta_main

        return weight_sync_delta_main(argv[1:])
    if argv[:1] == ["weight-sync"]:  # weight_source beside vLLM's ModuleSource, gather-all and raw p2p
        from .weight_sync import main as weight_sync_main

        return weight_sync_main(argv[1:])
    if argv[:1] == ["muon"]:  # fsdptk.Muon beside torch.optim.Muon on DTensors, the naive all-gather, AdamW
        from .muon import main as muon_main

        return muon_main(argv[1:])
    if argv[:1] == ["quant-save"]:  # FP8 saves beside the unquantized one and save_file of the same bytes
        from .quant_save import main as quant_save_main

        return quant_save_main(argv[1:])
    args = parse_args(argv)
    if args.device == "cuda" and not args.from_json:
        problem = cuda_problem(args)
        if problem:
            print(f"python -m benchmarks: {problem}", file=sys.stderr)
            return 1
    args.worlds = args.worlds or [4, 2]
    if args.from_json:
        results = merge_results([json.loads(Path(f).read_text()) for f in args.from_json])
        sources = list(args.from_json)
    else:
        results = run_suite(args)
        path = Path(args.json or Path(args.work_dir) / "results.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
        print(f"[bench] results: {path}", flush=True)
        sources = [str(path)]
    print(render_tables(results))
    scaling = (merge_results([json.loads(Path(f).read_text()) for f in args.scaling_json])
               if args.scaling_json else None)
    if args.write_docs and args.device == "cuda":
        for p in write_gpu_section(results, Path(args.docs)):
            print(f"[bench] wrote the GPU section of {p}")
    elif args.write_docs:
        notes = Path(args.notes).read_text() if args.notes else ""
        for p in write_docs(results, Path(args.docs), notes=notes, sources=[_shown(f) for f in sources],
                            notes_file=_shown(args.notes) if args.notes else None, plot_world=args.plot_world,
                            plot_size=args.plot_size, scaling_results=scaling,
                            scaling_sources=[_shown(f) for f in args.scaling_json or []]):
            print(f"[bench] wrote {p}")
    return 0

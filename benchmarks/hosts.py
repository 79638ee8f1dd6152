"""``python -m benchmarks hosts``: bytes across hosts and wall time on simulated hosts, fsdptk vs its peers.

Builds ``--hosts`` simulated hosts (:class:`fsdptk.testing.hosts.Hosts`: network namespaces on a
bridge, each link shaped to ``--rate`` both ways) and runs ``--per-host`` ranks on each under
``torchrun`` (c10d rendezvous on host 0, gloo bound to the host's link). One launch runs every
scenario on both meshes (FSDP over all ranks; HSDP: replicate across hosts, shard within) for every
method, in sequence (``tests/hosts_worker.py``): per step, one rank per host reads its link's
kernel counters between barriers, so the bytes that crossed between hosts are the sum of the
hosts' ``tx_bytes`` over the step, headers included. Every step is checked against the
single-process reference (bit for bit; the HF loads also by their logits, after the counters are
read); a step whose result differs is void (its check column says why).

Methods on the ``--layers`` x Linear(``--dim``) model:

- ``fsdptk``: ``load_from_full_model_state_dict(broadcast_from_rank0=True)``, ``load_safetensors``
  from each host's own copy of the checkpoint, ``gather_cpu_state_dict``, ``save_safetensors``
  (``save``: one writer, rank 0; ``save_host``: ``writers="host"``, one writer per host), the
  optimizer pair.
- ``dcp``: PyTorch's ``set_model_state_dict`` / ``get_model_state_dict`` with
  ``full_state_dict=True`` and ``broadcast_from_rank0=True`` / ``cpu_offload=True``, the optimizer
  pair likewise, ``save`` = the gather + ``safetensors.save_file`` on rank 0 (no shard-on-read).
- ``accelerate`` (1.15, FSDP2): ``fsdp2_load_full_state_dict`` (load), ``Accelerator.get_state_dict``
  (gather), ``Accelerator.save_model`` (save). accelerate has no shard-on-read of a safetensors
  checkpoint (its sharded load is DCP's own format), and its FULL optimizer save and load are
  DCP's ``get_/set_optimizer_state_dict`` (the ``dcp`` rows): those are not run.

Methods on a Hugging Face Llama written with ``save_pretrained`` (``--hf-layers`` x
``--hf-dim``, one copy per host), both in the same launch:

- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(
  fsdp_size, dp_replicate_size))`` from the host's own copy (``shard_on_read``) and
  ``save_pretrained`` (``save``). It has no rank-0 load (every rank reads the files) and no public
  gather (``save_pretrained``'s is DCP's ``get_model_state_dict``).
- ``fsdptk-hf``: ``fsdptk.hf.from_pretrained`` on the same directory and ``save_safetensors``.

Writes ``benchmarks/results/hosts-<date>.json`` (or ``--json``) and prints a markdown table with
the bytes each method's formula predicts (docs/scale.md) beside the measured ones. Needs root.

Example::

    python -m benchmarks hosts --hosts 2 --per-host 2 --rate 1gbit --layers 24 --dim 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

__all__ = ["busiest_bytes", "main", "predicted_bytes"]

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "hosts_worker.py"
SCENARIOS = ["load", "shard_on_read", "gather", "save", "save_host", "optim_load", "optim_gather"]


HF_METHODS = ("transformers", "fsdptk-hf")
METHODS = ["fsdptk", "dcp", "accelerate", *HF_METHODS]


def predicted_bytes(method: str, mesh: str, scenario: str, s: float, h: int, k: int) -> float | None:
    """Bytes across hosts by the formulas of docs/scale.md (``s``: model bytes; ``None``: n/a).

    fsdptk sends each rank exactly its bytes from (or to) rank 0; DCP broadcasts every full tensor
    over the world group (gloo's binomial tree, lowest bit first: every rank outside host 0
    receives the model once across hosts, (N - K) s for N = h k ranks, N a power of two) and
    all-gathers every tensor in a ring for a gather (h ring edges cross hosts, each carrying
    (N - 1)/N s); with HSDP its gather all-gathers within the host only. accelerate's load is the
    same world broadcast followed by ``distribute_tensor`` from rank 0 over the model's mesh (a
    scatter: (h - 1)/h s for FSDP; for HSDP a broadcast over ``dp_replicate`` in each of the k
    columns, (h - 1) k s = (N - K) s, then a scatter within the host); its gather and save, and
    transformers' ``save_pretrained``, are DCP's gather. Shard-on-read from a copy on each host: 0.
    fsdptk's save with one writer per host (``save_host``) moves the same total as one writer
    (each host's writer receives (h - 1)/h of its 1/h of the files), spread over every link:
    :func:`busiest_bytes`.
    """
    n = h * k
    state = 2 * s if scenario.startswith("optim") else s  # AdamW: exp_avg + exp_avg_sq
    loading = scenario in ("load", "optim_load")
    if scenario == "shard_on_read":
        return 0.0 if method in ("fsdptk", *HF_METHODS) else None
    if scenario == "save_host" and method != "fsdptk":
        return None
    if method in ("fsdptk", "fsdptk-hf"):
        if method == "fsdptk-hf" and scenario != "save":
            return None
        if mesh == "fsdp":
            return state * (h - 1) / h
        return state * (h - 1) if loading else 0.0
    if method in ("accelerate", "transformers"):
        covered = ("load", "gather", "save") if method == "accelerate" else ("save",)
        if scenario not in covered:
            return None
        if scenario == "load":
            return state * (n - k) + (state * (h - 1) / h if mesh == "fsdp" else state * (n - k))
    if loading:
        return state * (n - k)
    return 0.0 if mesh == "hsdp" else state * h * (n - 1) / n


def busiest_bytes(method: str, mesh: str, scenario: str, s: float, h: int, k: int) -> float | None:
    """Bytes into the busiest host's link for fsdptk's saves (``None``: not predicted here): one
    writer (rank 0) receives the other hosts' shards, S (h-1)/h for FSDP; one writer per host
    receives (h-1)/h of its S/h: S (h-1)/h^2 into every host. With HSDP both are 0."""
    if method != "fsdptk" or scenario not in ("save", "save_host"):
        return None
    if mesh == "hsdp":
        return 0.0
    return s * (h - 1) / h / (h if scenario == "save_host" else 1)


def _prepare(work: Path, hosts: int, layers: int, dim: int, dtype: str) -> str:
    sys.path.insert(0, str(WORKER.parent))
    import torch
    from hosts_worker import reference_state
    from safetensors.torch import save_file

    ref = reference_state(layers, dim, getattr(torch, dtype))
    for h in range(hosts):
        d = work / f"host{h}" / "ckpt"
        d.mkdir(parents=True, exist_ok=True)
        save_file(ref, d / "model.safetensors", metadata={"format": "pt"})
    return str(work / "host{host}" / "ckpt")


def run(args: argparse.Namespace) -> dict:
    """One launch on fresh simulated hosts; the per-rank records and the environment."""
    from fsdptk.testing.hosts import Hosts

    work = Path(tempfile.mkdtemp(prefix="fsdptk-bench-hosts-"))
    out = work / "out"
    out.mkdir()
    spec = {"layers": args.layers, "dim": args.dim, "dtype": args.dtype, "meshes": args.meshes,
            "methods": args.methods, "scenarios": ["noop", *args.scenarios], "repeats": args.repeats,
            "ckpt": _prepare(work, args.hosts, args.layers, args.dim, args.dtype), "out_dir": str(out)}
    hf = {"hf_model_bytes": None}
    if set(args.methods) & set(HF_METHODS):
        from hosts_worker import write_hf_checkpoints  # on sys.path since _prepare

        hf = write_hf_checkpoints(work, args.hosts, args.hf_layers, args.hf_dim)
        spec.update(hf_ckpt=hf["hf_ckpt"], hf_ref=hf["hf_ref"])
    (work / "spec.json").write_text(json.dumps(spec))
    env = {"PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p),
           "HF_HUB_OFFLINE": "1"}  # the HF model is a local directory: nothing is downloaded
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with Hosts(args.hosts, rate=args.rate, delay=args.delay) as hosts:
        runs = hosts.torchrun([str(WORKER), str(work / "spec.json")], nproc_per_node=args.per_host,
                              env=env, timeout=args.timeout)
    failed = [r for r in runs if r.returncode != 0]
    if failed:
        raise RuntimeError(f"host {failed[0].host} exited {failed[0].returncode}:\n{failed[0].stderr[-4000:]}")
    records = [x for f in sorted(out.glob("rank*.json")) for x in json.loads(f.read_text())]
    import torch

    return {"records": records, "meta": {
        "command": "python -m benchmarks hosts " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["hosts"] else sys.argv[1:]),
        "hosts": args.hosts, "per_host": args.per_host, "rate": args.rate, "delay": args.delay,
        "layers": args.layers, "dim": args.dim, "dtype": args.dtype,
        "model_bytes": args.layers * (args.dim * args.dim + args.dim) * torch.empty((), dtype=getattr(torch, args.dtype)).element_size(),
        "hf_layers": args.hf_layers, "hf_dim": args.hf_dim, "hf_model_bytes": hf["hf_model_bytes"],
        "repeats": args.repeats, "seconds": time.perf_counter() - t0, "loadavg_start": load0,
        "loadavg_end": os.getloadavg(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}}


def aggregate(results: dict) -> list[dict]:
    """Rows per (mesh, scenario, method): median bytes across hosts and median seconds over repeats."""
    steps: dict = defaultdict(lambda: {"crossed": 0, "busiest": 0, "seconds": 0.0, "checks": set()})
    for rec in results["records"]:
        key = (rec["mesh"], rec["scenario"], rec["method"], rec["repeat"])
        steps[key]["seconds"] = max(steps[key]["seconds"], rec["seconds"])
        steps[key]["checks"].add(rec["check"])
        if rec["before"] is not None:
            steps[key]["crossed"] += rec["after"]["tx_bytes"] - rec["before"]["tx_bytes"]
            steps[key]["busiest"] = max(steps[key]["busiest"], rec["after"]["rx_bytes"] - rec["before"]["rx_bytes"])
    groups: dict = defaultdict(list)
    for (mesh, scenario, method, _), step in steps.items():
        groups[(mesh, scenario, method)].append(step)
    m = results["meta"]
    rows = []
    for (mesh, scenario, method), group in groups.items():
        checks = set().union(*(g["checks"] for g in group))
        hf = method in HF_METHODS
        rows.append({"mesh": mesh, "scenario": scenario, "method": method, "model": "llama" if hf else "linear",
                     "crossed": statistics.median(g["crossed"] for g in group),
                     "busiest": statistics.median(g["busiest"] for g in group),
                     "busiest_predicted": busiest_bytes(method, mesh, scenario, m["model_bytes"], m["hosts"],
                                                        m["per_host"]),
                     "seconds": statistics.median(g["seconds"] for g in group),
                     "check": "ok" if checks == {"ok"} else "void: " + sorted(c for c in checks if c != "ok")[0][:200],
                     "predicted": None if scenario == "noop" else predicted_bytes(
                         method, mesh, scenario, m["hf_model_bytes"] if hf else m["model_bytes"],
                         m["hosts"], m["per_host"])})
    order = {s: i for i, s in enumerate(["noop", *SCENARIOS])}
    methods = {x: i for i, x in enumerate(METHODS)}
    rows.sort(key=lambda r: (r["mesh"] != "fsdp", r["model"] == "llama", order.get(r["scenario"], 99),
                             methods.get(r["method"], 99)))
    return rows


def render(results: dict) -> str:
    m = results["meta"]
    rows = aggregate(results)
    lines = [f"{m['hosts']} hosts x {m['per_host']} ranks, {m['rate'] or 'unshaped'} links"
             f"{', delay ' + m['delay'] if m['delay'] else ''}; model {m['layers']} x Linear({m['dim']}, "
             f"{m['dim']}) {m['dtype']}: S = {m['model_bytes'] / 1e6:.1f} MB"
             + (f"; model llama: HF Llama {m['hf_layers']} layers x {m['hf_dim']} float32: "
                f"S = {m['hf_model_bytes'] / 1e6:.1f} MB" if m.get("hf_model_bytes") else "")
             + f"; median of {m['repeats']}; load average {m['loadavg_start'][0]:.1f} -> "
             f"{m['loadavg_end'][0]:.1f}",
             "", "| mesh | scenario | model | method | MB across hosts | formula MB | / formula "
             "| MB into the busiest host | formula MB | seconds | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred, busy = r["predicted"], r.get("busiest_predicted")
        ratio = "-" if not pred else f"{r['crossed'] / pred:.3f}"
        lines.append(f"| {r['mesh']} | {r['scenario']} | {r.get('model', 'linear')} | {r['method']} | "
                     f"{r['crossed'] / 1e6:,.2f} | {'-' if pred is None else f'{pred / 1e6:,.2f}'} | {ratio} | "
                     f"{r.get('busiest', 0) / 1e6:,.2f} | {'-' if busy is None else f'{busy / 1e6:,.2f}'} | "
                     f"{r['seconds']:.3f} | {r['check']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the multi-host benchmark (or re-render ``--from-json``) and print the table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks hosts", description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=2, help="ranks per host (torchrun --nproc-per-node)")
    p.add_argument("--rate", default="1gbit", help="each link's rate, each way (tc syntax); 'none': unshaped")
    p.add_argument("--delay", default=None, help="one-way delay per link (needs the kernel's sch_netem)")
    p.add_argument("--layers", type=int, default=24, help="model: this many Linear(dim, dim) (24 x 1024: 100.8 MB fp32)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--meshes", nargs="+", default=["fsdp", "hsdp"], choices=["fsdp", "hsdp"])
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS,
                   help="transformers and fsdptk-hf run on the HF Llama (--hf-layers, --hf-dim)")
    p.add_argument("--hf-layers", type=int, default=6, help="HF Llama decoder layers (6 x 512: 98.6 MB fp32)")
    p.add_argument("--hf-dim", type=int, default=512, help="HF Llama hidden size (MLP 3 x, vocab 4096)")
    p.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None, help="default: benchmarks/results/hosts-<date>.json")
    p.add_argument("--from-json", default=None, help="do not run: print the table of this result file")
    args = p.parse_args(argv)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return 0
    args.rate = None if args.rate == "none" else args.rate
    from fsdptk.testing.hosts import hosts_unavailable

    why = hosts_unavailable(shaping=bool(args.rate or args.delay))
    if why:
        print(f"python -m benchmarks hosts: {why}", file=sys.stderr)
        return 1
    results = run(args)
    path = Path(args.json or REPO / "benchmarks" / "results" / f"hosts-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(render(results))
    print(f"\n[bench] results: {path}")
    return 0

"""``python -m benchmarks muon``: ``fsdptk.Muon``'s step beside the ways users step Muon on a
sharded model today, and beside AdamW, on the same parameters in the same world.

One transformers model of about ``--size`` GB of fp32 parameters (``--model llama`` or
``qwen3-moe``, whose fused 3-D experts Muon orthogonalizes expert by expert), built on ``meta`` on
every rank, tensor-parallel first when ``--tp`` > 1, then FSDP2, its shards random
(:func:`benchmarks.weight_sync.build_model`). Muon steps the hidden matrices and experts (not the
embeddings, the head, the norms); every method's step is timed from the same parameters, momentum
buffers and gradients (restored before each run):

- ``fsdptk.Muon``: each matrix's shards to one owner, Newton-Schulz there, the pieces back.
- ``torch.optim.Muon on DTensors``: what users try today: torch's optimizer over the DTensor
  parameters (its Newton-Schulz matmuls run as DTensor splits them). It refuses 3-D tensors, so
  with experts it steps the 2-D matrices only. Its distance from the single-process result (the
  largest absolute difference of any parameter from fsdptk's step, which is the single-process
  one bit for bit) is reported.
- ``naive all-gather``: the correct step without owners: every rank all-gathers every matrix's
  update (``full_tensor()``) and orthogonalizes all of them, then keeps its shard.
- ``AdamW``: ``torch.optim.AdamW``'s step over the same parameters (foreach).

Measured per method: wall time (between barriers, the slowest rank; min over ``--repeats``), bytes
each rank received over TCP (gloo's payload and control messages), peak RSS above before, and
for fsdptk the Newton-Schulz work each rank owns (max / mean) and the bytes its plan sends.

Example (a smoke run; the issue's rows are 0.5-1 GB at 2 and 4 ranks, FSDP and FSDP x TP)::

    python -m benchmarks muon --size 0.02 --worlds 2 --repeats 1
    python -m benchmarks muon --model qwen3-moe --size 0.5 --worlds 2 4 --tp 2 --json muon.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .measure import reset_peak, status_bytes
from .weight_sync import _received_since, _tcp_received, build_model, model_config

METHODS = ["fsdptk", "torch_dtensor", "naive", "adamw"]
LABELS = {"fsdptk": "fsdptk.Muon", "torch_dtensor": "torch.optim.Muon on DTensors",
          "naive": "naive all-gather, every rank all matrices", "adamw": "AdamW"}
_LR = 0.02


def _matrices(model: Any) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n and "lm_head" not in n]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Naive:
    """The correct step without owners: every rank all-gathers and orthogonalizes every matrix."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.bufs = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        from torch.distributed.tensor import distribute_tensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        for p, buf in zip(self.params, self.bufs):
            buf.lerp_(p.grad, 1 - 0.95)
            update = p.grad.lerp(buf, 0.95).full_tensor()  # every rank: every matrix
            mats = update.unbind(0) if update.ndim == 3 else [update]
            ortho = torch.stack([_zeropower_via_newtonschulz(m, (3.4445, -4.775, 2.0315), 5, 1e-7) for m in mats])
            ortho = ortho if update.ndim == 3 else ortho[0]
            mine = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None).to_local()
            _local(p).mul_(1 - _LR * 0.1)
            _local(p).add_(mine, alpha=-_adjust_lr(_LR, None, p.shape[-2:]))


def _snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_local(p).detach().clone() for p in params]


def _restore(params: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, s in zip(params, saved):
            _local(p).copy_(s)


def _measure(fn: Any) -> dict[str, float]:
    """Run ``fn`` between barriers: wall (the slowest rank), peak RSS above before, TCP bytes read."""
    import gc

    gc.collect()
    dist.barrier()
    reset_peak()
    rss, tcp = status_bytes("VmRSS"), _tcp_received()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    peak, received = status_bytes("VmHWM"), _received_since(tcp)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    return {"seconds": float(wall), "peak_above": peak - rss, "received": received}


def _max_diff(params: list[torch.Tensor], a: list[torch.Tensor]) -> float:
    d = max([float((_local(p).detach() - x).abs().max()) if x.numel() else 0.0 for p, x in zip(params, a)] or [0.0])
    t = torch.tensor([d], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    from fsdptk import Muon
    from fsdptk._plans.muon_plan import bucket_view

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_model(model_config(args.model, args.size), args.tp)
    params = _matrices(model)
    flat = [p for p in params if p.ndim == 2]
    for p in params:
        p.grad = p.detach().clone()
    start = _snapshot(params)
    opts: dict[str, Any] = {
        "fsdptk": Muon(params, lr=_LR), "torch_dtensor": torch.optim.Muon(flat, lr=_LR),
        "naive": _Naive(params), "adamw": torch.optim.AdamW(params, lr=_LR)}
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    extra: dict[str, Any] = {}
    for m in METHODS:  # warm-up, and the distance of torch's DTensor step from fsdptk's (= single process)
        _restore(params, start)
        opts[m].step()
        if m == "fsdptk":
            after = [_local(p).detach().clone() for p in flat]
        if m == "torch_dtensor":
            extra["torch_dtensor_max_diff"] = _max_diff(flat, after)
    for _ in range(args.repeats):
        for m in METHODS:
            _restore(params, start)
            runs[m].append(_measure(opts[m].step))
    plan = opts["fsdptk"]._plan[1]  # the plan of its last step (internal: what it sends, who owns what)
    mine = [bucket_view(plan, b, rank) for b in plan.buckets]
    extra["plan_sent"] = sum(msg.nbytes for bv in mine for msg in bv.there + bv.back if not msg.recv)
    extra["plan_received"] = sum(msg.nbytes for bv in mine for msg in bv.there + bv.back if msg.recv)
    extra["ns_load"] = plan.load
    extra["matrix_bytes"] = sum(p.numel() * p.element_size() for p in params)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"runs": runs, "extra": extra})
    if rank == 0:
        q.put({"ranks": everyone, "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
               "experts": any(p.ndim == 3 for p in params), "matrices": len(params)})
    dist.barrier()
    os._exit(0)  # as weight_sync.py: gloo's teardown sometimes aborts, and nothing after the results matters


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every method at ``world`` ranks in fresh processes."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(world, _port(), args, q), nprocs=world, start_method="spawn",
                               join=False)
    res = None
    while True:  # a worker that fails raises here (ProcessRaisedException)
        if res is None and not q.empty():
            res = q.get()
        if procs.join(timeout=1):
            break
    return res if res is not None else q.get()


def render(results: dict[str, Any]) -> str:
    """Markdown: one table per world size."""
    lines = []
    for key, res in results["runs"].items():
        ranks = res["ranks"]
        extra = ranks[0]["extra"]
        load = extra["ns_load"]
        mean = sum(load) / len(load)
        sent = sum(r["extra"]["plan_sent"] for r in ranks)
        lines += ["", f"## {results['model']} {res['model_bytes'] / 1e9:.3f} GB fp32, {key}, "
                      f"min of {results['repeats']}", "",
                  f"fsdptk.Muon: Newton-Schulz work per rank max / mean {max(load) / mean:.3f}; its plan sends "
                  f"{sent / 2**20:.1f} MiB in all = {sent / extra['matrix_bytes']:.3f}x the matrices' fp32 bytes "
                  f"({extra['matrix_bytes'] / 2**20:.1f} MiB). torch.optim.Muon on DTensors: max |difference| from "
                  f"the single-process step {extra['torch_dtensor_max_diff']:.3g}"
                  + (" (2-D matrices only: it refuses the 3-D experts)" if res["experts"] else "") + ".", "",
                  "| method | time s | / fsdptk | received MiB per rank | peak RSS above before, MiB per rank |",
                  "|---|---|---|---|---|"]
        best = {m: min(run["seconds"] for run in ranks[0]["runs"][m]) for m in METHODS}
        for m in METHODS:
            recv = " / ".join(f"{min(x['received'] for x in r['runs'][m]) / 2**20:.1f}" for r in ranks)
            peak = " / ".join(f"{max(x['peak_above'] for x in r['runs'][m]) / 2**20:.1f}" for r in ranks)
            lines.append(f"| {LABELS[m]} | {best[m]:.4f} | {best[m] / best['fsdptk']:.2f} | {recv} | {peak} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks muon", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["llama", "qwen3-moe"], default="llama")
    p.add_argument("--size", type=float, default=0.5, help="model size in GB (1e9 bytes) of fp32 parameters")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP x TP when > 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    bad = [w for w in args.worlds if w < 2 or w % args.tp]
    if bad:
        p.error(f"world sizes must be >= 2 and divisible by --tp {args.tp}, got {bad}")
    results: dict[str, Any] = {
        "model": args.model, "repeats": args.repeats, "tp": args.tp, "runs": {},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "load_average": {"before": os.getloadavg()}}
    for world in args.worlds:
        key = f"{world} ranks" + (f", FSDP x TP {args.tp}" if args.tp > 1 else ", FSDP")
        results["runs"][key] = run(world, args)
    results["load_average"]["after"] = os.getloadavg()
    print(render(results), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0

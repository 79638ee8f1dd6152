"""``python -m benchmarks weight-sync``: a sharded model's weights streamed out, as an RL trainer
streams them to an inference engine after an optimizer step, beside the field's ways and the wire.

One transformers model of about ``--size`` GB of fp32 parameters (``--model llama``: a dense Llama;
``qwen3-moe``: a Qwen3-MoE whose fused experts go out as per-expert Hub tensors), built on ``meta``
on every rank, tensor-parallel first with the model's own plan when ``--tp`` > 1, then FSDP2 (one
unit per decoder layer), its shards filled with random values. Then, in the same world, each method
in turn, ``--repeats`` times interleaved after one warm-up pass of each; every rank drives the
iterator as vLLM's engines drive it, and the rank that receives a tensor drops it on arrival (the
engine's send is not timed):

- ``fsdptk owners=1``: ``fsdptk.hf.weight_source(model).iter_full()``: rank 0 owns every Hub tensor
  (what vLLM's NCCL broadcast engine sends from); each is gathered point to point to rank 0 only.
- ``fsdptk owners=1, keep_buffers``: the same with ``keep_buffers=True``: the pass's buffers kept
  for the next, so a pass writes into warm memory (peak RSS is then measured above an RSS that
  already holds them: the column "held between passes" gives their bytes).
- ``fsdptk owners=W``: ``weight_source(model, owners=W)``: the Hub tensors spread over every rank by
  bytes, each gathered to its owner.
- ``fsdptk owners='all'``: ``weight_source(model, owners="all").iter_full()``: every rank gets every
  Hub tensor whole (what vLLM's IPC engine needs), each gathered point to point to each rank in turn.
- ``vLLM ModuleSource``: vLLM's ``ModuleSource(model).iter_full()`` on every rank: ``full_tensor()``
  (an all-gather) of every parameter on every rank, under the module's names. Only where vLLM is
  importable in this interpreter (``.venv-vllm``, made by ``scripts/test_vllm.sh``); elsewhere the
  row says why it was skipped.
- ``gather all, then send``: every rank ``full_tensor()``\\ s every parameter and rank 0 keeps them
  all before it would send (the fix of trl#7131: the whole model on rank 0, all-gathers everywhere).
- ``raw p2p``: exactly the bytes rank 0 receives under ``owners=1`` (the full tensors less the shards
  rank 0 holds), sent by the other ranks in one message each into buffers allocated once: the wire
  limit, no gather, no pack, no names.
- ``raw p2p + owner's own copy``: the raw transfer, while rank 0 also copies its own shards into
  buffers allocated once (posted receives first, the copy while the bytes arrive): the floor of any
  source that hands rank 0 the full tensors, which must hold rank 0's own bytes as well as the
  received ones. On a machine whose cores the wire already keeps busy (2 cores, 2 ranks) the copy
  cannot hide behind it.

Measured on every rank for each run: wall time (between barriers, the slowest rank; the table shows
the minimum over ``--repeats``), peak RSS above the RSS before the run (``VmHWM`` reset through
``/proc/self/clear_refs`` just before; glibc is told to map every block of 128 KiB or more on its own
(``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves RSS at once and one method's freed memory
cannot hide the next one's peak), bytes received over TCP (the sum over the process's sockets of
``tcpi_bytes_received`` from ``TCP_INFO``: gloo's payload and its small control messages; gloo
receives with ``recv``, which ``rchar`` of ``/proc/self/io`` does not count) and the bytes of the
tensors the iterator yielded on that rank.

Example (a smoke run; sizes of 1-2 GB at 2 and 4 ranks are the issue's rows)::

    python -m benchmarks weight-sync --size 0.01 --worlds 2 --repeats 1
    .venv-vllm/bin/python -m benchmarks weight-sync --size 1 --worlds 2 4 --repeats 5 --json ws.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .measure import reset_peak, status_bytes

__all__ = ["METHODS", "main", "build_model", "render"]

METHODS = ["raw_p2p", "raw_p2p_own_copy", "fsdptk_owners1", "fsdptk_owners1_kept", "fsdptk_ownersW", "fsdptk_owners_all", "vllm_module_source", "gather_all"]
LABELS = {"raw_p2p": "raw p2p (same bytes)", "raw_p2p_own_copy": "raw p2p + owner's own copy (floor)",
          "fsdptk_owners1": "fsdptk owners=1",
          "fsdptk_owners1_kept": "fsdptk owners=1, keep_buffers",
          "fsdptk_ownersW": "fsdptk owners=W", "fsdptk_owners_all": "fsdptk owners='all'",
          "vllm_module_source": "vLLM ModuleSource",
          "gather_all": "gather all, then send"}
_MMAP_THRESHOLD = str(128 * 1024)
_TCPI_BYTES_RECEIVED = 128  # offset of the u64 tcpi_bytes_received in Linux's struct tcp_info


# ----------------------------------------------------------------------------------------------
# the model
def _config(family: str, layers: int, hidden: int) -> Any:
    import transformers

    heads = max(1, hidden // 64)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), vocab_size=4096 if hidden < 1024 else 32000,
                  tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=(8 * hidden // 3 + 63) // 64 * 64, **common)
    return transformers.Qwen3MoeConfig(moe_intermediate_size=hidden // 2, num_experts=8, num_experts_per_tok=2,
                                       decoder_sparse_step=1, mlp_only_layers=[], head_dim=64, **common)


def _meta_bytes(config: Any) -> int:
    from fsdptk.hf import hf_meta_model

    return sum(p.numel() * p.element_size() for p in hf_meta_model(config).parameters())


def model_config(family: str, size_gb: float) -> Any:
    """The config of ``family`` whose fp32 parameters come closest to ``size_gb`` (1e9 bytes)."""
    hidden = 256 if size_gb < 0.05 else 1024 if size_gb < 0.5 else 2048
    one, two = _meta_bytes(_config(family, 1, hidden)), _meta_bytes(_config(family, 2, hidden))
    per_layer = two - one
    layers = max(1, round((size_gb * 1e9 - (one - per_layer)) / per_layer))
    return _config(family, layers, hidden)


def build_model(config: Any, tp: int) -> Any:
    """Meta build -> (TP, the model's own plan) -> FSDP2 over the data-parallel ranks -> random shards."""
    from torch.distributed.tensor import DTensor

    from fsdptk import ParallelDims, apply_tp, shard_model
    from fsdptk.hf import hf_meta_model, hf_tp_plan, no_split_modules

    model = hf_meta_model(config)
    dims = ParallelDims(dp_shard=-1, tp=tp, world_size=dist.get_world_size())
    dims.build_mesh("cpu")
    if tp > 1:
        apply_tp(model, dims.tp_mesh, hf_tp_plan(model))
    shard_model(model, no_split_modules(model), cpu_offload=False, dp_mesh=dims.fsdp_mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(torch.rand(local.shape, generator=gen, dtype=local.dtype))
    return model


# ----------------------------------------------------------------------------------------------
# what each rank measures about itself
def _tcp_received() -> dict[str, int]:
    """Bytes received so far on each TCP socket of this process (``tcpi_bytes_received`` of
    ``TCP_INFO``, Linux >= 4.1), by socket inode."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:"):
            continue
        try:
            sock = socket.fromfd(int(fd), socket.AF_INET, socket.SOCK_STREAM)  # a dup of the fd
        except OSError:
            continue
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            if len(info) >= _TCPI_BYTES_RECEIVED + 8:
                out[target] = struct.unpack_from("Q", info, _TCPI_BYTES_RECEIVED)[0]
        except OSError:  # not a TCP socket
            pass
        finally:
            sock.close()
    return out


def _received_since(before: dict[str, int]) -> int:
    now = _tcp_received()
    return sum(n - before.get(k, 0) for k, n in now.items())


def _measure(fn: Any) -> dict[str, float]:
    """Run ``fn`` between barriers on this rank: wall (the slowest rank), peak RSS above before,
    socket bytes read, bytes yielded."""
    import gc

    gc.collect()
    dist.barrier()
    reset_peak()
    rss, tcp = status_bytes("VmRSS"), _tcp_received()
    t0 = time.perf_counter()
    yielded = fn()
    dist.barrier()
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    peak, received = status_bytes("VmHWM"), _received_since(tcp)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    held = getattr(fn, "held", None)  # what the method keeps between passes (keep_buffers' blocks)
    return {"seconds": float(wall), "peak_above": peak - rss, "received": received, "yielded": yielded,
            "held": held() if held is not None else 0}


# ----------------------------------------------------------------------------------------------
# the methods (every one returns the bytes of the tensors this rank got)
def _drain(pairs: Any) -> int:
    n = 0
    for _name, t in pairs:  # the receiving rank drops each tensor on arrival
        n += t.numel() * t.element_size()
    return n


def _vllm_problem() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return (f"vLLM is not installed in {sys.executable} (bash scripts/test_vllm.sh makes .venv-vllm; "
                "run this mode with .venv-vllm/bin/python)")
    try:
        from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the reason goes into the table
        return f"vllm.distributed.weight_transfer.base does not import: {type(e).__name__}: {e}"
    return None


def _methods(model: Any, world: int) -> dict[str, Any]:
    """The runnable methods on this model (the raw transfer's buffers allocated here, once)."""
    from torch.distributed.tensor import DTensor

    from fsdptk.hf import weight_source

    rank = dist.get_rank()
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    mine = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
               for p in params.values())
    need = torch.tensor([mine])
    dist.broadcast(need, src=0)
    need_bytes = total - int(need)  # what rank 0 receives under owners=1
    shares = [need_bytes // (world - 1) + (r <= need_bytes % (world - 1)) for r in range(1, world)]
    if rank == 0:
        bufs = [torch.empty(n, dtype=torch.uint8) for n in shares]
    else:
        bufs = [torch.ones(shares[rank - 1], dtype=torch.uint8)]
    own = [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in params.values()]
    own_bufs = [torch.empty_like(t) for t in own] if rank == 0 else []
    owners1, owners_w, owners_all = (weight_source(model), weight_source(model, owners=world),
                                     weight_source(model, owners="all"))
    owners1_kept = weight_source(model, keep_buffers=True)

    def raw_p2p() -> int:
        if rank == 0:
            for w in [dist.irecv(b, src=r + 1) for r, b in enumerate(bufs)]:
                w.wait()
            return need_bytes
        dist.send(bufs[0], dst=0)
        return 0

    def raw_p2p_own_copy() -> int:
        if rank == 0:
            works = [dist.irecv(b, src=r + 1) for r, b in enumerate(bufs)]
            for t, b in zip(own, own_bufs):
                b.copy_(t)
            for w in works:
                w.wait()
            return need_bytes + sum(t.numel() * t.element_size() for t in own)
        dist.send(bufs[0], dst=0)
        return 0

    def gather_all() -> int:
        kept = {}
        for name, p in params.items():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if rank == 0:
                kept[name] = full
            del full
        n = sum(t.numel() * t.element_size() for t in kept.values())
        kept.clear()  # rank 0 would send them now
        return n

    def owners1_kept_pass() -> int:
        return _drain(owners1_kept.iter_full())

    pool = owners1_kept._pool
    owners1_kept_pass.held = lambda: pool.nbytes() if pool is not None else 0  # type: ignore[attr-defined]

    fns = {"raw_p2p": raw_p2p, "raw_p2p_own_copy": raw_p2p_own_copy, "fsdptk_owners1": lambda: _drain(owners1.iter_full()),
           "fsdptk_owners1_kept": owners1_kept_pass,
           "fsdptk_ownersW": lambda: _drain(owners_w.iter_full()),
           "fsdptk_owners_all": lambda: _drain(owners_all.iter_full()), "gather_all": gather_all}
    if _vllm_problem() is None:
        from vllm.distributed.weight_transfer.base import ModuleSource

        module_source = ModuleSource(model)
        fns["vllm_module_source"] = lambda: _drain(module_source.iter_full())
    return {m: fns[m] for m in METHODS if m in fns}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = model_config(args.model, args.size)
    model = build_model(config, args.tp)
    fns = _methods(model, world)
    for fn in fns.values():  # warm-up: first-call costs are not what is compared
        fn()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            runs[name].append(_measure(fn))
    everyone = [None] * world
    dist.all_gather_object(everyone, runs)
    if rank == 0:
        q.put({"ranks": everyone, "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
               "layers": config.num_hidden_layers, "hidden": config.hidden_size})
    dist.barrier()
    os._exit(0)  # as wire.py: gloo's teardown sometimes aborts, and nothing after the results matters


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every method at ``world`` ranks in fresh processes; per method, per repeat, per rank."""
    return spawn(_worker, world, args)


def spawn(worker: Any, world: int, args: argparse.Namespace) -> Any:
    """``worker(rank, world, port, args, queue)`` on ``world`` fresh processes (glibc told to map every
    block of 128 KiB or more on its own, see the module docstring); what rank 0 puts on the queue."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = _MMAP_THRESHOLD  # read by the workers' malloc at start
    try:
        procs = mp.start_processes(worker, args=(world, _port(), args, q), nprocs=world, start_method="spawn",
                                   join=False)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    res = None
    while True:  # a worker that fails raises here (ProcessRaisedException) instead of leaving q empty
        if res is None and not q.empty():
            res = q.get()
        if procs.join(timeout=1):
            break
    if res is None:
        res = q.get()
    return res


# ----------------------------------------------------------------------------------------------
def _per_rank(ranks: list[dict[str, Any]], method: str, field: str, pick: Any) -> str:
    """``field`` of ``method`` on each rank (``pick`` over the repeats), in MiB, rank 0 first."""
    return " / ".join(f"{pick(run[field] for run in runs[method]) / 2**20:.1f}" for runs in ranks)


def render(results: dict[str, Any]) -> str:
    """Markdown: one table per world size."""
    lines = []
    for key, res in results["runs"].items():
        lines += ["", f"## {results['model']} {res['model_bytes'] / 1e9:.3f} GB fp32 ({res['layers']} layers, hidden "
                      f"{res['hidden']}), {key}, min of {results['repeats']}", "",
                  "| method | time s | / raw | / floor | / ModuleSource | peak RSS above before, MiB per rank | "
                  "held between passes, MiB per rank | received MiB per rank | yielded MiB per rank |",
                  "|---|---|---|---|---|---|---|---|---|"]
        ranks = res["ranks"]
        best = {m: min(run["seconds"] for run in ranks[0][m]) for m in ranks[0]}
        for m in METHODS:
            if m not in ranks[0]:
                lines.append(f"| {LABELS[m]} | skipped: {results['skipped'].get(m, '?')} | | | | | | | |")
                continue

            vs_ms = f"{best[m] / best['vllm_module_source']:.2f}" if "vllm_module_source" in best else "-"
            vs_floor = f"{best[m] / best['raw_p2p_own_copy']:.2f}" if "raw_p2p_own_copy" in best else "-"
            lines.append(f"| {LABELS[m]} | {best[m]:.4f} | {best[m] / best['raw_p2p']:.2f} | {vs_floor} | {vs_ms} "
                         f"| {_per_rank(ranks, m, 'peak_above', max)} "
                         f"| {_per_rank(ranks, m, 'held', max) if 'held' in ranks[0][m][0] else '-'} "
                         f"| {_per_rank(ranks, m, 'received', min)} "
                         f"| {_per_rank(ranks, m, 'yielded', max)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks weight-sync", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["llama", "qwen3-moe"], default="llama")
    p.add_argument("--size", type=float, default=1.0, help="model size in GB (1e9 bytes) of fp32 parameters")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP x TP when > 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    bad = [w for w in args.worlds if w < 2 or w % args.tp]
    if bad:
        p.error(f"world sizes must be >= 2 and divisible by --tp {args.tp}, got {bad}")
    problem = _vllm_problem()
    results: dict[str, Any] = {
        "model": args.model, "repeats": args.repeats, "tp": args.tp, "runs": {},
        "skipped": {"vllm_module_source": problem} if problem else {},
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

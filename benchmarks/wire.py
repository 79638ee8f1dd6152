"""``python -m benchmarks wire``: fsdptk's rank-0 load and gather beside the wire limit, in one run.

The limit is a raw point-to-point transfer of EXACTLY the bytes of the scenario, in the same process
group and the same run: for a load, rank 0 ``isend``s each other rank one contiguous buffer of all
its shard bytes (what a perfect scatter would move, with no pack, no unpack, no metadata); for a
gather, each rank sends rank 0 one buffer of its shard bytes. Beside them run fsdptk
(``load_from_full_model_state_dict(broadcast_from_rank0=True)``, ``gather_cpu_state_dict``) and
PyTorch DCP (``set_model_state_dict`` / ``get_model_state_dict`` with ``full_state_dict=True``) on
the same FSDP2 model. Three models: ``large`` (24 tensors of 2048 x 2048 fp32: 0.4 GB), ``xl``
(64 of them: 1.07 GB) and ``small`` (200 tensors of 128 x 128 fp32: 64 KB each, where fixed costs
dominate). Each (model, method) is timed ``--repeats`` times, interleaved, between barriers; the
table shows the minimum and the ratios fsdptk / raw and fsdptk / DCP, with the load average of the
machine at the start and end.

Two more columns split the gap between the raw transfer and a real load. ``raw + own copy``
(``raw_own``) is the raw transfer plus rank 0 copying its own shards into new memory (for a
gather: into new memory of its shards' size), the receivers still filling touched buffers: a load
must at least produce rank 0's own shard in memory the caller's state dict does not own.
``raw into new memory`` (``raw_new``) moves the same bytes, one message per tensor, into NEW memory
(a load's receivers allocate one tensor per shard and rank 0 copies its own shards into new
memory; a gather's rank 0 allocates the full tensors, receives straight into them and places its
own shards): that is the least work a load that builds new tensors (fsdptk assigns new parameters,
as torchtune does, and leaves the model untouched when anything fails) or a gather that returns
new full tensors must do.

A second table per operation gives the CPU seconds of every method, all ranks together (each
process's user + system time, communication threads and page faults included): with more ranks
than cores, the wall time of a run cannot be less than its CPU seconds divided by the cores.

Example::

    .venv-peers/bin/python -m benchmarks wire --worlds 2 4 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

__all__ = ["main", "MODELS"]

MODELS = {"large": (24, 2048, 2048), "xl": (64, 2048, 2048), "small": (200, 128, 128)}  # (tensors, rows, cols), fp32
METHODS = ["raw_load", "raw_own_load", "raw_new_load", "fsdptk_load", "dcp_load",
           "raw_gather", "raw_own_gather", "raw_new_gather", "fsdptk_gather", "dcp_gather"]


def _model(n: int, rows: int, cols: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(cols, rows, bias=False) for _ in range(n)])
    for m in model:
        fully_shard(m)
    fully_shard(model)
    return model


def _timed(fn) -> tuple[float, float]:
    """Wall seconds of ``fn`` between barriers, and the CPU seconds it took summed over every rank
    (each process's user + system time, its communication threads included: the socket copies and
    the page faults of first-touched memory are system time)."""
    dist.barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    wall = time.perf_counter() - t0
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(cpu)
    return wall, float(cpu)


def _worker(rank: int, world: int, port: int, names: list[str], repeats: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from fsdptk import gather_cpu_state_dict, load_from_full_model_state_dict

    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for name in names:
        n, rows, cols = MODELS[name]
        model = _model(n, rows, cols)
        model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(0)
        full = {f"{i}.weight": torch.randn(rows, cols, generator=gen) for i in range(n)} if rank == 0 else {}
        shards = [p.to_local() for p in model.parameters()]
        mine = sum(s.numel() for s in shards)  # this rank's shard elements (what it receives / sends)
        gathered = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor([mine]))
        per_rank = [int(c) for c in gathered]
        bufs = {r: torch.ones(per_rank[r]) for r in range(1, world)} if rank == 0 else {rank: torch.empty(mine)}

        def raw_load() -> None:
            if rank == 0:
                for w in [dist.isend(b, dst=r) for r, b in bufs.items()]:
                    w.wait()
            else:
                dist.recv(bufs[rank], src=0)

        def raw_gather() -> None:
            if rank == 0:
                for w in [dist.irecv(b, src=r) for r, b in bufs.items()]:
                    w.wait()
            else:
                dist.send(bufs[rank], dst=0)

        def raw_own_load() -> None:  # raw, plus rank 0 copying its own shards into new memory
            if rank == 0:
                works = [dist.isend(b, dst=r) for r, b in bufs.items()]
                own = [torch.empty(k).copy_(full[f"{i}.weight"].reshape(-1)[:k]) for i, k in enumerate(sizes)]
                for w in works:
                    w.wait()
                assert len(own) == n
            else:
                dist.recv(bufs[rank], src=0)

        def raw_own_gather() -> None:  # raw, plus rank 0 copying its own shards into new memory
            if rank == 0:
                works = [dist.irecv(b, src=r) for r, b in bufs.items()]
                own = [torch.empty(s.numel()).copy_(s) for s in own_flat]
                for w in works:
                    w.wait()
                assert len(own) == n
            else:
                dist.send(bufs[rank], dst=0)

        own_flat = [s.reshape(-1) for s in shards]  # this rank's shards (rank 0's are placed by a gather)
        sizes = [s.numel() for s in shards]

        def raw_new_load() -> None:  # per tensor, each piece sent from a view into new memory
            if rank == 0:
                fl = [full[f"{i}.weight"].reshape(-1) for i in range(n)]
                works = [dist.isend(f[r * k:(r + 1) * k], dst=r) for r in range(1, world) for f, k in zip(fl, sizes)]
                own = [torch.empty(k).copy_(f[:k]) for f, k in zip(fl, sizes)]
                for w in works:
                    w.wait()
                assert len(own) == n
            else:
                fresh = [torch.empty(k) for k in sizes]
                for w in [dist.irecv(f, src=0) for f in fresh]:
                    w.wait()

        def raw_new_gather() -> None:  # per tensor, received straight into new full tensors
            if rank == 0:
                fulls = [torch.empty(rows * cols) for _ in range(n)]
                works = [dist.irecv(f[r * k:(r + 1) * k], src=r) for r in range(1, world) for f, k in zip(fulls, sizes)]
                for f, s in zip(fulls, own_flat):
                    f[: s.numel()].copy_(s)
                for w in works:
                    w.wait()
                del fulls
            else:
                for w in [dist.isend(s, dst=0) for s in own_flat]:
                    w.wait()

        def fsdptk_load() -> None:
            load_from_full_model_state_dict(model, dict(full), "cpu", broadcast_from_rank0=True)

        def dcp_load() -> None:
            set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True,
                                                                             broadcast_from_rank0=True))

        def fsdptk_gather() -> None:
            gather_cpu_state_dict(model, rank == 0)

        def dcp_gather() -> None:
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

        fns = {"raw_load": raw_load, "raw_own_load": raw_own_load, "raw_new_load": raw_new_load,
               "fsdptk_load": fsdptk_load, "dcp_load": dcp_load, "raw_gather": raw_gather,
               "raw_own_gather": raw_own_gather, "raw_new_gather": raw_new_gather, "fsdptk_gather": fsdptk_gather,
               "dcp_gather": dcp_gather}
        for fn in fns.values():  # warm-up (first-call costs are not what is compared)
            fn()
        for _ in range(repeats):
            for m, fn in fns.items():
                results.setdefault((name, m), []).append(_timed(fn))
    if rank == 0:
        q.put(results)  # a SimpleQueue writes synchronously: the results are out
    dist.barrier()
    # No destroy_process_group (as in worker.py): gloo's teardown sometimes aborts ("terminate
    # called without an active exception", seen once in this benchmark), and nothing after the
    # results matters
    os._exit(0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, names: list[str], repeats: int) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Time every method on every model at ``world`` ranks: per repeat, rank 0's wall seconds and
    the CPU seconds of all ranks together."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _port(), names, repeats, q), nprocs=world, start_method="spawn")
    return q.get()


def _label(name: str) -> str:
    n, rows, cols = MODELS[name]
    return f"{name} ({n} x {rows}x{cols} fp32, {n * rows * cols * 4 / 1e9:.2f} GB)"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    """Run the wire benchmark and print one table per world size."""
    p = argparse.ArgumentParser(prog="python -m benchmarks wire", description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    cores = os.cpu_count() or 1
    for world in args.worlds:
        before = _load()
        res = run(world, args.models, args.repeats)
        after = _load()
        print(f"\n## {world} ranks, min of {args.repeats} (load average before: {before}; after: {after})")
        for op in ("load", "gather"):
            print(f"\n{op} (seconds; ratios are fsdptk / the column named)")
            print("| model | raw | raw + own copy | raw into new memory | fsdptk | DCP | / raw | / raw + own "
                  "| / raw new | / DCP |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for name in args.models:
                t = {m: min(w for w, _ in res[(name, m)]) for m in METHODS}
                f = t[f"fsdptk_{op}"]
                print(f"| {_label(name)} | {t[f'raw_{op}']:.4f} | {t[f'raw_own_{op}']:.4f} | {t[f'raw_new_{op}']:.4f} "
                      f"| {f:.4f} | {t[f'dcp_{op}']:.4f} | {f / t[f'raw_{op}']:.2f} | {f / t[f'raw_own_{op}']:.2f} "
                      f"| {f / t[f'raw_new_{op}']:.2f} | {f / t[f'dcp_{op}']:.2f} |", flush=True)
            print(f"\n{op}: CPU seconds of all ranks together (min of {args.repeats}); on {cores} cores no "
                  f"run can take less wall time than CPU / {cores}")
            print(f"| model | raw | raw + own copy | raw into new memory | fsdptk | fsdptk CPU / {cores} "
                  "| fsdptk wall / that |")
            print("|---|---|---|---|---|---|---|")
            for name in args.models:
                c = {m: min(cpu for _, cpu in res[(name, m)]) for m in METHODS}
                wall = min(w for w, _ in res[(name, f"fsdptk_{op}")])
                floor = c[f"fsdptk_{op}"] / cores
                print(f"| {_label(name)} | {c[f'raw_{op}']:.4f} | {c[f'raw_own_{op}']:.4f} | {c[f'raw_new_{op}']:.4f} "
                      f"| {c[f'fsdptk_{op}']:.4f} | {floor:.4f} | {wall / floor:.2f} |", flush=True)
    return 0

"""Where a warm load's time goes (issue "Fair clocks"): cProfile of one method's load on rank 0,
or (``--phases N``) unprofiled timers around each method's main steps.

Run on every rank with torchrun, once per method, on a checkpoint written by
``python -m benchmarks hf --keep`` (or any ``save_pretrained`` directory)::

    torchrun --nproc-per-node 2 -m benchmarks.profile_hf_load fsdptk DIR [--top 25]
    torchrun --nproc-per-node 2 -m benchmarks.profile_hf_load transformers DIR
    torchrun --nproc-per-node 4 -m benchmarks.profile_hf_load fsdptk DIR --tp 2   # FSDP x TP
    torchrun --nproc-per-node 4 -m benchmarks.profile_hf_load fsdptk DIR --phases 5

Both methods start from the same state as the benchmark's warm clock: the union of their modules
imported (:data:`benchmarks.hf_worker.UNION_MODULES`), the process group up, ``gc.collect()``.
With cProfile, rank 0 prints the load's wall time and the functions with the most cumulative
time (``--top``; ``--dump FILE`` keeps the raw profile for ``pstats``). cProfile slows small
Python calls far more than C work, so ``--phases N`` times the load N times without it, with
wall-clock and CPU timers around each step of the method (:data:`PHASES`): per step the largest
wall time over ranks and the CPU seconds summed over ranks, of the first load (what the
benchmark's warm clock times: a fresh process, every library imported) and the median of the
later loads (first-use costs paid). With
more ranks than cores the ranks queue for the CPUs, so a step's wall time on one rank includes
waits for the others; the CPU seconds are the work itself.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

# method -> (module, owner attribute path or "", function name, label): the steps timed by --phases
PHASES: dict[str, list[tuple[str, str, str, str]]] = {
    "fsdptk": [
        ("fsdptk.hf.pretrained", "", "_meta_model_on_every_rank", "model on meta (transformers' __init__)"),
        ("fsdptk.tp", "", "apply_tp", "apply_tp (torch's parallelize_module)"),
        ("fsdptk.sharding", "", "shard_model", "shard_model (torch's fully_shard)"),
        ("fsdptk.checkpoint", "", "load_safetensors", "load_safetensors (read and place)"),
    ],
    "transformers": [
        ("transformers.models.llama.modeling_llama", "LlamaForCausalLM", "__init__", "model __init__"),
        ("transformers.modeling_utils", "PreTrainedModel", "maybe_distribute_model",
         "maybe_distribute_model (TP, fully_shard)"),
        ("transformers.modeling_utils", "PreTrainedModel", "_load_pretrained_model",
         "_load_pretrained_model (read, convert, place)"),
    ],
}


def _install_timers(steps: list[tuple[str, str, str, str]], totals: dict[str, list[float]]) -> Callable[[], None]:
    """Wrap each step (module, owner class or "", function, label) so that its wall and CPU seconds
    add up in ``totals[label]``; returns the function that puts the originals back."""
    import importlib

    undo: list[tuple[Any, str, Any]] = []
    for module_name, owner_name, name, label in steps:
        owner: Any = importlib.import_module(module_name)
        if owner_name:  # a method: wrap it on the class that defines it (it may be inherited)
            owner = next(c for c in getattr(owner, owner_name).__mro__ if name in c.__dict__)
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        func = raw.__func__ if kind else raw

        def timed(*args: Any, _func: Any = func, _label: str = label, **kwargs: Any) -> Any:
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return _func(*args, **kwargs)
            finally:
                spent = totals.setdefault(_label, [0.0, 0.0])
                spent[0] += time.perf_counter() - w0
                spent[1] += time.process_time() - c0

        functools.update_wrapper(timed, func)
        undo.append((owner, name, raw))
        setattr(owner, name, kind(timed) if kind else timed)

    def restore() -> None:
        for owner, name, raw in reversed(undo):
            setattr(owner, name, raw)

    return restore


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("method", choices=["fsdptk", "transformers"])
    p.add_argument("ckpt")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP over the other ranks)")
    p.add_argument("--dump", default=None, help="also write rank 0's raw profile here (pstats format)")
    p.add_argument("--imports", default="union", choices=["union", "user"],
                   help="what is imported before the load: the warm clock's union, or the user clock's "
                        "(hf_worker.USER_IMPORTS: the model's modeling code is then imported inside fsdptk's first "
                        "load; --phases imports it for transformers' timers, so compare the two methods with union)")
    p.add_argument("--phases", type=int, default=0, metavar="N",
                   help="no cProfile: time the load N times with timers around each step")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from benchmarks.hf_worker import preclock_imports

    torch.set_num_threads(1)
    preclock_imports({"imports": args.imports, "method": args.method, "arch": "llama"})
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.method == "transformers":
        import transformers
        from transformers.distributed import DistributedConfig

        def load() -> Any:
            return transformers.AutoModelForCausalLM.from_pretrained(
                args.ckpt, distributed_config=DistributedConfig(fsdp_size=world // args.tp, tp_size=args.tp))
    else:
        import fsdptk
        from fsdptk.hf import from_pretrained

        def load() -> Any:
            return from_pretrained(args.ckpt, dims=fsdptk.ParallelDims(dp_shard=world // args.tp, tp=args.tp))

    if args.phases:
        phases(args, load, world)
    else:
        profile(args, load)
    dist.destroy_process_group()


def profile(args: argparse.Namespace, load: Any) -> None:
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    if dist.get_rank() == 0:
        prof.enable()
    load()
    if dist.get_rank() == 0:
        prof.disable()
    seconds = time.perf_counter() - t0
    dist.barrier()
    if dist.get_rank() == 0:
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(args.top)
        if args.dump:
            stats.dump_stats(args.dump)
        print(f"[profile] {args.method}: load {seconds:.2f} s on rank 0 (cProfile on: slower than unprofiled)")
        print(out.getvalue())


def phases(args: argparse.Namespace, load: Any, world: int) -> None:
    import torch
    import torch.distributed as dist

    totals: dict[str, list[float]] = {}
    _install_timers(PHASES[args.method], totals)
    labels = ["load (the whole call)"] + [label for *_, label in PHASES[args.method]]
    runs: list[dict[str, tuple[float, float]]] = []
    for _ in range(args.phases):
        totals.clear()
        gc.collect()
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        model = load()
        totals[labels[0]] = [time.perf_counter() - w0, time.process_time() - c0]
        del model
        mine = torch.tensor([totals.get(label, [0.0, 0.0]) for label in labels], dtype=torch.float64)
        wall, cpu = mine[:, 0].clone(), mine[:, 1].clone()
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
        runs.append({label: (float(wall[i]), float(cpu[i])) for i, label in enumerate(labels)})
    if dist.get_rank() == 0:
        mesh = f"FSDP x TP {args.tp}" if args.tp > 1 else "FSDP"
        print(f"[phases] {args.method}, {world} ranks, {mesh}, {args.phases} loads in one process; "
              "seconds: max wall over ranks / CPU summed over ranks, of the first load (as the "
              "benchmark's warm clock) and the median of the later ones")
        for label in labels:
            if any(label in r and r[label] != (0.0, 0.0) for r in runs):
                first = runs[0].get(label, (0.0, 0.0))
                later = runs[1:] or runs
                wall_s = statistics.median(r.get(label, (0.0, 0.0))[0] for r in later)
                cpu_s = statistics.median(r.get(label, (0.0, 0.0))[1] for r in later)
                print(f"  {label:48s} first {first[0]:6.3f} / {first[1]:6.3f}   later {wall_s:6.3f} / {cpu_s:6.3f}")

if __name__ == "__main__":
    main()

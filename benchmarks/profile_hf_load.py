"""Where a warm load's time goes: cProfile of one method's load on rank 0 (issue "Fair clocks").

Run on every rank with torchrun, once per method, on a checkpoint written by
``python -m benchmarks hf --keep`` (or any ``save_pretrained`` directory)::

    torchrun --nproc-per-node 2 -m benchmarks.profile_hf_load fsdptk DIR [--top 25]
    torchrun --nproc-per-node 2 -m benchmarks.profile_hf_load transformers DIR
    torchrun --nproc-per-node 4 -m benchmarks.profile_hf_load fsdptk DIR --tp 2   # FSDP x TP

Both methods start from the same state as the benchmark's warm clock: the union of their modules
imported (:data:`benchmarks.hf_worker.UNION_MODULES`), the process group up, ``gc.collect()``. Rank
0 prints the load's wall time and the functions with the most cumulative time (``--top``), and the
totals of a few groups: transformers' model build, fsdptk's sharding and reading, collectives.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("method", choices=["fsdptk", "transformers"])
    p.add_argument("ckpt")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP over the other ranks)")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from benchmarks.hf_worker import preclock_imports

    torch.set_num_threads(1)
    preclock_imports({"imports": "union", "method": args.method, "arch": "llama"})
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.method == "transformers":
        import transformers
        from transformers.distributed import DistributedConfig

        def load():
            return transformers.AutoModelForCausalLM.from_pretrained(
                args.ckpt, distributed_config=DistributedConfig(fsdp_size=world // args.tp, tp_size=args.tp))
    else:
        import fsdptk
        from fsdptk.hf import from_pretrained

        def load():
            return from_pretrained(args.ckpt, dims=fsdptk.ParallelDims(dp_shard=world // args.tp, tp=args.tp))

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
        print(f"[profile] {args.method}: load {seconds:.2f} s on rank 0 (cProfile on: slower than unprofiled)")
        print(out.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

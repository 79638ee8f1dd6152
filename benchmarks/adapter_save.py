"""``python -m benchmarks adapter-save``: saving a LoRA adapter of an FSDP2 model, beside accelerate.

A transformers Llama (``--hidden 2048 --layers 6 --intermediate 2048 --vocab 32000``, 16 heads, 8
KV heads: about 1.13 GB of fp32 parameters) with LoRA ``r=16`` on every linear projection of its
layers, built on ``meta`` on every rank, ``get_peft_model``, ``shard_model`` (one FSDP2 unit per
decoder layer), the base loaded from a safetensors checkpoint written once
(``load_safetensors``, shard on read), the adapter from a PEFT directory (``load_adapter``). Then,
in fresh processes for each method (gloo, one torch thread per rank):

- ``fsdptk.hf.save_adapter(model, dir)``: gathers the adapter tensors only, rank 0 writes
  ``adapter_model.safetensors`` + ``adapter_config.json``.
- ``accelerate``: what ``Accelerator.get_state_dict(model)`` runs on an FSDP2 model in accelerate
  1.15 (``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True, cpu_offload=True))``, the whole model gathered to rank 0's CPU), then
  ``model.save_pretrained(dir, state_dict=...)`` on rank 0 (PEFT picks the adapter keys out).
  The call is made directly: ``Accelerator.prepare`` of an FSDP2 model is not needed to run it,
  and the function is the same.

Per method: rank 0's peak RSS over the save (``VmHWM`` reset through ``/proc/self/clear_refs``
just before, read just after), its RSS before, and the wall time (max over ranks, between
barriers). The two directories are checked to hold the same tensors.

Example::

    python -m benchmarks adapter-save --worlds 2 --json benchmarks/results/adapter_save.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

from .measure import reset_peak, status_bytes

__all__ = ["METHODS", "main"]

METHODS = ["fsdptk.save_adapter", "accelerate"]
_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=8, vocab_size=args.vocab,
        tie_word_embeddings=False)


def _lora(args: argparse.Namespace) -> Any:
    import peft

    return peft.LoraConfig(r=args.r, lora_alpha=2 * args.r, target_modules=_TARGETS,
                           init_lora_weights=False)


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Write the base checkpoint and the initial adapter once (single process)."""
    import peft
    import transformers

    base_dir, init_dir = work / "base", work / "init"
    if not (base_dir / "model.safetensors.index.json").exists() and not (base_dir / "model.safetensors").exists():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(args))
        model.save_pretrained(base_dir)
        torch.manual_seed(1)
        peft.get_peft_model(model, _lora(args)).save_pretrained(init_dir)
        del model
    with torch.device("meta"):
        meta = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(_config(args)), _lora(args))
    base = sum(p.numel() * 4 for n, p in meta.named_parameters() if "lora_" not in n)
    adapter = sum(p.numel() * 4 for n, p in meta.named_parameters() if "lora_" in n)
    return {"base_bytes": base, "adapter_bytes": adapter}


def _worker(rank: int, world: int, port: int, method: str, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import peft
    import transformers

    from fsdptk import load_safetensors, shard_model
    from fsdptk.hf import load_adapter, save_adapter
    from fsdptk.predicates import no_split_modules

    work = Path(args.work_dir)
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(_config(args)), _lora(args))
    shard_model(model, no_split_modules(model), cpu_offload=False)
    load_safetensors(model, work / "base", strict=True)
    load_adapter(model, work / "init")
    out = work / f"out-{world}-{method.replace('.', '_')}"
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    import gc

    gc.collect()
    dist.barrier()
    rss_before = status_bytes("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    if method == "fsdptk.save_adapter":
        save_adapter(model, out)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # accelerate 1.15, Accelerator.get_state_dict, the FSDP2 branch (accelerator.py)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
        state_dict = get_model_state_dict(model, options=options)
        if rank == 0:
            model.save_pretrained(out, state_dict=state_dict)
        del state_dict
    dist.barrier()
    elapsed = time.perf_counter() - t0
    peak = status_bytes("VmHWM")
    t = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        q.put({"seconds": float(t.item()), "peak_rss": peak, "rss_before": rss_before,
               "files": sorted(p.name for p in out.iterdir())})
    dist.barrier()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(method: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _port(), method, args, q), nprocs=world, start_method="spawn")
    return q.get()


def _same_files(work: Path, world: int) -> bool:
    from safetensors.torch import load_file

    a, b = (load_file(work / f"out-{world}-{m.replace('.', '_')}" / "adapter_model.safetensors") for m in METHODS)
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def render(res: dict[str, Any]) -> str:
    """Markdown table of a result file's runs."""
    gb = 1e9
    lines = [f"Llama {res['model']}: base {res['base_bytes'] / gb:.2f} GB fp32, LoRA adapter "
             f"{res['adapter_bytes'] / 2**20:.1f} MiB; median of {res['repeats']}.", "",
             "| ranks | method | rank 0 peak RSS over the save GB | above RSS before GB | time s | same tensors |",
             "|---|---|---|---|---|---|"]
    for world, by_method in res["runs"].items():
        for method, runs in by_method.items():
            peak = statistics.median(r["peak_rss"] for r in runs) / gb
            above = statistics.median(r["peak_rss"] - r["rss_before"] for r in runs) / gb
            secs = statistics.median(r["seconds"] for r in runs)
            lines.append(f"| {world} | {method} | {peak:.2f} | {above:.3f} | {secs:.2f} | "
                         f"{'yes' if res['same'][world] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks adapter-save", description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fsdptk-bench-adapter"))
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (base checkpoint)")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "model": f"hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, "
                 f"vocab {args.vocab}, 16 heads / 8 KV heads, LoRA r={args.r} on {'/'.join(_TARGETS)}",
        **prepare(args, work), "repeats": args.repeats, "runs": {}, "same": {},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "load_average": {"before": os.getloadavg()}}
    for world in args.worlds:
        res["runs"][str(world)] = {m: [] for m in METHODS}
        for _ in range(args.repeats):
            for method in METHODS:
                res["runs"][str(world)][method].append(run(method, world, args))
        res["same"][str(world)] = _same_files(work, world)
    res["load_average"]["after"] = os.getloadavg()
    print(render(res), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0

"""``python -m benchmarks hf``: fsdptk's Hugging Face load and save beside transformers' own.

On the same checkpoint and mesh, in fresh processes for each method (gloo, one torch thread per
rank, :mod:`benchmarks.hf_worker` on every rank):

- ``transformers``: ``AutoModelForCausalLM.from_pretrained(path, distributed_config=
  DistributedConfig(fsdp_size=D, tp_size=T))`` and ``model.save_pretrained(dir)``;
- ``fsdptk``: ``fsdptk.hf.from_pretrained(path, dims=ParallelDims(dp_shard=D, tp=T))`` and
  ``fsdptk.save_safetensors(model, dir)``.

Meshes: ``fsdp`` (FSDP over every rank) and ``fsdp-tp2`` (FSDP x TP, ``tp=2``, worlds >= 4). The
model is a transformers ``LlamaConfig`` (untied, GQA) whose fp32 parameters take each ``--sizes``
GB, written once per size with ``save_pretrained`` into the work directory (nothing downloaded).
Per run: the load, the first forward (``no_grad``, a fixed batch), load + first forward, one
training step (forward, backward, ``AdamW(lr=0)``), the save; rank 0's and the other ranks' memory
after each phase (RSS, ``RssAnon``, ``RssFile``, peak over the phase); bytes sent over the load
and the save beside the ideal. Checked in the run: the two methods' logits agree
(``allclose``) and the two saved directories hold bit-identical tensors (the source
checkpoint's: the step has lr 0); a mismatch marks the pair void.

Clocks (``--clocks``): *warm*, both methods with the same modules imported before the clock (the
union of theirs and the model's modeling module) and ``gc.collect()`` before it: the load's own
work; *user* (issue 44), what a user's loop sees: both import what a script imports at its top
for either call, no collection, each phase ``barrier, clock, call, barrier, clock``, and what
either call imports on first use (transformers' modeling code: ~650 modules, most of a 2 GB load
on two cores) inside the clock (``python -m benchmarks hf-probe`` measures each factor apart);
*cold*, each method importing only its own modules, timed from the process start.

Examples::

    python -m benchmarks hf --quick                        # smoke run: tiny model, 2 ranks, < 1 minute
    python -m benchmarks hf --sizes 0.25 0.5 1 2 4 --worlds 2 4 8 --write-docs   # the full sweep
    python -m benchmarks hf --from-json benchmarks/results/hf.json --write-docs  # re-render only

``--write-docs`` rewrites the section between the ``hf-section`` markers of docs/benchmarks.md
and docs/img/bench_hf_*.png (plots need matplotlib: ``pip install -e .[bench]`` or the peers'
venv, ``bash benchmarks/setup_peers.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .runner import REPO, launch_workers

__all__ = ["MESHES", "METHODS", "main", "llama_config", "estimate_bytes", "check_pair"]

METHODS = ["transformers", "fsdptk"]
MESHES = {"fsdp": "FSDP over every rank", "fsdp-tp2": "FSDP x TP, tp = 2 (dp_shard = ranks / 2)",
          "fsdp-ep2": "FSDP x EP, ep = 2 (MoE models: experts over 2 ranks, FSDP over the other ranks / 2)"}
_GENERATOR = 1  # bump when the checkpoint's values change (invalidates cached checkpoints)
# logits of the two loads: fp32, sharded reductions round differently
_RTOL, _ATOL = 1e-4, 1e-5


def llama_config(size_gb: float) -> dict[str, Any]:
    """``LlamaConfig`` arguments of a model with about ``size_gb`` GB of fp32 parameters.

    The shape of :func:`benchmarks.model.config_for_size` (width 1024 from ~0.16 GB, heads of 64,
    a SwiGLU MLP of ~8/3 the width, layers fill the rest), with at least 2 KV heads (TP = 2).
    """
    from .model import config_for_size

    c = config_for_size(size_gb, "float32")
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=max(2, c.num_key_value_heads), max_position_embeddings=512,
                tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def qwen3_moe_config(size_gb: float) -> dict[str, Any]:
    """``Qwen3MoeConfig`` arguments of a Qwen3-MoE-shaped model with about ``size_gb`` GB of fp32
    parameters: 16 experts of intermediate size 512 per layer (2 routed per token), width 1024,
    heads of 64 (16 query, 4 KV), q/k norms; layers fill the size (at least 2)."""
    h, experts, mi, vocab, heads, kv, hd = 1024, 16, 512, 32000, 16, 4, 64
    per_layer = (h * heads * hd * 2 + 2 * h * kv * hd + experts * h + 3 * experts * h * mi + 2 * h + 2 * hd)
    layers = max(2, round((size_gb * 1e9 / 4 - 2 * vocab * h - h) / per_layer))
    return dict(vocab_size=vocab, hidden_size=h, intermediate_size=4 * h, moe_intermediate_size=mi,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                num_experts=experts, num_experts_per_tok=2, max_position_embeddings=512,
                tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


MODELS = {"llama": ("LlamaConfig", llama_config), "qwen3_moe": ("Qwen3MoeConfig", qwen3_moe_config),
          "qwen3_moe_fp8": ("Qwen3MoeConfig", qwen3_moe_config)}
# an FP8 release: the model's projection weights block-quantized (128 x 128, float32 scales) by
# transformers' own quantizer (Fp8Quantize), the config's quantization_config saying so
_FP8_CODE = """
import json, types, pathlib, torch
from safetensors.torch import load_file, save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize
quant = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128])))
out = pathlib.Path(OUT)
for f in sorted(out.glob('*.safetensors')):
    tensors, new = load_file(f), {}
    for k, t in tensors.items():
        new.update(quant._quantize_one(k, t) if k.endswith('_proj.weight') and t.dim() == 2 else {k: t})
    save_file(new, f, metadata={'format': 'pt'})
index = out / 'model.safetensors.index.json'
if index.is_file():
    idx = json.loads(index.read_text())
    for k, v in list(idx['weight_map'].items()):
        if k.endswith('_proj.weight'):
            idx['weight_map'][k[:-len('.weight')] + '.weight_scale_inv'] = v
    index.write_text(json.dumps(idx))
cfg = json.loads((out / 'config.json').read_text())
cfg['quantization_config'] = {'quant_method': 'fp8', 'weight_block_size': [128, 128], 'activation_scheme': 'dynamic'}
(out / 'config.json').write_text(json.dumps(cfg))
"""


def _param_bytes(cfg: dict[str, Any]) -> int:
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per_layer = 2 * h * h + 2 * kv * h + 3 * h * i + 2 * h
    return 4 * (2 * v * h + n * per_layer + h)


def _mesh_dims(mesh: str, world: int, model: str = "llama") -> tuple[int, int, int] | str:
    """(dp_shard, tp, ep) of ``mesh`` at ``world`` ranks, or why it does not apply."""
    if mesh == "fsdp":
        return world, 1, 1
    if mesh == "fsdp-ep2":
        if "moe" not in model:
            return f"expert parallelism needs an MoE model, not --model {model}"
        if world < 4 or world % 2:
            return f"FSDP x EP with ep = 2 needs an even world of at least 4 ranks (efsdp >= 2), not {world}"
        return world, 1, 2
    if world < 4 or world % 2:
        return f"FSDP x TP with tp = 2 needs an even world of at least 4 ranks (dp_shard >= 2), not {world}"
    return world // 2, 2, 1


def estimate_bytes(method: str, model_bytes: int, world: int, *, heap_kept: bool = False) -> int:
    """A rough upper estimate of a run's memory over all ranks (to skip what cannot fit).

    Measured at 1 GB and 4 ranks (peak RSS of each rank over each phase): each rank ~0.8 GB of
    interpreter, torch, transformers and a step's transients (all-gathered layers, activations);
    over all ranks the parameters and their gradients (2 x model); the save: transformers gathers
    the whole model into rank 0 (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``),
    fsdptk one bucket. ``heap_kept`` (glibc's default mmap threshold): every rank's heap keeps
    the freed all-gathered layers, ~2 x the model per rank.
    """
    save = model_bytes if method == "transformers" else 0.1 * model_bytes
    kept = world * 2 * model_bytes if heap_kept else 0
    return int(world * 0.8e9 + 2 * model_bytes + save + kept)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _prepare(size_gb: float, work: Path, timeout: float, model: str = "llama") -> tuple[Path, dict[str, Any]]:
    """The checkpoint of ``size_gb`` (written once, single process, ``save_pretrained``: a MoE
    model's in the Hub layout, one tensor per expert)."""
    cls, make = MODELS[model]
    cfg = make(size_gb)
    ckpt = work / f"{model}-{size_gb:g}GB"
    meta_file = ckpt / "bench_meta.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if meta.get("cfg") == cfg and meta.get("generator") == _GENERATOR:
            return ckpt, meta
    shutil.rmtree(ckpt, ignore_errors=True)
    print(f"[hf] writing the {model} checkpoint of ~{size_gb:g} GB {ckpt}", flush=True)
    code = ("import json, sys, torch, transformers\n"
            "cfg, out = json.loads(sys.argv[1]), sys.argv[2]\n"
            "torch.manual_seed(0)\n"
            f"model = transformers.AutoModelForCausalLM.from_config(transformers.{cls}(**cfg))\n"
            "model.save_pretrained(out)\n"
            + (f"OUT = {str(ckpt)!r}\n" + _FP8_CODE if model.endswith("_fp8") else "")
            + "print(json.dumps({'params': sum(p.numel() for p in model.parameters())}))\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(cfg), str(ckpt)], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=timeout)
    params = json.loads(done.stdout.strip().splitlines()[-1])["params"]
    files = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    meta = {"cfg": cfg, "generator": _GENERATOR, "model_bytes": 4 * params, "file_bytes": files, "model": model}
    meta_file.write_text(json.dumps(meta, indent=1) + "\n")
    return ckpt, meta


def _tensors(directory: Path):
    """(key, tensor) of every tensor of a safetensors directory, read lazily, in key order."""
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in sorted(directory.glob("*.safetensors"))]
    where = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 - safe_open is not iterable
    for key in sorted(where):
        yield key, where[key].get_tensor(key)


def check_pair(dirs: dict[str, Path], source: Path) -> dict[str, Any]:
    """Same logits (rank 0's ``logits.pt`` of each method) and bit-identical saved tensors."""
    import torch

    out: dict[str, Any] = {}
    a, b = (torch.load(dirs[m] / "logits.pt") for m in METHODS)
    out["logits_max_diff"] = float((a - b).abs().max()) if a.shape == b.shape else None
    out["logits_ok"] = a.shape == b.shape and bool(torch.allclose(a, b, rtol=_RTOL, atol=_ATOL))
    if not all((dirs[m] / "saved").is_dir() for m in METHODS):  # a run without a save (FP8): logits only
        out.update(saved_ok=None, saved_mismatch=[], saved_keys_equal=None, saved_is_source=None)
        out["void"] = None if out["logits_ok"] else f"logits differ (max |diff| {out['logits_max_diff']})"
        return out
    saved = [dict(_tensors(dirs[m] / "saved")) for m in METHODS]  # mmap: pages, not copies
    keys = [sorted(s) for s in saved]
    bad = [k for k in keys[0] if k in saved[1] and not torch.equal(saved[0][k], saved[1][k])]
    out["saved_keys_equal"] = keys[0] == keys[1]
    out["saved_mismatch"] = bad[:5]
    out["saved_ok"] = keys[0] == keys[1] and not bad and bool(keys[0])
    src = dict(_tensors(source))
    out["saved_is_source"] = sorted(src) == keys[1] and all(torch.equal(src[k], saved[1][k]) for k in src)
    reasons = []
    if not out["logits_ok"]:
        reasons.append(f"logits differ (max |diff| {out['logits_max_diff']})")
    if not out["saved_ok"]:
        reasons.append("saved tensors differ: " + (", ".join(bad[:3]) if bad else "keys differ"))
    out["void"] = "; ".join(reasons) or None
    return out


def _run_one(method: str, mesh: str, world: int, dims: tuple[int, int, int], size: float, ckpt: Path, meta: dict,
             rep: int, args: argparse.Namespace, runs: Path, clock: str = "warm") -> dict[str, Any]:
    rec: dict[str, Any] = {"method": method, "mesh": mesh, "world": world, "dp_shard": dims[0], "tp": dims[1],
                           "ep": dims[2],
                           "size_gb": size, "model_bytes": meta["model_bytes"], "repeat": rep, "clock": clock,
                           "model": args.model, "file_bytes": meta.get("file_bytes")}
    steps = not (args.skip_step and clock in ("warm", "user"))  # a cold run always steps
    # glibc's default heap keeps the freed all-gathered layers of a training step (no step: nothing kept)
    est = estimate_bytes(method, meta["model_bytes"], world, heap_kept=args.malloc_mmap_threshold <= 0 and steps)
    avail = _mem_available()
    if est > args.mem_headroom * avail:
        return dict(rec, status="skipped", ranks=[],
                    error=f"needs ~{est / 1e9:.1f} GB over all ranks, {avail / 1e9:.1f} GB available now")
    out = runs / f"{mesh}-w{world}-{size:g}GB-r{rep}-{clock}-{method}"
    shutil.rmtree(out, ignore_errors=True)
    spec = {"method": method, "dp_shard": dims[0], "tp": dims[1], "ep": dims[2], "ckpt_dir": str(ckpt),
            "batch": list(args.batch), "optimizer": args.optimizer,
            "optimizer_after": args.optimizer_after, "skip_step": args.skip_step and clock in ("warm", "user"),
            "save_dir": str(out / "saved"), "clock": clock, "save_clock": args.save_clock,
            "imports": {"warm": "union", "cold": "own", "user": "user"}[clock],
            "skip_save": clock == "cold" or args.model.endswith("_fp8"),
            "quant": "fp8" if args.model.endswith("_fp8") else None,
            "arch": args.model.removesuffix("_fp8")}
    warm_page_cache(ckpt)  # both methods start with the checkpoint in the page cache
    res = launch_workers(spec, world, sys.executable, out, args.timeout, module="benchmarks.hf_worker")
    return dict(rec, status=res.status, error=res.error, ranks=res.ranks, wall_s=res.wall_s, log_dir=str(out))


def warm_page_cache(directory: Path) -> None:
    """Read every file of the checkpoint once, so its pages are in the page cache for the run."""
    for f in sorted(directory.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def _progress(rec: dict[str, Any], t0: float) -> None:
    ranks = [r for r in rec["ranks"] if "load" in r]
    if ranks and rec["status"] == "ok" and rec.get("clock") == "cold":
        what = (f"cold: loaded at {max(r['cold_loaded_s'] for r in ranks):6.2f} s, first step done at "
                f"{max(r.get('cold_step_s', 0) for r in ranks):6.2f} s")
    elif ranks and rec["status"] == "ok":
        what = (f"load {max(r['load']['s'] for r in ranks):6.2f} s  fwd {max(r['forward']['s'] for r in ranks):6.2f} s  "
                f"save {max(r.get('save', {}).get('s', 0) for r in ranks):6.2f} s  read/rank "
                f"{max(r['load'].get('read', 0) for r in ranks) / 1e6:,.0f} MB")
    else:
        what = f"{rec['status']}: {(rec.get('error') or '')[:200]}"
    print(f"[hf +{time.perf_counter() - t0:6.0f}s] {rec['mesh']:<8} W={rec['world']} {rec['size_gb']:g} GB "
          f"r{rec['repeat']} {rec['method']:<12} {what}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.malloc_mmap_threshold > 0:  # the workers inherit the environment (benchmarks.runner)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    work = Path(args.work_dir)
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    for size in args.sizes:
        ckpt, meta = _prepare(size, work, args.timeout, args.model)
        for world in args.worlds:
            for mesh in args.meshes:
                dims = _mesh_dims(mesh, world, args.model)
                if isinstance(dims, str):
                    records += [{"method": m, "mesh": mesh, "world": world, "size_gb": size,
                                 "model_bytes": meta["model_bytes"], "repeat": 0, "status": "n/a", "error": dims,
                                 "ranks": []} for m in args.methods]
                    continue
                for rep in range(args.repeats):
                  for clock in args.clocks:
                    order = args.methods if rep % 2 == 0 else args.methods[::-1]
                    pair = {}
                    for method in order:
                        rec = _run_one(method, mesh, world, dims, size, ckpt, meta, rep, args, runs, clock)
                        records.append(rec)
                        pair[method] = rec
                        _progress(rec, t0)
                    if clock in ("warm", "user") and all(pair.get(m, {}).get("status") == "ok" for m in METHODS):
                        check = check_pair({m: Path(pair[m]["log_dir"]) for m in METHODS}, ckpt)
                        for rec in pair.values():
                            rec["check"] = check
                        print(f"[hf] check: logits max |diff| {check['logits_max_diff']:.3g}, saved tensors "
                              f"{'identical' if check['saved_ok'] else 'not saved' if check['saved_ok'] is None else 'DIFFERENT'}"
                              + (f" -> VOID: {check['void']}" if check["void"] else ""), flush=True)
                    for rec in pair.values():  # the logs stay in the work directory, not in the results
                        if rec.get("log_dir"):
                            shutil.rmtree(Path(rec.pop("log_dir")) / "saved", ignore_errors=True)
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    return {"records": records, "meta": _environment(args, time.perf_counter() - t0, load_before)}


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "safetensors", "fsdptk"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _environment(args: argparse.Namespace, seconds: float, load_before: tuple[float, ...]) -> dict[str, Any]:
    with open("/proc/meminfo") as f:
        mem_total = int(f.readline().split()[1]) * 1024
    return {"command": "python -m benchmarks hf " + " ".join(args.argv), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "commit": _git_commit(), "cpus": os.cpu_count(), "mem_total_GB": mem_total / 1e9,
            "platform": platform.platform(), "versions": _versions(), "seconds": seconds,
            "loadavg_before": list(load_before), "loadavg_end": list(os.getloadavg()),
            "sizes": args.sizes, "worlds": args.worlds, "model": args.model, "clocks": args.clocks, "meshes": args.meshes, "repeats": args.repeats,
            "batch": list(args.batch), "optimizer": args.optimizer, "optimizer_after": args.optimizer_after, "skip_step": args.skip_step, "quick": args.quick, "malloc_mmap_threshold": args.malloc_mmap_threshold,
            "save_clock": args.save_clock}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks hf", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 0.02 GB model, 2 ranks, FSDP only (< 1 minute)")
    p.add_argument("--sizes", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0],
                   help="model sizes in GB (1e9 bytes) of fp32 parameters")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="world sizes (ranks)")
    p.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS,
                   help="both are needed for the checks (a run of one is marked unchecked)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (size, world, mesh, method)")
    p.add_argument("--model", default="llama", choices=list(MODELS),
                   help="the checkpoint: a Llama, or a Qwen3-MoE-shaped model in the Hub layout (16 experts, one "
                        "tensor per expert)")
    p.add_argument("--clocks", nargs="+", default=["warm", "user", "cold"], choices=["warm", "cold", "user"],
                   help="user (issue 44, a user's loop): both methods import what a script imports at its top "
                        "(hf_worker.USER_IMPORTS), no gc.collect(), each phase timed barrier to barrier (the "
                        "slowest rank), what either call imports on first use inside the clock (run it with "
                        "--malloc-mmap-threshold 0 for glibc's default); "
                        "warm: both methods import the same modules (the union) before the clock, the load call "
                        "timed; cold: each imports only its own, timed from the process start to the loaded model "
                        "and to the first finished step")
    p.add_argument("--batch", type=int, nargs=2, default=[2, 16], metavar=("ROWS", "TOKENS"),
                   help="the fixed batch of the first forward and the training step (same on every rank)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="the training step's optimizer, lr 0 (values kept for the saved-tensor check): AdamW "
                        "allocates its two moments, as a real first step does")
    p.add_argument("--skip-step", action="store_true",
                   help="no training step (load, first forward and save only): for repeats of the load, as the step "
                        "is compute on this machine (tens of seconds from 2 GB)")
    p.add_argument("--save-clock", default="synced", choices=["as-is", "synced", "durable"],
                   help="synced: os.sync() before every save, so neither method's clock includes (or skips) the "
                        "write-back of what earlier runs left dirty; durable: also fsync the files transformers' "
                        "save_pretrained wrote, inside its clock (fsdptk's save fsyncs its own before it commits); "
                        "as-is: neither (results before issue 44's second session)")
    p.add_argument("--optimizer-after", default="load", choices=["load", "forward"],
                   help="build the optimizer right after the load (default) or after the first (no_grad) forward; "
                        "transformers' tail unit (final norm, lm_head; reshard_after_forward=False) stays gathered "
                        "after a forward without backward, so an optimizer built then holds tensors that get no "
                        "gradient (reported per run as parameters without optimizer state)")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fsdptk-bench-hf"),
                   help="checkpoints and per-run logs (deleted at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and logs in the work directory")
    p.add_argument("--json", default=None,
                   help="write the results here (default benchmarks/results/hf.json; --quick: <work-dir>/hf.json)")
    p.add_argument("--from-json", nargs="+", default=None,
                   help="do not run: render these results (several files are merged, e.g. a sweep and extra repeats)")
    p.add_argument("--write-docs", action="store_true",
                   help="rewrite the hf section of --docs and its plots (docs/img/bench_hf_*.png)")
    p.add_argument("--docs", default=str(REPO / "docs" / "benchmarks.md"))
    p.add_argument("--notes", default=str(REPO / "benchmarks" / "NOTES_hf.md"),
                   help="hand-written markdown inserted into the section (conditions, why)")
    p.add_argument("--plot-world", type=int, default=4, help="the world of the plots over size")
    p.add_argument("--plot-size", type=float, default=1.0, help="the size (GB) of the plots over ranks")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default 1200, quick 180)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=65536,
                   help="glibc's MALLOC_MMAP_THRESHOLD_ in every rank: allocations above it are mapped and unmapped "
                        "on free, so RSS is live memory; 0 keeps glibc's default, whose heap keeps the freed "
                        "all-gathered layers (each rank's RSS then grows to ~2x the model in a step, any world)")
    p.add_argument("--mem-headroom", type=float, default=0.85,
                   help="skip a run whose estimated memory exceeds this fraction of MemAvailable")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[2:] if argv is None else argv)
    if args.quick:
        args.sizes, args.worlds, args.meshes, args.repeats = [0.02], [2], ["fsdp"], 1
    args.timeout = args.timeout or (180.0 if args.quick else 1200.0)
    if args.json is None:
        args.json = str(Path(args.work_dir) / "hf.json") if args.quick else str(REPO / "benchmarks" / "results" / "hf.json")
    return args


def main(argv: list[str] | None = None) -> int:
    from .hf_report import render, write_docs

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed driver still kills its ranks (finally)
    if args.from_json:
        parts = [json.loads(Path(f).read_text()) for f in args.from_json]
        results = {"records": [r for part in parts for r in part["records"]],
                   "meta": parts[0]["meta"] if len(parts) == 1 else [part["meta"] for part in parts]}
        source = " ".join(args.from_json)
    else:
        results = run(args)
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"[hf] results: {path}", flush=True)
        source = str(path)
        if not args.keep:
            shutil.rmtree(Path(args.work_dir) / "runs", ignore_errors=True)
    print(render(results))
    model = next((r.get("model") for r in results["records"] if r.get("model", "llama") != "llama"), None)
    if args.write_docs and model:
        from .hf_report import write_moe_docs

        name = "NOTES_hf_fp8.md" if model.endswith("_fp8") else "NOTES_hf_moe.md"
        notes_file = Path(args.notes).with_name(name) if args.notes else None
        notes = notes_file.read_text() if notes_file and notes_file.is_file() else ""
        for written in write_moe_docs(results, Path(args.docs), source=source, notes=notes, model=model):
            print(f"[hf] wrote {written}")
    elif args.write_docs:
        notes = Path(args.notes).read_text() if args.notes and Path(args.notes).is_file() else ""
        for written in write_docs(results, Path(args.docs), source=source, notes=notes,
                                  plot_world=args.plot_world, plot_size=args.plot_size):
            print(f"[hf] wrote {written}")
    void = [r for r in results["records"] if (r.get("check") or {}).get("void")]
    return 1 if void else 0

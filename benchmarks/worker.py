"""One rank of one benchmark run: ``python -m benchmarks.worker SPEC.json`` (started by the runner).

Reads the run's spec, joins the process group the runner describes in the environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; gloo on CPU, or NCCL with rank r on ``cuda:r`` when the
spec's ``device`` is ``"cuda"``), builds the benchmark model on ``meta``, shards it
(``fully_shard`` on every decoder layer, then the root: the same for every method), runs the
method's untimed setup, then times the operation between two barriers, and writes
``rank<r>.json`` into the spec's output directory: times, OS peak RSS before and after, current
RSS, bytes written, on CUDA ``torch.cuda.max_memory_allocated`` over the operation (``cuda_peak``:
above what the rank held before it), the check and any error.

The scenario ``prepare`` (one process, no process group) writes the benchmark checkpoint instead;
``limits`` measures the physical limits (see :mod:`benchmarks.limits`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .measure import snapshot
from .model import GENERATOR_VERSION, BenchConfig, build_model, layer_fqns, make_full_state_dict, write_checkpoint


def _prepare(spec: dict) -> dict:
    cfg = BenchConfig(**spec["cfg"])
    ckpt = Path(spec["ckpt_dir"])
    write_checkpoint(cfg, ckpt, seed=spec["seed"])
    sd = make_full_state_dict(cfg, spec["seed"])
    meta = {"seed": spec["seed"], "generator": GENERATOR_VERSION, "nbytes": cfg.nbytes(), "num_tensors": len(sd),
            "sumsq": sum(float(t.double().pow(2).sum()) for t in sd.values()),
            "file_bytes": (ckpt / "model.safetensors").stat().st_size, "cfg": spec["cfg"]}
    (ckpt / "bench_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _shard(model: torch.nn.Module, cfg: BenchConfig, world: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    for fqn in layer_fqns(cfg):
        fully_shard(model.get_submodule(fqn), mesh=mesh)
    fully_shard(model, mesh=mesh)


_FSDPTK_NAMES = ("load_from_full_model_state_dict", "gather_cpu_state_dict", "get_full_optimizer_state_dict",
                 "load_from_full_optimizer_state_dict", "load_safetensors", "save_safetensors")
_MODULES = {"fsdptk": ["fsdptk"], "torch": ["torch.distributed.checkpoint.state_dict"],
            "torchtune": ["torchtune.training"], "accelerate": ["accelerate.utils.fsdp_utils"]}


def _preimport(needs: str) -> None:
    """Import what the method uses before the clock starts (a job imports once, at start-up)."""
    import importlib

    for name in ["safetensors.torch", "torch.distributed.checkpoint.state_dict", *_MODULES[needs]]:
        importlib.import_module(name)
    if needs == "fsdptk":
        import fsdptk

        for name in _FSDPTK_NAMES:  # fsdptk resolves its public names lazily: resolve them now
            try:
                getattr(fsdptk, name)
            except (AttributeError, ImportError):
                pass  # reported by the method itself when it calls the missing name


def _measured(spec: dict, rank: int, world: int) -> dict:
    from .methods import METHODS, Ctx

    cfg = BenchConfig(**spec["cfg"])
    ckpt = Path(spec["ckpt_dir"])
    expected = json.loads((ckpt / "bench_meta.json").read_text())
    tmp = Path(spec["out_dir"]) / "scratch"
    tmp.mkdir(parents=True, exist_ok=True)
    method = METHODS[spec["scenario"]][spec["method"]]
    _preimport(method.needs)
    device = _device(spec)
    model = build_model(cfg, "meta")
    _shard(model, cfg, world, device)
    ctx = Ctx(cfg=cfg, rank=rank, world=world, model=model, ckpt_dir=ckpt, tmp_dir=tmp, expected=expected,
              device=device)
    method.setup(ctx)
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:  # the GPU's high-water mark of the operation alone, above what the rank holds now
        torch.cuda.synchronize(device)
        cuda_base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    before = snapshot()
    method.run(ctx)
    if cuda:
        torch.cuda.synchronize(device)
    own = snapshot()
    dist.barrier()
    after = snapshot()
    cuda_mem = {"cuda_base": cuda_base, "cuda_peak": torch.cuda.max_memory_allocated(device) - cuda_base} \
        if cuda else {}
    gc.collect()
    check = method.check(ctx)
    # bytes written count gloo's socket traffic; NCCL's (NVLink, shared memory) is not a write()
    # a rank's own file writes (every writer of a save with several) come off with write_bytes
    written = own.write_bytes - before.write_bytes if before.write_bytes >= 0 else None
    files = written if written is not None and spec["scenario"] == "save" else ctx.files_written
    sent = own.wchar - before.wchar - files if before.wchar >= 0 and not cuda else None
    return {
        **cuda_mem,
        "time_s": after.t - before.t,  # barrier to barrier: the operation as the job sees it
        "own_time_s": own.t - before.t,  # until this rank returned
        "baseline_peak_rss": before.peak_rss,
        "peak_rss": max(own.peak_rss, after.peak_rss),
        "rss_before": before.rss,
        "rss_after": own.rss,
        "sent_bytes": sent,
        "file_write_bytes": written,
        "check": check,
    }


def _device(spec: dict) -> torch.device:
    if spec.get("device", "cpu") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    return torch.device("cpu")


def _init_process_group(spec: dict) -> None:
    device = _device(spec)
    if device.type == "cuda":  # NCCL, rank r bound to cuda:r (as a torchrun job on a GPU node)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def _limits(spec: dict) -> dict:
    from .limits import measure_limits

    ckpt = Path(spec["ckpt_dir"])
    scratch = Path(spec["out_dir"]) / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    return {"limits": measure_limits(spec["limit_bytes"], ckpt / "model.safetensors", scratch,
                                     reps=spec.get("limit_reps", 3))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(spec["out_dir"])
    torch.set_num_threads(1)
    if spec["scenario"] == "prepare":
        result = _prepare(spec)
        (out / "rank0.json").write_text(json.dumps(result))
        return 0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result: dict = {"rank": rank, "world": world, "python": sys.executable, "torch": torch.__version__}
    code = 0
    try:
        _init_process_group(spec)
        result.update(_limits(spec) if spec["scenario"] == "limits" else _measured(spec, rank, world))
    except BaseException as e:  # noqa: BLE001 (reported to the runner, which kills the group)
        result["error"] = f"{type(e).__name__}: {e}".strip()[:2000]
        traceback.print_exc()
        code = 1
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        dist.barrier()  # everyone has written its result
    # No destroy_process_group: gloo's teardown sometimes aborts ("terminate called without an
    # active exception") and nothing after the results matters; after an error peers may be
    # blocked in a collective, so never wait for them.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

"""What every benchmark method shares: the per-rank context, the method record, untimed checks."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .model import BenchConfig

__all__ = ["Ctx", "Method", "CPU", "host", "sumsq_local", "all_sum", "close", "materialise_random", "check_model_loaded",
           "check_full_on_rank0", "flat_tensors", "nothing"]

CPU = torch.device("cpu")


@dataclass
class Ctx:
    """Everything a method sees on one rank."""

    cfg: BenchConfig
    rank: int
    world: int
    model: torch.nn.Module
    ckpt_dir: Path  # HF-layout directory of the benchmark checkpoint (config.json, model.safetensors)
    tmp_dir: Path  # this run's scratch directory (outputs of save scenarios)
    expected: dict[str, Any]  # what prepare measured about the checkpoint (sumsq, nbytes)
    data: dict[str, Any] = field(default_factory=dict)
    files_written: int = 0  # bytes the timed operation wrote to files (subtracted from bytes sent)
    device: torch.device = CPU  # where the shards live: CPU (gloo) or this rank's GPU (NCCL)

    @property
    def ckpt_file(self) -> Path:
        return self.ckpt_dir / "model.safetensors"


@dataclass(frozen=True)
class Method:
    setup: Callable[[Ctx], None]
    run: Callable[[Ctx], None]
    check: Callable[[Ctx], str]
    needs: str  # "fsdptk" | "torch" | "torchtune" | "accelerate": decides which python runs it
    what: str  # one line: the call that is timed


# ----------------------------------------------------------------------------------------------
# shared helpers (all untimed)
def sumsq_local(tensors) -> float:
    """Sum of squares (float64) over this rank's local pieces of ``tensors``."""
    total = 0.0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t.is_meta:
            raise RuntimeError("a tensor is still on the meta device after the operation")
        total += float(t.detach().double().pow(2).sum())
    return total


def host(ctx: Ctx, tensors: dict) -> dict:
    """The host copy of a full state every method reads: pinned when the shards go to a GPU, so a
    host-to-device copy runs at DMA speed for every method alike."""
    if ctx.device.type != "cuda":
        return tensors
    return {k: (v.pin_memory() if isinstance(v, torch.Tensor) else host(ctx, v) if isinstance(v, dict) else v)
            for k, v in tensors.items()}


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else CPU


def all_sum(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t)
    return float(t.item())


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-7, abs_tol=1e-9)


def materialise_random(ctx: Ctx) -> None:
    """Give the sharded meta model storage and fill each rank's shards (no communication)."""
    ctx.model.to_empty(device=ctx.device)
    gen = torch.Generator().manual_seed(1234 + ctx.rank)  # on CPU: the same values on every device
    with torch.no_grad():
        for p in ctx.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.dim() <= 1:
                local.fill_(1.0)
            elif local.device.type == "cpu":
                local.normal_(0.0, 0.02, generator=gen)
            else:  # a CPU generator cannot fill a GPU tensor: the same values, copied over
                local.copy_(torch.empty(local.shape, dtype=local.dtype).normal_(0.0, 0.02, generator=gen))


def check_model_loaded(ctx: Ctx) -> str:
    """The model holds the checkpoint: right dtype, nothing on meta, global sum of squares matches."""
    for name, p in ctx.model.state_dict().items():
        if p.dtype != ctx.cfg.torch_dtype:
            return f"{name}: dtype {p.dtype}, expected {ctx.cfg.torch_dtype}"
    try:
        got = all_sum(sumsq_local(ctx.model.state_dict().values()))
    except RuntimeError as e:
        return str(e)
    want = ctx.expected["sumsq"]
    return "ok" if close(got, want) else f"sum of squares {got:.6g} != checkpoint's {want:.6g}"


def check_full_on_rank0(ctx: Ctx, full: dict, local_tensors) -> str:
    """Rank 0's full dict has every tensor of the sharded state (sum of squares), others hold none."""
    want = all_sum(sumsq_local(local_tensors))
    if ctx.rank == 0:
        got = sumsq_local(flat_tensors(full))
        ok = close(got, want)
        msg = "ok" if ok else f"rank 0's full state: sum of squares {got:.6g} != shards' {want:.6g}"
    else:
        msg = "ok" if not flat_tensors(full) else f"rank {ctx.rank} holds {len(flat_tensors(full))} tensors"
    box = [None] * ctx.world
    dist.all_gather_object(box, msg)
    bad = [m for m in box if m != "ok"]
    return "ok" if not bad else bad[0]


def flat_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.dim() > 0 else []  # scalars (AdamW's step) are left out of sums
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in flat_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in flat_tensors(v)]
    return []


def nothing(ctx: Ctx) -> None:
    return None

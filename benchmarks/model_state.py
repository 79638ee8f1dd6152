"""Model-state scenarios: load (in-memory / safetensors), gather, save; fsdptk and the peers.

Imports of the libraries under test happen inside the timed functions only syntactically: the
worker imports every module a method needs before the clock starts (see ``worker._preimport``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .common import Ctx, all_sum, check_full_on_rank0, close, host, sumsq_local
from .model import make_full_state_dict, param_specs


# ----------------------------------------------------------------------------------------------
# scenario: load from an in-memory full state dict
def _sd_rank0(ctx: Ctx) -> None:
    ctx.data["sd"] = host(ctx, make_full_state_dict(ctx.cfg, ctx.expected["seed"])) if ctx.rank == 0 else {}


def _sd_all(ctx: Ctx) -> None:
    ctx.data["sd"] = host(ctx, make_full_state_dict(ctx.cfg, ctx.expected["seed"]))


def _load_fsdptk(ctx: Ctx) -> None:
    from fsdptk import load_from_full_model_state_dict

    sd = ctx.data.pop("sd")
    load_from_full_model_state_dict(ctx.model, sd, ctx.device, broadcast_from_rank0=True)


def _load_fsdptk_all(ctx: Ctx) -> None:
    from fsdptk import load_from_full_model_state_dict

    sd = ctx.data.pop("sd")
    load_from_full_model_state_dict(ctx.model, sd, ctx.device)


def _load_dcp(ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = ctx.data.pop("sd")
    set_model_state_dict(ctx.model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _load_torchtune(ctx: Ctx) -> None:
    from torchtune.training import load_from_full_model_state_dict

    sd = ctx.data.pop("sd")
    load_from_full_model_state_dict(ctx.model, sd, ctx.device)


class _Accel:
    """The two attributes ``fsdp2_load_full_state_dict`` reads from its ``Accelerator``."""

    def __init__(self, ctx: Ctx) -> None:
        self.is_main_process = ctx.rank == 0
        self.device = ctx.device


def _load_accelerate(ctx: Ctx) -> None:
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

    sd = ctx.data.pop("sd")
    fsdp2_load_full_state_dict(_Accel(ctx), ctx.model, sd)


# ----------------------------------------------------------------------------------------------
# scenario: load a safetensors checkpoint (file -> sharded model)
def _read_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _st_fsdptk_shard_on_read(ctx: Ctx) -> None:
    from fsdptk import load_safetensors

    load_safetensors(ctx.model, ctx.ckpt_dir, device=ctx.device, shard_on_read=True)


def _st_fsdptk_rank0_read(ctx: Ctx) -> None:
    from fsdptk import load_safetensors

    load_safetensors(ctx.model, ctx.ckpt_dir, device=ctx.device, shard_on_read=False)


def _st_dcp(ctx: Ctx) -> None:
    ctx.data["sd"] = _read_file(ctx.ckpt_file) if ctx.rank == 0 else {}
    _load_dcp(ctx)


def _st_torchtune(ctx: Ctx) -> None:
    ctx.data["sd"] = _read_file(ctx.ckpt_file)  # torchtune's checkpointers read on every rank
    _load_torchtune(ctx)


def _st_accelerate(ctx: Ctx) -> None:
    ctx.data["sd"] = _read_file(ctx.ckpt_file) if ctx.rank == 0 else {}
    _load_accelerate(ctx)


# ----------------------------------------------------------------------------------------------
# scenario: gather the sharded model into a full CPU state dict on rank 0
def _gather_fsdptk(ctx: Ctx) -> None:
    from fsdptk import gather_cpu_state_dict

    ctx.data["full"] = gather_cpu_state_dict(ctx.model, ctx.rank == 0)


def _gather_dcp(ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    ctx.data["full"] = get_model_state_dict(
        ctx.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _gather_torchtune(ctx: Ctx) -> None:
    from torchtune.training import gather_cpu_state_dict

    ctx.data["full"] = gather_cpu_state_dict(ctx.model, ctx.rank == 0)


def _check_gather(ctx: Ctx) -> str:
    full = ctx.data.pop("full")
    if ctx.rank == 0 and len(full) != len(param_specs(ctx.cfg)):
        msg = f"rank 0 got {len(full)} tensors, expected {len(param_specs(ctx.cfg))}"
    else:
        msg = None
    res = check_full_on_rank0(ctx, full, ctx.model.state_dict().values())
    return msg or res


# ----------------------------------------------------------------------------------------------
# scenario: save the sharded model as a safetensors file
def _save_fsdptk(ctx: Ctx) -> None:
    from fsdptk import save_safetensors

    save_safetensors(ctx.model, ctx.tmp_dir / "out")


def _save_fsdptk_writers(writers: int) -> Callable[[Ctx], None]:
    """``save_safetensors(writers=min(writers, world))``: that many ranks write about 1/W of the
    files each."""
    def run(ctx: Ctx) -> None:
        from fsdptk import save_safetensors

        save_safetensors(ctx.model, ctx.tmp_dir / "out", writers=min(writers, ctx.world))

    return run


def _save_via(gather: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        from safetensors.torch import save_file

        gather(ctx)
        full = ctx.data.pop("full")
        if ctx.rank == 0:
            (ctx.tmp_dir / "out").mkdir(parents=True, exist_ok=True)
            save_file(full, str(ctx.tmp_dir / "out" / "model.safetensors"), metadata={"format": "pt"})
        del full

    return run


def _check_save(ctx: Ctx) -> str:
    from safetensors import safe_open

    want = all_sum(sumsq_local(ctx.model.state_dict().values()))
    msg = "ok"
    if ctx.rank == 0:
        files = sorted((ctx.tmp_dir / "out").glob("*.safetensors"))
        ctx.files_written = sum(f.stat().st_size for f in files)
        keys, got = 0, 0.0
        for f in files:
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():
                    keys += 1
                    got += float(fh.get_tensor(k).double().pow(2).sum())
        if keys != len(param_specs(ctx.cfg)):
            msg = f"{keys} tensors in {[f.name for f in files]}, expected {len(param_specs(ctx.cfg))}"
        elif not close(got, want):
            msg = f"file sum of squares {got:.6g} != model's {want:.6g}"
        shutil.rmtree(ctx.tmp_dir / "out", ignore_errors=True)
    box = [msg]
    dist.broadcast_object_list(box, src=0)
    return box[0]

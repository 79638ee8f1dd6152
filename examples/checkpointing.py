"""Checkpoints of examples/train_llama.py: save every K steps, resume from the latest complete one.

Layout: ``<out>/checkpoints/step_000100/`` holds ``config.json`` + ``model.safetensors`` (HF layout,
loadable by any single process), the optimizer as ``optimizer.pt`` (full state keyed by parameter
name, world-size independent) or ``dcp/`` (model and optimizer shards, written by every rank), and
``train_state.json`` (the step and the loss history). A directory is written as
``.step_000100.tmp`` and renamed when complete, so one named ``step_*`` is always whole.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fsdptk

__all__ = ["latest_checkpoint", "save_checkpoint", "load_optimizer", "read_train_state"]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint directory with the highest step under ``root``, or None."""
    done = [d for d in Path(root).glob("step_*") if (d / "train_state.json").is_file()]
    return max(done, key=lambda d: int(d.name.split("_")[1]), default=None)


def save_checkpoint(root: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer,
                    losses: dict[int, float], args: argparse.Namespace) -> Path:
    """Every rank calls this; returns the final directory (``root/step_<step>``).

    ``args.optimizer_format`` picks the optimizer layout, ``args.keep`` how many checkpoints stay.
    The model must have a ``config`` with ``save(directory)`` (written next to the weights).
    """
    rank0 = dist.get_rank() == 0
    final, tmp = root / f"step_{step:06d}", root / f".step_{step:06d}.tmp"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    # model: gathered to rank 0 bucket by bucket and streamed into an HF-layout safetensors file
    fsdptk.save_safetensors(model, tmp)
    if rank0:
        model.config.save(tmp)
    # optimizer: one full file keyed by parameter FQN, or every rank writes its shards (DCP)
    if args.optimizer_format == "full":
        osd = fsdptk.get_full_optimizer_state_dict(model, opt, rank0)
        if rank0:
            torch.save(osd, tmp / "optimizer.pt")
        del osd
    else:
        fsdptk.save_dcp(model, tmp / "dcp", opt)
    dist.barrier()
    if rank0:
        state = {"step": step, "losses": {str(k): v for k, v in losses.items()},
                 "optimizer_format": args.optimizer_format, "world_size": dist.get_world_size()}
        (tmp / "train_state.json").write_text(json.dumps(state, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted((d for d in root.glob("step_*") if (d / "train_state.json").is_file()),
                      key=lambda d: int(d.name.split("_")[1]))
        for old in done[: -args.keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_optimizer(directory: Path, model: nn.Module, opt: torch.optim.Optimizer,
                   device: torch.device) -> None:
    """Restore the optimizer state saved by :func:`save_checkpoint` into a sharded optimizer."""
    state = read_train_state(directory)
    if state["optimizer_format"] == "full":
        rank0 = dist.get_rank() == 0
        osd = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True, mmap=True) if rank0 else {}
        fsdptk.load_from_full_optimizer_state_dict(model, opt, osd, device, broadcast_from_rank0=True)
    else:  # model and optimizer shards (the model is the same as the safetensors file)
        fsdptk.load_dcp(model, directory / "dcp", opt)


def read_train_state(directory: Path) -> dict:
    """``train_state.json`` of a checkpoint directory (``step``, ``losses``, ``optimizer_format``)."""
    return json.loads((Path(directory) / "train_state.json").read_text())

"""Checkpoints of examples/train_llama.py: save every K steps, resume from the latest complete one.

Layout: ``<out>/checkpoints/step_000100/`` holds ``config.json`` + ``model.safetensors`` (HF layout,
loadable by any single process), the optimizer as ``optimizer.pt`` (full state keyed by parameter
name, world-size independent) or ``dcp/`` (model and optimizer shards, written by every rank), and
``train_state.json`` (the step and the loss history). A directory is written as
``.step_000100.tmp`` and renamed when complete, so one named ``step_*`` is always whole.

:func:`start_checkpoint` saves in the background: it returns once every rank holds a private copy
of what the checkpoint needs, and training goes on while the files are written;
:meth:`PendingCheckpoint.finish` (at the next save, or at the end) waits for it and renames the
directory into place. With the full optimizer format the model is written in the background
(``save_safetensors_async``) and the optimizer is gathered to rank 0 during the call; with the DCP
format model and optimizer shards are written in the background (``save_dcp_async``) and rank 0
exports ``model.safetensors`` from them when finishing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdptk

__all__ = [
    "PendingCheckpoint",
    "latest_checkpoint",
    "load_optimizer",
    "read_train_state",
    "save_checkpoint",
    "start_checkpoint",
]


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
    final, tmp = _begin(root, step)
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
    _publish(root, step, tmp, final, losses, args)
    return final


def _begin(root: Path, step: int) -> tuple[Path, Path]:
    final, tmp = root / f"step_{step:06d}", root / f".step_{step:06d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    return final, tmp


def _publish(root: Path, step: int, tmp: Path, final: Path, losses: dict[int, float],
             args: argparse.Namespace) -> None:
    """Every rank, once the files are complete: the step's state, the rename, the old ones deleted."""
    dist.barrier()
    if dist.get_rank() == 0:
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


@dataclass
class PendingCheckpoint:
    """A checkpoint being written in the background (see :func:`start_checkpoint`)."""

    root: Path
    step: int
    tmp: Path
    final: Path
    losses: dict[int, float]
    args: argparse.Namespace
    pending: Any  # fsdptk.PendingSave
    blocked_s: float  # how long the call kept training waiting
    optimizer: dict | None = field(default=None, repr=False)  # rank 0's full optimizer state

    def finish(self) -> Path:
        """Every rank: wait for the files (raising the save's error on every rank), then publish."""
        self.pending.wait()
        if dist.get_rank() == 0:
            if self.args.optimizer_format == "full":
                torch.save(self.optimizer, self.tmp / "optimizer.pt")
            else:  # DCP: the model shards are in dcp/; export them once as model.safetensors
                export = self.tmp.with_name(self.tmp.name + ".hf")  # a converter never writes
                shutil.rmtree(export, ignore_errors=True)  # into the directory it reads
                fsdptk.dcp_to_safetensors(self.tmp / "dcp", export)
                for f in export.iterdir():
                    os.replace(f, self.tmp / f.name)
                shutil.rmtree(export)
        self.optimizer = None
        _publish(self.root, self.step, self.tmp, self.final, self.losses, self.args)
        return self.final

    @property
    def seconds(self) -> float | None:
        """Seconds the background save took (from the call to its end); None while it runs."""
        return self.pending.seconds


def start_checkpoint(root: Path, step: int, model: Any, opt: torch.optim.Optimizer,
                     losses: dict[int, float], args: argparse.Namespace) -> PendingCheckpoint:
    """Every rank calls this: the checkpoint of :func:`save_checkpoint`, written in the background.

    Returns once training may go on; call ``finish()`` on every rank before the next checkpoint
    and before the process group is destroyed.
    """
    t0 = time.perf_counter()
    rank0 = dist.get_rank() == 0
    final, tmp = _begin(root, step)
    if rank0:
        model.config.save(tmp)
    osd = None
    if args.optimizer_format == "full":
        pending = fsdptk.save_safetensors_async(model, tmp)  # the model: a snapshot, then a thread
        osd = fsdptk.get_full_optimizer_state_dict(model, opt, rank0)  # gathered now, written later
    else:
        pending = fsdptk.save_dcp_async(model, tmp / "dcp", opt)  # model and optimizer shards
    return PendingCheckpoint(root, step, tmp, final, dict(losses), args, pending,
                             time.perf_counter() - t0, osd if rank0 else None)


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

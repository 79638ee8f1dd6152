"""Saving without stopping training: safetensors and DCP saves that run in the background.

- :func:`save_safetensors_async` / :func:`save_dcp_async`: every rank calls it; it returns once
  this rank holds a private snapshot of its own shards (CPU memory, pinned when the shards live
  on an accelerator; the optimizer state too for DCP), so the caller may step the optimizer at
  once. The gather and the writes then run in a thread, on a gloo process group of fsdptk's own,
  exactly as the synchronous save does them: same streaming and bucket bound, same crash-safe
  commit, lock and config files.
- :class:`PendingSave`: ``wait()`` returns the path or raises the save's error, on every rank
  (the error is agreed across ranks in the background group, as a synchronous save agrees it);
  ``done()`` polls.
- :func:`release_snapshot`: frees the snapshot buffers a rank keeps between background saves.

Design notes:

- One snapshot per rank: a new save (background or not) first waits for the pending one, so a
  rank never holds two snapshots; a load of the path being written and interpreter exit wait too.
- The snapshot is kept from one background save to the next (:class:`_KeptSnapshot`, as DCP's
  ``cache_staged_state_dict``): the next call copies into the same CPU buffers where its local
  shards have the same names, shapes, strides and dtypes, so only the first save pays for
  allocating (and page-faulting) new memory. It is reused only after the pending save has ended
  (the call waits for it before copying), so a running write never reads a buffer being
  overwritten. :func:`release_snapshot` drops it.
- The thread never touches the model: the front half (arguments, items, file layout, the config
  files) runs in the call, on the default group, and the thread only reads the snapshot.
- The background group is created once per default process group with
  ``dist.new_group(backend="gloo")`` (collective: the first background save of every rank creates
  it) and reused. Its collectives never interleave with the training loop's, which stay on the
  default group. Call ``wait()`` before ``destroy_process_group()``.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdptk._core.arguments import agree_arguments
from fsdptk._core.compat import dtensor_like, local_tensor
from fsdptk._core.dist import has_process_group, is_rank0, run_agreed, using_group
from fsdptk._files.common import Rename
from fsdptk._files.hf_config import stage_hf_config
from fsdptk._files.pending import REGISTRY, wait_for_pending
from fsdptk.conversions import ConversionArg
from fsdptk.nf4 import from_inner_tensors, inner_tensors, is_nf4

__all__ = ["PendingSave", "release_snapshot", "save_dcp_async", "save_safetensors_async"]

PathLike = str | os.PathLike[str]


class PendingSave:
    """A save running in the background; returned by :func:`save_safetensors_async` and
    :func:`save_dcp_async` on every rank.

    Examples:
        >>> import tempfile, torch
        >>> from fsdptk import save_safetensors_async
        >>> pending = save_safetensors_async(torch.nn.Linear(4, 2), tempfile.mkdtemp())
        >>> pending.wait().name, pending.done()
        ('model.safetensors', True)
    """

    def __init__(self, path: Path, what: str, started: float) -> None:
        self._path, self._what = path, what
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._started = started  # time.monotonic() at the call
        self._finished: float | None = None
        self._thread: threading.Thread | None = None

    def _start(self, group: Any, work: Callable[[], Path]) -> None:
        self._thread = threading.Thread(target=self._run, args=(group, work), daemon=False,
                                        name=f"fsdptk-{self._what}")
        REGISTRY.set(self)
        self._thread.start()

    def _run(self, group: Any, work: Callable[[], Path]) -> None:
        try:
            with using_group(group):
                self._result = work()
        except BaseException as e:  # noqa: BLE001 - kept for wait(), on every rank
            self._error = e
        finally:
            self._finished = time.monotonic()

    @property
    def path(self) -> Path:
        """The checkpoint being written (the ``path`` given)."""
        return self._path

    @property
    def seconds(self) -> float | None:
        """Seconds from the call to the end of the save; ``None`` while it runs."""
        return None if self._finished is None else self._finished - self._started

    def done(self) -> bool:
        """Whether the save has finished (successfully or not); never blocks."""
        return self._finished is not None

    def join(self) -> None:
        """Block until the save has finished; its outcome stays for :meth:`wait`."""
        if self._thread is not None:
            self._thread.join()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the save and return what the synchronous save returns, or raise its error.

        Not itself collective: every rank's save ends together, with the same outcome (an error
        on any rank is agreed in the background group and raised by every rank's ``wait()``; a
        rank that died makes the others' communication fail within seconds).

        Args:
            timeout: seconds to wait at most (``None``: until the save ends).

        Returns:
            Path: the index file or ``model.safetensors`` (safetensors), ``path`` (DCP).

        Raises:
            TimeoutError: the save is still running after ``timeout`` seconds (it goes on;
                call ``wait()`` again).
            Exception: the save's error (the lowest failing rank's, as the synchronous save
                raises it; ``RuntimeError`` naming the failed communication when a rank died).
        """
        if self._thread is not None:
            self._thread.join(timeout)
        if not self.done():
            raise TimeoutError(f"the background {self._what} to {str(self._path)!r} is still running "
                               f"after {timeout}s; call wait() again")
        self._observed = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error is not None else "done"
        return f"PendingSave({self._what}, {str(self._path)!r}, {state})"


# ----------------------------------------------------------------------------------------------
# the background group
class _Groups:
    """The gloo group of background saves, one per default process group (a World that rebuilt
    its default group gets a new one)."""

    def __init__(self) -> None:
        self._for: Any = None
        self._group: Any = None

    def get(self) -> Any:
        """The background group (creating it is collective); ``None`` without a process group."""
        if not has_process_group():
            return None
        default = dist.group.WORLD
        if self._for is not default:
            self._group = dist.new_group(backend="gloo")
            self._for = default
        return self._group


_GROUPS = _Groups()


# ----------------------------------------------------------------------------------------------
# the snapshot
_Layout = tuple[str, torch.Size, tuple[int, ...], torch.dtype, bool]  # name, shape, stride, dtype, pinned


class _KeptSnapshot:
    """This process's snapshot buffers, kept from one background save to the next.

    Design note (process state): like the pending save in :mod:`fsdptk._files.pending`, the kept
    snapshot is per process by nature (it is a copy of this rank's shards) and the calls that use
    it receive nothing that could carry it; one private object holds it. It holds at most one
    snapshot: a call takes the buffers out (:meth:`take`), reuses them in order while their layout
    matches and drops the rest at the first mismatch, before allocating anything, so a rank never
    holds more than the larger of the old and the new snapshot.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: list[tuple[_Layout, torch.Tensor]] = []

    def take(self) -> list[tuple[_Layout, torch.Tensor]]:
        """Hand the buffers over to a new snapshot (which gives them back with :meth:`keep`)."""
        with self._lock:
            out, self._buffers = self._buffers, []
            return out

    def keep(self, buffers: list[tuple[_Layout, torch.Tensor]]) -> None:
        with self._lock:
            self._buffers = buffers

    def release(self) -> int:
        """Drop the buffers; return their bytes."""
        with self._lock:
            out, self._buffers = self._buffers, []
        return sum(t.untyped_storage().nbytes() for _, t in out)


_KEPT = _KeptSnapshot()


def release_snapshot() -> int:
    """Drop this rank's kept snapshot buffers; return how many bytes they held.

    A background save copies this rank's local shards into CPU buffers that stay allocated after
    the save, so that the next background save with the same shard layout copies into them
    instead of allocating (and first-touching) new memory: that allocation is most of the time a
    first save blocks training. The cost is one CPU copy of this rank's shards (plus the
    optimizer state after :func:`save_dcp_async`) held between saves. Call this when the memory
    is needed more than the next save's speed (at the end of training, before an evaluation
    phase). Not collective and never blocks: a save still running keeps its buffers until it
    ends, and they are freed then. The next background save allocates anew.

    Returns:
        int: the bytes released (0 when nothing was kept).

    Examples:
        >>> import tempfile, torch
        >>> from fsdptk import release_snapshot, save_safetensors_async
        >>> _ = save_safetensors_async(torch.nn.Linear(4, 2, bias=False), tempfile.mkdtemp()).wait()
        >>> release_snapshot(), release_snapshot()
        (32, 0)
    """
    return _KEPT.release()


class _Snapshot:
    """Private copies of this rank's local shards: CPU memory, pinned when the source is on an
    accelerator; each tensor object copied once (tied tensors stay shared). The buffers come from
    the kept snapshot, in order, while their layout matches; the first mismatch drops the rest of
    it and the copies from there on go into new memory. :meth:`finish` keeps the buffers for the
    next save."""

    def __init__(self) -> None:
        self._done: dict[int, torch.Tensor] = {}
        self._old = _KEPT.take()
        self._new: list[tuple[_Layout, torch.Tensor]] = []
        self.on_accelerator = False

    def _buffer(self, name: str, t: torch.Tensor, pin: bool) -> torch.Tensor:
        layout: _Layout = (name, t.shape, tuple(t.stride()), t.dtype, pin)
        i = len(self._new)
        if i < len(self._old) and self._old[i][0] == layout:
            out = self._old[i][1]
        else:
            del self._old[i:]  # before allocating: never the old and the new snapshot at once
            out = torch.empty_like(t, device="cpu", pin_memory=pin, requires_grad=False)
        self._new.append((layout, out))
        return out

    def _copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if is_nf4(t):
            return from_inner_tensors([self._copy(f"{name}#{i}", p) for i, p in enumerate(inner_tensors(t))], t)
        pin = t.device.type != "cpu"
        self.on_accelerator = self.on_accelerator or pin
        out = self._buffer(name, t, pin)
        out.copy_(t.detach(), non_blocking=pin)
        return out

    def tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A private copy of ``t`` (a DTensor keeps its mesh, placements and global shape)."""
        if id(t) in self._done:
            return self._done[id(t)]
        local = local_tensor(t)
        if local.is_meta:
            raise ValueError(f"cannot save {name!r}: it is on the meta device (shape {list(t.shape)}); "
                             "load or initialise the model first")
        copied = self._copy(name, local)
        out = dtensor_like(t, copied) if isinstance(t, DTensor) else copied
        self._done[id(t)] = out
        return out

    def value(self, name: str, v: Any) -> Any:
        """A private copy of a state value: tensors copied, containers walked, the rest deep-copied."""
        if isinstance(v, torch.Tensor):
            return self.tensor(name, v)
        if isinstance(v, Mapping):
            return {k: self.value(f"{name}.{k}", x) for k, x in v.items()}
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(self.value(f"{name}.{i}", x) for i, x in enumerate(v))
        return copy.deepcopy(v)

    def finish(self) -> None:
        """Wait for the copies from an accelerator (they were issued non-blocking), and keep the
        buffers for the next save (those of the old snapshot it did not use are dropped)."""
        if self.on_accelerator:
            torch.accelerator.synchronize()
        self._old = []
        _KEPT.keep(self._new)


def _begin() -> Any:
    """Every rank: wait for this rank's pending save, then the group. The wait comes before any
    copy: the pending save's thread reads the kept snapshot's buffers until it ends, and the new
    snapshot reuses them."""
    wait_for_pending()
    return _GROUPS.get()


# ----------------------------------------------------------------------------------------------
# safetensors
def save_safetensors_async(
    model: nn.Module,
    path: PathLike,
    *,
    max_shard_size: int | str = "5GB",
    tied: Literal["omit", "both"] = "omit",
    dtype: torch.dtype | None = None,
    rename: Rename = None,
    metadata: Mapping[str, str] | None = None,
    bucket_bytes: int | None = None,
    progress: bool | None = None,
    write_config: bool = True,
    conversion: ConversionArg = "auto",
    writers: int | Literal["host"] = 1,
    quantize: Literal["fp8", "fp8-ue8m0", "mxfp4"] | None = None,
    block_size: tuple[int, int] | None = (128, 128),
    quantize_if: Callable[[str, torch.Tensor], bool] | None = None,
) -> PendingSave:
    """Start :func:`fsdptk.save_safetensors` in the background; return once the model is copied.

    Call on every rank. The call waits for a pending background save of this process (a rank
    holds one snapshot at most), checks the arguments and plans the files as the synchronous save
    does, stages the Hugging Face config files (rank 0), and copies this rank's local shards into
    private CPU memory (pinned for accelerator shards). Then it returns: the model and its
    optimizer may change at once. That memory stays allocated after the save and the next
    background save copies into it when the shards' layout is unchanged (only the first save
    allocates; :func:`release_snapshot` frees it). A thread gathers the snapshot to rank 0 bucket by bucket and
    streams it into the files, on fsdptk's own gloo process group, with the synchronous save's
    memory bound (one bucket beyond the snapshot on rank 0), lock and crash-safe commit: a failed
    or killed save leaves the previous checkpoint loadable.

    Args:
        model: the model (FSDP2-sharded, tensor-parallel, NF4, or plain).
        path: the output directory.
        max_shard_size: as :func:`fsdptk.save_safetensors`.
        tied: as :func:`fsdptk.save_safetensors`.
        dtype: as :func:`fsdptk.save_safetensors` (the cast happens in the background).
        rename: as :func:`fsdptk.save_safetensors`.
        metadata: as :func:`fsdptk.save_safetensors`.
        bucket_bytes: full-tensor bytes gathered per step in the background (default: the
            engine's, 16 MiB).
        progress: as :func:`fsdptk.save_safetensors`.
        write_config: as :func:`fsdptk.save_safetensors` (staged during the call, renamed into
            place after the weights commit).
        conversion: as :func:`fsdptk.save_safetensors`: ``"auto"`` writes a transformers
            model in the layout its ``save_pretrained`` writes (per-expert MoE tensors), the
            model tensors split back in the background as they are gathered; ``None`` the
            model's own keys.
        writers: as :func:`fsdptk.save_safetensors`: several ranks gather and write the files
            in the background, each its own (agreed during the call; the commit waits for every
            writer's fsync).
        quantize: as :func:`fsdptk.save_safetensors` (``"fp8"``, ``"fp8-ue8m0"``, ``"mxfp4"``):
            the layout and the ``quantization_config`` are planned during the call, each tensor is
            quantized in the background on its writer as it is gathered from the snapshot.
        block_size: as :func:`fsdptk.save_safetensors`.
        quantize_if: as :func:`fsdptk.save_safetensors` (called during the call).

    Returns:
        PendingSave: ``wait()`` returns the index file or ``model.safetensors``.

    Raises:
        ValueError, TypeError: bad arguments, a tensor on ``meta``; ranks that passed different
            values of an argument :func:`fsdptk.save_safetensors` agrees (``writers``,
            ``conversion``, ...: a ValueError naming it and every rank's value); on every rank,
            during the call (nothing started).
        OSError: rank 0 cannot stage the config files; on every rank, during the call.
        Exception: every error of the save itself (a lock held by another writer, a full disk,
            a failed read, a dead rank) is raised by ``wait()``, on every rank.

    Examples:
        >>> import tempfile, torch
        >>> from safetensors.torch import load_file
        >>> from fsdptk import save_safetensors_async
        >>> model, d = torch.nn.Linear(4, 2), tempfile.mkdtemp()
        >>> before = model.weight.detach().clone()
        >>> pending = save_safetensors_async(model, d)
        >>> with torch.no_grad():
        ...     _ = model.weight.add_(1.0)  # training goes on
        >>> torch.equal(load_file(pending.wait())["weight"], before)
        True
        >>> save_safetensors_async(model, d, writers="host").wait().name  # one writer per host
        'model.safetensors'
    """
    from fsdptk._files.save import plan_save, write_save
    from fsdptk._plans.hub_items import quantized_layout, save_items

    started = time.monotonic()
    group = _begin()
    agree_arguments("save_safetensors_async", writers=writers, conversion=conversion,
                    max_shard_size=max_shard_size, tied=tied, dtype=dtype, rename=rename, metadata=metadata,
                    bucket_bytes=bucket_bytes, quantize=quantize, block_size=block_size, quantize_if=quantize_if)
    layout = run_agreed(lambda: quantized_layout(model, conversion, quantize=quantize, block_size=block_size,
                                                 quantize_if=quantize_if, dtype=dtype))
    items, dtypes = save_items(model, tied, dtype)
    plan = plan_save(items, dtypes, path, max_shard_size=max_shard_size, rename=rename, metadata=metadata,
                      bucket_bytes=bucket_bytes, progress=progress, conversion=layout.nodes, writers=writers,
                      written=layout.written)

    def take() -> list[tuple[str, torch.Tensor]]:
        snap = _Snapshot()
        items = [(k, snap.tensor(k, t)) for k, t in plan.items]
        snap.finish()
        return items

    items = run_agreed(take)
    plan = dataclasses.replace(plan, items=items)

    def stage() -> Any:
        return stage_hf_config(model, plan.path, dtype=dtype, quantization_config=layout.quantization_config)

    staged = run_agreed(stage, on=write_config and is_rank0())

    def work() -> Path:
        try:
            return write_save(plan, lambda: staged)
        except BaseException:
            if staged is not None:  # e.g. the lock was held: nothing took the staged files
                staged.abort()
            raise

    pending = PendingSave(plan.path, "save_safetensors", started)
    pending._start(group, work)
    return pending


# ----------------------------------------------------------------------------------------------
# DCP
def save_dcp_async(
    model: nn.Module,
    path: PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> PendingSave:
    """Start :func:`fsdptk.save_dcp` in the background; return once model and optimizer are copied.

    Call on every rank. The call waits for a pending background save of this process, takes the
    state as :func:`fsdptk.save_dcp` does (DCP's ``get_state_dict``) and copies every tensor of
    it, the optimizer state included, into private CPU memory (pinned for accelerator tensors);
    then it returns and the optimizer may step. That memory is kept for the next background save,
    as :func:`save_safetensors_async` keeps it (:func:`release_snapshot` frees it). A thread writes the snapshot with
    ``torch.distributed.checkpoint`` on fsdptk's own gloo group, staged beside ``path`` with its
    lock held and swapped in atomically, as the synchronous save.

    Args:
        model: the (sharded) model.
        path: the checkpoint directory (replaced as a whole).
        optimizer: its optimizer, if its state is to be saved.
        extra: plain extra state, as :func:`fsdptk.save_dcp` (serialised during the call).

    Returns:
        PendingSave: ``wait()`` returns ``path``.

    Raises:
        TypeError, ValueError: as :func:`fsdptk.save_dcp` (a ValueError when the ranks disagree on
            whether an optimizer or ``extra`` is given), on every rank, during the call.
        Exception: every error of the write itself (a lock held by another writer, an
            unwritable directory, a dead rank) is raised by ``wait()``, on every rank.

    Examples:
        >>> import tempfile, torch
        >>> from fsdptk import save_dcp_async, load_dcp
        >>> model, d = torch.nn.Linear(3, 2), tempfile.mkdtemp() + "/step_10"
        >>> pending = save_dcp_async(model, d, extra={"step": 10})
        >>> pending.wait() == Path(d)
        True
        >>> load_dcp(torch.nn.Linear(3, 2), d)
        {'step': 10}
    """
    from fsdptk.dcp import dcp_state, write_dcp

    started = time.monotonic()
    group = _begin()
    path, state = dcp_state(model, path, optimizer, extra, call="save_dcp_async")

    def take() -> dict[str, Any]:
        snap = _Snapshot()
        out = {k: (v if k == "extra" else snap.value(k, v)) for k, v in state.items()}
        snap.finish()
        return out

    snapshot = run_agreed(take)  # the thread keeps only the snapshot, never the live state
    pending = PendingSave(path, "save_dcp", started)
    pending._start(group, lambda: write_dcp(snapshot, path))
    return pending


# ----------------------------------------------------------------------------------------------
# process exit
def _at_exit() -> None:
    """Wait for a pending save at exit; report its error if nobody called ``wait()``."""
    pending = REGISTRY.get()
    if pending is None:
        return
    pending.join()
    if isinstance(pending, PendingSave) and pending._error is not None and not pending._observed:
        print(f"fsdptk: the background save to {str(pending.path)!r} failed and nobody called "
              f"wait(): {type(pending._error).__name__}: {pending._error}", file=sys.stderr)


atexit.register(_at_exit)

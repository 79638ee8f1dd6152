"""Sharded checkpoints for resuming (``torch.distributed.checkpoint``) and offline converters.

- :func:`save_dcp` / :func:`load_dcp`: model + optimizer + extra state in one DCP directory, thin
  over ``torch.distributed.checkpoint`` and its ``state_dict`` API (each rank writes and reads its
  own shards; a different world size or mesh on load is resharded by DCP). The directory is staged
  under a unique hidden name beside ``path``, with ``path``'s lock held, and swapped in at the end
  (:mod:`fsdptk._files.commit`), so a failed or killed save leaves the previous one loadable.
- Reading runs no code from the checkpoint: ``.metadata`` is unpickled by an unpickler that builds
  only DCP metadata types, and non-tensor values (``extra``, optimizer hyper-parameters) are read
  with ``torch.load(weights_only=True)`` (:mod:`fsdptk._files.safe_pickle`).
- :func:`dcp_to_safetensors` / :func:`safetensors_to_dcp`: offline, single process, memory-bounded
  (a bounded batch of tensors in memory at a time) converters between a DCP directory and a
  Hugging Face safetensors directory. ``python -m fsdptk convert`` calls them.

Layout of a DCP checkpoint written here: the model state under ``model.<fqn>``, the optimizer
state (``get_optimizer_state_dict`` layout, keyed by parameter FQN) under ``optim.``, and the extra
state as one ``torch.save`` blob under ``extra`` (plain data only: it is read back with
``weights_only=True``).
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdptk import errors
from fsdptk._core.arguments import agree_arguments
from fsdptk._core.calls import old_form
from fsdptk._core.dist import all_gather_object, comm_group, has_process_group, is_rank0, run_agreed
from fsdptk._core.dist import world as _world
from fsdptk._engine.layouts import box_shape, full_box
from fsdptk._engine.sources.convert import ConvertedSource, Unconverter
from fsdptk._files.commit import dcp_backup, dcp_names, recover_dcp, swap_in_dcp
from fsdptk._files.common import progress_bar, trim_heap
from fsdptk._files.lock import DirectoryLock
from fsdptk._files.paths import check_disjoint
from fsdptk._files.pending import wait_for_pending
from fsdptk._files.safe_pickle import safe_load_planner, safe_reader
from fsdptk._files.safetensors_io import SafetensorsCheckpoint, parse_size
from fsdptk._files.safetensors_writer import ShardedWriter
from fsdptk._plans.hub_items import resolve_save
from fsdptk._plans.peft_wrappers import dcp_factor_views, restore_factors
from fsdptk.conversions import resolve_load
from fsdptk.errors import ConversionError, StateDictMismatchError

__all__ = [
    "save_dcp",
    "load_dcp",
    "dcp_to_safetensors",
    "safetensors_to_dcp",
]

PathLike = str | os.PathLike[str]
_BATCH_BYTES = 256 * 2**20  # converters: tensor bytes read per DCP load call


class _Staging:
    """Rank 0's side of writing a DCP directory: ``path``'s lock, recovery of what a killed save
    left, a staging directory unique to this save, and the swap at the end."""

    def __init__(self, path: Path) -> None:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(f"checkpoint target {str(path)!r} exists and is not a directory")
        names = dcp_names(path)
        self.path = path
        self.stage = path.parent / f"{names['stage']}{uuid.uuid4().hex[:12]}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.lock = DirectoryLock(path.parent / names["lock"], path)
            self.lock.acquire()
        except OSError as e:
            if isinstance(e, BlockingIOError):
                raise
            raise type(e)(e.errno, f"cannot write checkpoint {str(path)!r} (staging in "
                                   f"{str(self.stage)!r}): {e.strerror}") from e
        try:
            recover_dcp(path)
            self.stage.mkdir()
        except BaseException:
            self.lock.release()
            raise

    def commit(self) -> None:
        """Swap the staged directory in (crash-safe) and release the lock."""
        try:
            swap_in_dcp(self.stage, self.path, self.stage.name.rsplit("-", 1)[1])
        except BaseException:
            recover_dcp(self.path)  # put the previous checkpoint back, drop the staging directory
            raise
        finally:
            self.lock.release()

    def abort(self) -> None:
        """Delete the staging directory and release the lock (``path`` untouched)."""
        try:
            shutil.rmtree(self.stage, ignore_errors=True)
        finally:
            self.lock.release()


def _begin_staging(path: Path) -> tuple[_Staging | None, Path]:
    """Every rank: rank 0 takes the lock and stages; all agree on errors and on the staging name."""
    staging: _Staging | None = run_agreed(lambda: _Staging(path), on=is_rank0())
    return staging, Path(all_gather_object(str(staging.stage) if staging else None)[0])


def _readable_dir(path: Path) -> Path:
    """``path``, or the backup a save killed between its two renames left (``path`` missing)."""
    backup = dcp_backup(path)
    return backup if backup is not None else path


def _quiet_dcp(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a DCP entry point without its warnings; its ``CheckpointException`` (a BaseException
    whose message is a traceback) becomes the lowest failing rank's own exception, on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        try:
            return fn(*args, **kwargs)
        except CheckpointException as e:
            failures = getattr(e, "failures", None) or {}
            if not failures:
                raise
            rank = min(failures)
            exc = failures[rank][0]
            if not isinstance(exc, Exception):
                raise
            if _world()[0] > 1:
                exc.add_note(f"(raised on rank {rank} inside torch.distributed.checkpoint)")
            raise exc from None


def _extra_blob(extra: Any) -> io.BytesIO:
    """``extra`` as a ``torch.save`` blob, checked to load back with ``weights_only=True``."""
    blob = io.BytesIO()
    try:
        torch.save(extra, blob)
        torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal means load_dcp could not read it back
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else "")
        raise TypeError("extra must hold only tensors, numbers, strings, bools, None and lists, tuples "
                        "and dicts of them (load_dcp reads it with torch.load(weights_only=True), which "
                        f"runs no code from the file); {type(e).__name__}: {detail}") from None
    blob.seek(0)
    return blob


def _dist_kwargs() -> dict[str, Any]:
    return {"no_dist": not has_process_group()}


# ----------------------------------------------------------------------------------------------
# save / load for resuming
def _check_order(fn: str, model: Any, path: Any, rest: str) -> None:
    """TypeError for the old argument order ``fn(path, model, ...)`` (or a non-module model)."""
    if isinstance(model, (str, os.PathLike)) and isinstance(path, nn.Module):
        raise old_form(fn, "takes the model first", f"model, path{rest}", f"path, model{rest}",
                       f" (got path={str(model)!r} first and a {type(path).__name__} second)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}(model, path{rest}): model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{fn}(model, path{rest}): path must be a str or os.PathLike, got {type(path).__name__}")


def save_dcp(
    model: nn.Module,
    path: PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save model, optimizer and extra state as a DCP checkpoint directory (every rank calls it).

    Each rank writes its own shards (no gather). The state is taken with
    ``torch.distributed.checkpoint.state_dict.get_state_dict``, so it can be loaded back at another
    world size or mesh. ``path`` must be on a filesystem every rank sees, and is replaced as a whole.

    Crash safety: rank 0 takes the lock ``.<name>.fsdptk.lock`` beside ``path`` (a second writer
    fails at once), finishes or cleans what a killed save left, and the checkpoint is staged in
    ``.<name>.fsdptk-stage-<token>`` (unique per save). At the end the staging directory and
    ``path`` are swapped atomically (``renameat2(RENAME_EXCHANGE)``); where the filesystem cannot,
    ``path`` is renamed to ``.<name>.fsdptk-old-<token>`` first, and a save killed between the two
    renames leaves that backup, which :func:`load_dcp` reads and the next save renames back. A
    failed save deletes its staging directory and leaves ``path`` as it was.

    Args:
        model: the (sharded) model.
        path: the checkpoint directory.
        optimizer: its optimizer, if its state is to be saved.
        extra: plain extra state (step, data loader position, ``torch.get_rng_state()``, ...):
            tensors, numbers, strings, bools, None, and lists, tuples and dicts of them (it is read
            back with ``torch.load(weights_only=True)``).

    Returns:
        Path: ``path``.

    Raises:
        TypeError: ``extra`` holds other objects (e.g. a numpy array), on every rank; ``model`` is
            not an ``nn.Module`` or ``path`` not a path, or the arguments are in the old order
            ``save_dcp(path, model, ...)`` (the message says how to call it now).
        ValueError: some ranks pass an ``optimizer`` (or ``extra``) and others do not (names the
            argument and every rank's value), on every rank, before anything is taken or written.
        CheckpointLockedError: another writer holds ``path``'s lock (a ``BlockingIOError`` naming
            its pid, host and start time), on every rank.
        OSError: the directory cannot be written (on every rank).

    Examples:
        >>> import tempfile, torch
        >>> from fsdptk import save_dcp, load_dcp
        >>> d = tempfile.mkdtemp() + "/step_10"
        >>> model = torch.nn.Linear(3, 2)
        >>> _ = save_dcp(model, d, extra={"step": 10})
        >>> load_dcp(torch.nn.Linear(3, 2), d)
        {'step': 10}
    """
    wait_for_pending()
    path, state = dcp_state(model, path, optimizer, extra)
    return write_dcp(state, path)


def _given(value: Any) -> str | None:
    """Whether an optional argument is given (its type), the form agreed across ranks where its
    presence changes what is exchanged and its value may differ per rank."""
    return None if value is None else type(value).__qualname__


def dcp_state(model: nn.Module, path: PathLike, optimizer: torch.optim.Optimizer | None,
               extra: dict[str, Any] | None, *, call: str = "save_dcp") -> tuple[Path, dict[str, Any]]:
    """The front half of :func:`save_dcp` (``call`` names it in errors): the presence of
    ``optimizer`` and ``extra`` agreed across ranks (they add entries every rank's DCP plan must
    have), arguments checked, DCP's state of the model and optimizer taken, ``extra`` serialised;
    each step agreed on every rank. Package-internal (not in ``__all__``): :mod:`fsdptk.background`
    snapshots what it returns."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    agree_arguments(call, optimizer=_given(optimizer), extra=_given(extra))
    run_agreed(lambda: _check_order("save_dcp", model, path, ", optimizer, extra=..."))
    path = Path(path)
    # local steps between collectives: a failure on one rank is raised on every rank
    state: dict[str, Any] = run_agreed(lambda: _take_state(model, optimizer, get_state_dict,
                                                           get_model_state_dict))
    run_agreed(lambda: dcp_factor_views(model, state))  # LoRA B on experts: (out, r, E), one box a rank
    if extra is not None:
        state["extra"] = run_agreed(lambda: _extra_blob(extra))
    return path, state


def write_dcp(state: dict[str, Any], path: Path) -> Path:
    """The back half of :func:`save_dcp`: stage, write ``state`` with DCP (on ``comm_group()``),
    swap in. Collective. Package-internal (not in ``__all__``), used by :mod:`fsdptk.background`."""
    import torch.distributed.checkpoint as dcp

    staging, stage = _begin_staging(path)
    try:
        _quiet_dcp(dcp.save, state, storage_writer=dcp.FileSystemWriter(str(stage)),
                   process_group=comm_group(), **_dist_kwargs())
    except BaseException:
        if staging is not None:
            staging.abort()
        raise
    run_agreed(lambda: staging.commit() if staging is not None else None, on=staging is not None)
    return path


def _take_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, get_state_dict: Any,
                get_model_state_dict: Any) -> dict[str, Any]:
    """DCP's (sharded) state of the model and optimizer, as ``{"model": ..., "optim": ...}``."""
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optim": osd}
    return {"model": get_model_state_dict(model)}


def _dcp_keys(path: Path) -> dict[str, Any]:
    """The entries of a DCP directory's metadata, read safely; its data files checked to exist."""
    if not os.path.lexists(path / ".metadata"):
        raise FileNotFoundError(f"{str(path)!r} is not a DCP checkpoint directory (no .metadata)")
    return dict(safe_reader(path).read_metadata().state_dict_metadata)


def _check_model_keys(model: nn.Module, msd: dict[str, Any], keys: dict[str, Any]) -> None:
    """StateDictMismatchError when the model's state keys and the checkpoint's ``model.*`` differ."""
    saved = [k[len("model."):] for k in keys if k.startswith("model.")]

    def covered(key: str, names: Any) -> bool:  # DCP flattens a nested value to "key.sub"
        return key in names or any(n.startswith(key + ".") for n in names)

    missing = [k for k in msd if not covered(k, saved)]
    unexpected = [k for k in saved if k not in msd and not any(k.startswith(m + ".") for m in msd)]
    if missing or unexpected:
        raise StateDictMismatchError.for_keys(missing, unexpected, type(model).__name__)


def _readable_keys(path: Path) -> tuple[Path, dict[str, Any]]:
    readable = _readable_dir(path)
    return readable, _dcp_keys(readable)


def load_dcp(
    model: nn.Module,
    path: PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_dcp` into a (sharded) model and optimizer.

    Every rank calls it; each reads only the pieces of its own shards (DCP reshards when the world
    size or mesh differs from the save). No code from the files runs: ``.metadata`` is unpickled
    with an allow-list of DCP metadata types, ``extra`` and other non-tensor values with
    ``torch.load(weights_only=True)``. If a save was killed between its two renames (``path``
    missing), the previous checkpoint is read from its backup beside ``path``.

    Args:
        model: the model, sharded as it will be trained (materialised, not on ``meta``: use
            :func:`fsdptk.materialize`, never a bare ``to_empty``, whose non-persistent buffers
            would hold uninitialised memory that no checkpoint restores).
        path: the checkpoint directory.
        optimizer: the optimizer to restore (its state must be in the checkpoint).
        strict: every model key must be in the checkpoint and vice versa (checked on every rank
            before anything is read or changed).

    Returns:
        dict: the ``extra`` state given to :func:`save_dcp` (``{}`` if none).

    Raises:
        FileNotFoundError: ``path`` is not a DCP directory, or a data file it names is missing
            (every rank).
        CheckpointError: an optimizer is given but the checkpoint has no optimizer state; the
            metadata holds types other than DCP metadata, names a data file outside the directory
            or one that is not a regular file; a non-tensor value is not plain data.
        StateDictMismatchError: ``strict=True`` and the model's keys differ from the checkpoint's
            (``missing_keys`` / ``unexpected_keys``, torch's strict message), on every rank, before
            the model changes.
        TypeError: ``model`` is not an ``nn.Module`` or ``path`` not a path, or the arguments are
            in the old order ``load_dcp(path, model, ...)`` (the message says how to call it).
        ValueError: some ranks pass an ``optimizer`` and others do not, or ``strict`` differs
            (names the argument and every rank's value), on every rank, before anything is read.

    Examples:
        See :func:`save_dcp`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    agree_arguments("load_dcp", optimizer=_given(optimizer), strict=strict)
    run_agreed(lambda: _check_order("load_dcp", model, path, ", optimizer"))
    wait_for_pending(path)
    path, keys = run_agreed(lambda: _readable_keys(Path(path)))
    has_optim = any(k.startswith("optim.") for k in keys)
    if optimizer is not None and not has_optim:
        raise errors.CheckpointError(f"{str(path)!r} holds no optimizer state (no 'optim.*' entries); "
                              "pass optimizer=None or load another checkpoint")
    options = StateDictOptions(strict=strict)
    # local steps between collectives: a failure on one rank is raised on every rank
    state: dict[str, Any] = run_agreed(lambda: _take_state(model, optimizer, get_state_dict,
                                                           get_model_state_dict))
    if strict:
        run_agreed(lambda: _check_model_keys(model, state["model"], keys))
    # LoRA B on experts read as (out, r, E) views of the model's own storage, then put back
    replaced = run_agreed(lambda: dcp_factor_views(model, state, keys))
    if "extra" in keys:
        state["extra"] = io.BytesIO()
    _quiet_dcp(dcp.load, state, storage_reader=safe_reader(path),
               planner=safe_load_planner(allow_partial_load=not strict), **_dist_kwargs())
    restore_factors(state, replaced)
    if optimizer is not None:
        run_agreed(lambda: set_state_dict(model, optimizer, model_state_dict=state["model"],
                                          optim_state_dict=state["optim"], options=options))
    else:
        run_agreed(lambda: set_model_state_dict(model, state["model"], options=options))
    extra = state.get("extra")  # the safe planner has read it (weights_only=True)
    return {} if extra is None or isinstance(extra, io.BytesIO) else extra


# ----------------------------------------------------------------------------------------------
# offline converters
def _tensor_keys(meta: dict[str, Any], prefix: str | None, src: Path) -> dict[str, str]:
    """``{output key: DCP key}`` of the tensors under ``prefix`` (stripped)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, md in meta.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        if prefix is None:
            out[key] = key
        elif key.startswith(prefix):
            out[key[len(prefix):]] = key
    if not out:
        tops = sorted({k.split(".", 1)[0] + "." for k in meta})
        raise errors.CheckpointError(f"no tensor under prefix {prefix!r} in DCP checkpoint {str(src)!r} "
                              f"(top-level prefixes: {tops}); pass prefix=None for every tensor")
    return out


def _batches(keys: Sequence[str], nbytes: dict[str, int], limit: int) -> Iterator[list[str]]:
    batch: list[str] = []
    used = 0
    for k in keys:
        if batch and used + nbytes[k] > limit:
            yield batch
            batch, used = [], 0
        batch.append(k)
        used += nbytes[k]
    if batch:
        yield batch


def dcp_to_safetensors(
    src: PathLike,
    dst: PathLike,
    *,
    max_shard_size: int | str = "5GB",
    prefix: str | None = "model.",
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    model: nn.Module | None = None,
) -> Path:
    """Convert a DCP checkpoint directory to a Hugging Face safetensors directory, offline.

    One process; at most ~256 MiB of tensors (or one tensor, if larger) in memory at a time: each
    batch is read with a partial ``dcp.load`` and streamed into the shard files. Atomic like
    :func:`fsdptk.save_safetensors`.

    Args:
        src: a DCP directory (with ``.metadata``), e.g. from :func:`save_dcp`.
        dst: the output directory.
        max_shard_size: bytes per safetensors file (int or ``"5GB"``-style string).
        prefix: only tensors whose DCP key starts with it, with it stripped (``"model."``: the model
            state of :func:`save_dcp`); ``None``: every tensor, keys unchanged.
        dtype: cast floating tensors to this dtype.
        progress: tqdm bar of bytes (``None``: only on a terminal).
        model: the model the DCP checkpoint holds (built on ``meta`` is enough, e.g.
            :func:`fsdptk.hf.hf_meta_model` of the directory's ``config.json``): a transformers
            model's tensors are then written in the layout its ``save_pretrained`` writes (the Hub
            layout: per-expert MoE tensors), as :func:`fsdptk.save_safetensors` does
            (docs/layouts.md). ``None``: the DCP keys as they are.

    Returns:
        Path: the index file, or the single ``model.safetensors``.

    Raises:
        ValueError: ``dst`` is ``src``, inside it, or contains it.
        FileNotFoundError: ``src`` is not a DCP directory, or a data file is missing.
        CheckpointError: no tensor under ``prefix``; unsafe or corrupt metadata.
        OSError: ``dst`` cannot be written or another writer holds its lock (nothing of the new
            checkpoint is left behind).

    Examples:
        >>> import tempfile, torch
        >>> from fsdptk import save_dcp, dcp_to_safetensors, SafetensorsCheckpoint
        >>> d = tempfile.mkdtemp()
        >>> _ = save_dcp(torch.nn.Linear(3, 2), f"{d}/dcp")
        >>> dcp_to_safetensors(f"{d}/dcp", f"{d}/hf").name
        'model.safetensors'
        >>> sorted(SafetensorsCheckpoint(f"{d}/hf"))
        ['bias', 'weight']
    """
    import torch.distributed.checkpoint as dcp

    src, dst = Path(src), Path(dst)
    check_disjoint(src, dst)
    src = _readable_dir(src)
    meta = _dcp_keys(src)
    names = _tensor_keys(meta, prefix, src)
    stored = {k: meta[v].properties.dtype for k, v in names.items()}
    out_dtype = {k: dtype if dtype is not None and d.is_floating_point else d for k, d in stored.items()}
    shapes = {k: tuple(meta[v].size) for k, v in names.items()}
    nodes = None if model is None else resolve_save(model, "auto", {k: (shapes[k], stored[k]) for k in names})
    if nodes is not None:
        lacking = sorted(set(nodes) - set(names))
        if lacking:
            raise errors.CheckpointError(f"{str(src)!r} lacks tensors of the model: {lacking[:8]}")
    entries = [(k, out_dtype[k], shapes[k]) for k in names]
    if nodes is not None:
        entries = [(leaf, out_dtype[k], box_shape(box)) for k in names if k in nodes
                   for leaf, box in nodes[k].leaves(full_box(nodes[k].shape))]
        entries += [(k, out_dtype[k], shapes[k]) for k in names if k not in nodes]
    split = Unconverter(nodes) if nodes is not None else None
    writer = ShardedWriter(dst, entries, max_shard_size=max_shard_size)
    nbytes = {k: torch.Size(shapes[k]).numel() * stored[k].itemsize for k in names}
    reader = safe_reader(src)
    try:
        with progress_bar(writer.total_size, f"convert {src.name}", progress) as bar:
            for batch in _batches(list(names), nbytes, min(_BATCH_BYTES, parse_size(max_shard_size))):
                sd = {names[k]: torch.empty(shapes[k], dtype=stored[k]) for k in batch}
                _quiet_dcp(dcp.load, sd, storage_reader=reader,
                           planner=safe_load_planner(allow_partial_load=True), no_dist=True)
                for k in batch:
                    full = sd.pop(names[k]).to(out_dtype[k])
                    pieces = split.feed(k, full) if split is not None and k in split.nodes else [(k, full)]
                    for name, piece in pieces:
                        bar.update(writer.write(name, piece.contiguous()))
                    del full, pieces
                trim_heap()
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def _lazy_planner(ckpt: Any, prefix: str, bar: Any) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    class _LazyPlanner(dcp.DefaultSavePlanner):
        """Plans from meta tensors; reads each tensor from the file only when DCP writes it."""

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            tensor = ckpt[write_item.index.fqn[len(prefix):]]
            bar.update(tensor.numel() * tensor.element_size())
            return tensor

    return _LazyPlanner()


def safetensors_to_dcp(
    src: PathLike,
    dst: PathLike,
    *,
    prefix: str = "model.",
    progress: bool | None = None,
    model: nn.Module | None = None,
) -> Path:
    """Convert a safetensors checkpoint (file or HF directory) to a DCP directory, offline.

    One process; DCP plans from metadata only and each tensor is read from the file when it is
    written, one at a time. The result loads with :func:`load_dcp` (keys under ``prefix``) into a
    model of any world size.

    Args:
        src: a ``.safetensors`` file, an index, or an HF checkpoint directory.
        dst: the DCP directory to write (replaced as a whole, crash-safe as :func:`save_dcp`).
        prefix: prepended to every key (``"model."`` matches :func:`save_dcp`; ``""`` for none).
        progress: tqdm bar of bytes (``None``: only on a terminal).
        model: the model the checkpoint is for (built on ``meta`` is enough, e.g.
            :func:`fsdptk.hf.hf_meta_model` of the directory): a transformers model's Hub layout
            (per-expert MoE tensors) is then stored under the model's own keys (fused experts), as
            :func:`fsdptk.load_safetensors` reads it, so the DCP checkpoint loads with
            :func:`load_dcp` into that model (docs/layouts.md). ``None``: the file keys as they are.

    Returns:
        Path: ``dst``.

    Raises:
        ValueError: ``dst`` is ``src``, inside it, or contains it.
        FileNotFoundError, CheckpointError: ``src`` missing, corrupt or inconsistent.
        OSError: ``dst`` cannot be written, or another writer holds its lock.

    Examples:
        >>> import tempfile, torch
        >>> from fsdptk import save_safetensors, safetensors_to_dcp, load_dcp
        >>> d = tempfile.mkdtemp()
        >>> src = torch.nn.Linear(3, 2)
        >>> _ = save_safetensors(src, f"{d}/hf")
        >>> _ = safetensors_to_dcp(f"{d}/hf", f"{d}/dcp")
        >>> dst = torch.nn.Linear(3, 2)
        >>> load_dcp(dst, f"{d}/dcp")
        {}
        >>> torch.equal(dst.weight, src.weight)
        True
    """
    import torch.distributed.checkpoint as dcp

    src, dst = Path(src), Path(dst)
    check_disjoint(src, dst)
    with SafetensorsCheckpoint(src) as ckpt:
        view: Any = ckpt
        if model is not None:
            nodes = resolve_load(model, "auto", {k: (tuple(ckpt.shape(k)), ckpt.dtype(k)) for k in ckpt})
            if nodes is not None:
                view = ConvertedSource(ckpt, nodes, error=ConversionError)
        meta_sd = {prefix + k: torch.empty(view.meta(k).shape if view is not ckpt else ckpt.shape(k),
                                           dtype=view.meta(k).dtype if view is not ckpt else ckpt.dtype(k),
                                           device="meta")
                   for k in view}
        staging = _Staging(dst)
        try:
            with progress_bar(ckpt.total_size, f"convert {src.name}", progress) as bar:
                _quiet_dcp(dcp.save, meta_sd,
                           storage_writer=dcp.FileSystemWriter(str(staging.stage), thread_count=1),
                           planner=_lazy_planner(view, prefix, bar), no_dist=True)
        except BaseException:
            staging.abort()
            raise
        staging.commit()
    return dst


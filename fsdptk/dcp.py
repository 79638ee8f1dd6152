"""Sharded checkpoints for resuming (``torch.distributed.checkpoint``) and offline converters.

- :func:`save_dcp` / :func:`load_dcp`: model + optimizer + extra state in one DCP directory, thin
  over ``torch.distributed.checkpoint`` and its ``state_dict`` API (each rank writes and reads its
  own shards; a different world size or mesh on load is resharded by DCP). The directory is written
  under a temporary name and swapped in at the end, so a failed save leaves the previous one.
- :func:`dcp_to_safetensors` / :func:`safetensors_to_dcp`: offline, single process, memory-bounded
  (a bounded batch of tensors in memory at a time) converters between a DCP directory and a
  Hugging Face safetensors directory. ``python -m fsdptk convert`` calls them.

Layout of a DCP checkpoint written here: the model state under ``model.<fqn>``, the optimizer
state (``get_optimizer_state_dict`` layout, keyed by parameter FQN) under ``optim.``, and the extra
state as one pickled object under ``extra``.
"""

from __future__ import annotations

import io
import os
import shutil
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdptk._checkpoint_common import _world, progress_bar, run_agreed, trim_heap
from fsdptk._safetensors_io import CheckpointError, SafetensorsCheckpoint, parse_size
from fsdptk._safetensors_writer import ShardedWriter

__all__ = [
    "save_dcp",
    "load_dcp",
    "dcp_to_safetensors",
    "safetensors_to_dcp",
    "convert_dcp_to_safetensors",
    "convert_safetensors_to_dcp",
]

PathLike = str | os.PathLike[str]
_BATCH_BYTES = 256 * 2**20  # converters: tensor bytes read per DCP load call


def _tmp_dir(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{tag}"


def _prepare_dir(path: Path) -> Path:
    """Create an empty staging directory beside ``path`` (which may not be a file)."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"checkpoint target {str(path)!r} exists and is not a directory")
    tmp = _tmp_dir(path, "dcp-tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise type(e)(e.errno, f"cannot write checkpoint {str(path)!r} (staging in {str(tmp)!r}): "
                               f"{e.strerror}") from e
    return tmp


def _swap_in(tmp: Path, path: Path) -> None:
    """Replace ``path`` by ``tmp`` (the old directory is removed only once the new one is there)."""
    old = _tmp_dir(path, "dcp-old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _quiet_dcp(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        return fn(*args, **kwargs)


def _dist_kwargs() -> dict[str, Any]:
    return {"no_dist": not _pg_initialised()}


def _pg_initialised() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


# ----------------------------------------------------------------------------------------------
# save / load for resuming
def save_dcp(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save model, optimizer and extra state as a DCP checkpoint directory (every rank calls it).

    Each rank writes its own shards (no gather). The state is taken with
    ``torch.distributed.checkpoint.state_dict.get_state_dict``, so it can be loaded back at another
    world size or mesh. The checkpoint is staged in a hidden sibling directory and renamed to
    ``path`` at the end; a failed save leaves any previous ``path`` intact. ``path`` must be on a
    filesystem every rank sees, and is replaced as a whole.

    Args:
        path: the checkpoint directory.
        model: the (sharded) model.
        optimizer: its optimizer, if its state is to be saved.
        extra: picklable extra state (step, data loader position, RNG states, ...).

    Returns:
        Path: ``path``.

    Raises:
        OSError: the directory cannot be written (on every rank).

    Example:
        >>> import tempfile, torch
        >>> from fsdptk import save_dcp, load_dcp
        >>> d = tempfile.mkdtemp() + "/step_10"
        >>> model = torch.nn.Linear(3, 2)
        >>> _ = save_dcp(d, model, extra={"step": 10})
        >>> load_dcp(d, torch.nn.Linear(3, 2))
        {'step': 10}
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    path = Path(path)
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    if extra is not None:
        blob = io.BytesIO()
        torch.save(extra, blob)
        blob.seek(0)
        state["extra"] = blob
    rank = _world()[1]
    tmp = run_agreed(lambda: _prepare_dir(path), on=rank == 0) or _tmp_dir(path, "dcp-tmp")
    _quiet_dcp(dcp.save, state, storage_writer=dcp.FileSystemWriter(str(tmp)), **_dist_kwargs())
    run_agreed(lambda: _swap_in(tmp, path), on=rank == 0)
    return path


def _dcp_keys(path: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a DCP checkpoint directory (no .metadata)")
    return dict(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load_dcp(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_dcp` into a (sharded) model and optimizer.

    Every rank calls it; each reads only the pieces of its own shards (DCP reshards when the world
    size or mesh differs from the save).

    Args:
        path: the checkpoint directory.
        model: the model, sharded as it will be trained (materialised, not on ``meta``).
        optimizer: the optimizer to restore (its state must be in the checkpoint).
        strict: every model key must be in the checkpoint and vice versa.

    Returns:
        dict: the ``extra`` state given to :func:`save_dcp` (``{}`` if none).

    Raises:
        FileNotFoundError: ``path`` is not a DCP directory (every rank).
        CheckpointError: an optimizer is given but the checkpoint has no optimizer state.

    Example:
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

    path = Path(path)
    keys = run_agreed(lambda: _dcp_keys(path))
    has_optim = any(k.startswith("optim.") for k in keys)
    if optimizer is not None and not has_optim:
        raise CheckpointError(f"{str(path)!r} holds no optimizer state (no 'optim.*' entries); "
                              "pass optimizer=None or load another checkpoint")
    options = StateDictOptions(strict=strict)
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    if "extra" in keys:
        state["extra"] = io.BytesIO()
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    _quiet_dcp(dcp.load, state, storage_reader=dcp.FileSystemReader(str(path)), planner=planner,
               **_dist_kwargs())
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
    else:
        set_model_state_dict(model, state["model"], options=options)
    extra = state.get("extra")
    if isinstance(extra, io.BytesIO):
        extra.seek(0)
        extra = torch.load(extra, weights_only=False) if extra.getbuffer().nbytes else {}
    return extra if extra is not None else {}


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
        raise CheckpointError(f"no tensor under prefix {prefix!r} in DCP checkpoint {str(src)!r} "
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

    Returns:
        Path: the index file, or the single ``model.safetensors``.

    Raises:
        FileNotFoundError: ``src`` is not a DCP directory.
        CheckpointError: no tensor under ``prefix``.
        OSError: ``dst`` cannot be written (nothing of the new checkpoint is left behind).

    Example:
        >>> import tempfile, torch
        >>> from fsdptk import save_dcp, dcp_to_safetensors, SafetensorsCheckpoint
        >>> d = tempfile.mkdtemp()
        >>> _ = save_dcp(f"{d}/dcp", torch.nn.Linear(3, 2))
        >>> dcp_to_safetensors(f"{d}/dcp", f"{d}/hf").name
        'model.safetensors'
        >>> sorted(SafetensorsCheckpoint(f"{d}/hf"))
        ['bias', 'weight']
    """
    import torch.distributed.checkpoint as dcp

    src, dst = Path(src), Path(dst)
    meta = _dcp_keys(src)
    names = _tensor_keys(meta, prefix, src)
    stored = {k: meta[v].properties.dtype for k, v in names.items()}
    out_dtype = {k: dtype if dtype is not None and d.is_floating_point else d for k, d in stored.items()}
    shapes = {k: tuple(meta[v].size) for k, v in names.items()}
    entries = [(k, out_dtype[k], shapes[k]) for k in names]
    writer = ShardedWriter(dst, entries, max_shard_size=max_shard_size)
    nbytes = {k: torch.Size(shapes[k]).numel() * stored[k].itemsize for k in names}
    reader = dcp.FileSystemReader(str(src))
    try:
        with progress_bar(writer.total_size, f"convert {src.name}", progress) as bar:
            for batch in _batches(list(names), nbytes, min(_BATCH_BYTES, parse_size(max_shard_size))):
                sd = {names[k]: torch.empty(shapes[k], dtype=stored[k]) for k in batch}
                _quiet_dcp(dcp.load, sd, storage_reader=reader,
                           planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
                for k in batch:
                    bar.update(writer.write(k, sd.pop(names[k]).to(out_dtype[k])))
                trim_heap()
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def _lazy_planner(ckpt: SafetensorsCheckpoint, prefix: str, bar: Any) -> Any:
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
) -> Path:
    """Convert a safetensors checkpoint (file or HF directory) to a DCP directory, offline.

    One process; DCP plans from metadata only and each tensor is read from the file when it is
    written, one at a time. The result loads with :func:`load_dcp` (keys under ``prefix``) into a
    model of any world size.

    Args:
        src: a ``.safetensors`` file, an index, or an HF checkpoint directory.
        dst: the DCP directory to write (replaced as a whole, atomically).
        prefix: prepended to every key (``"model."`` matches :func:`save_dcp`; ``""`` for none).
        progress: tqdm bar of bytes (``None``: only on a terminal).

    Returns:
        Path: ``dst``.

    Raises:
        FileNotFoundError, CheckpointError: ``src`` missing, corrupt or inconsistent.
        OSError: ``dst`` cannot be written.

    Example:
        >>> import tempfile, torch
        >>> from fsdptk import save_safetensors, safetensors_to_dcp, load_dcp
        >>> d = tempfile.mkdtemp()
        >>> src = torch.nn.Linear(3, 2)
        >>> _ = save_safetensors(src, f"{d}/hf")
        >>> _ = safetensors_to_dcp(f"{d}/hf", f"{d}/dcp")
        >>> dst = torch.nn.Linear(3, 2)
        >>> load_dcp(f"{d}/dcp", dst)
        {}
        >>> torch.equal(dst.weight, src.weight)
        True
    """
    import torch.distributed.checkpoint as dcp

    src, dst = Path(src), Path(dst)
    with SafetensorsCheckpoint(src) as ckpt:
        meta_sd = {prefix + k: torch.empty(ckpt.shape(k), dtype=ckpt.dtype(k), device="meta")
                   for k in ckpt}
        tmp = _prepare_dir(dst)
        try:
            with progress_bar(ckpt.total_size, f"convert {src.name}", progress) as bar:
                _quiet_dcp(dcp.save, meta_sd,
                           storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=1),
                           planner=_lazy_planner(ckpt, prefix, bar), no_dist=True)
            _swap_in(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dst


convert_dcp_to_safetensors = dcp_to_safetensors
convert_safetensors_to_dcp = safetensors_to_dcp

"""A streamed safetensors save: the plan taken from the model, then the gather into the files.

:func:`plan_save` checks the arguments and plans items and files before any tensor moves (the
front half of :func:`fsdptk.save_safetensors`); :func:`write_save` gathers the planned items to
rank 0 bucket by bucket (the engine's ``collect``) and writes each full tensor straight to its
place in its file, then commits (the back half). A background save (:mod:`fsdptk.background`)
swaps the plan's items for a snapshot; :func:`write_streamed` is the same writer for other files
of the same format (a PEFT adapter, :func:`fsdptk.hf.save_adapter`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from fsdptk import _engine
from fsdptk._core.dist import is_rank0, raise_if_any, run_agreed
from fsdptk._core.names import tie_groups
from fsdptk._engine import bucket_size
from fsdptk._engine.layouts import box_shape, full_box
from fsdptk._engine.sources.convert import Node, Unconverter
from fsdptk._files.common import Rename, progress_bar, rename_keys, trim_heap
from fsdptk._files.pending import wait_for_pending
from fsdptk._files.safetensors_io import INDEX_SUFFIX, parse_size
from fsdptk._files.safetensors_writer import ShardedWriter, plan_shards

__all__ = ["SavePlan", "plan_save", "save_items", "stream_to_writer", "write_save", "write_streamed"]

PathLike = str | os.PathLike[str]


def save_items(model: nn.Module, tied: str, rename: Rename, dtype: torch.dtype | None
                ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str], dict[str, torch.dtype]]:
    """(model items to gather, {model key: file key}, {model key: dtype in the file})."""
    if tied not in ("omit", "both"):
        raise ValueError(f"tied must be 'omit' or 'both', got {tied!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    sd = model.state_dict(keep_vars=True)
    skip = {k for g in tie_groups(model) for k in g[1:]} if tied == "omit" else set()
    items = [(k, t) for k, t in sd.items() if k not in skip]
    out_name = {old: new for new, old in rename_keys([k for k, _ in items], rename,
                                                     what="model key").items()}
    items = [(k, t) for k, t in items if k in out_name]
    dtypes = {k: dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype
              for k, t in items}
    return items, out_name, dtypes


def stream_to_writer(buckets: Generator[list[tuple[str, torch.Tensor]], None, None], writer: ShardedWriter | None,
            out_name: dict[str, str], dtypes: dict[str, torch.dtype], bar: Any,
            split: Unconverter | None = None) -> tuple[BaseException | None, Path | None]:
    """Write every gathered tensor (rank 0) and commit. A write error is thrown into ``buckets``
    (the engine's ``collect``): its next status agreement raises it on every rank at once. A
    commit error is returned (agreed by the caller). ``split`` turns each gathered model tensor
    into the checkpoint's tensors (a conversion's inverse: the Hub layout); ``out_name`` then maps
    checkpoint keys to file keys."""
    with bar:
        for bucket in buckets:
            for key, full in bucket:  # rank 0 only; the other ranks get empty buckets
                if writer is not None:
                    try:
                        pieces = split.feed(key, full) if split is not None else [(key, full)]
                        for name, piece in pieces:
                            if name in out_name:
                                bar.update(writer.write(out_name[name], piece.to(dtypes[key]).contiguous()))
                        del pieces
                    except Exception as e:  # noqa: BLE001 - agreed by the engine, raised here
                        buckets.throw(e)
                del full
            if writer is not None:
                del bucket
                trim_heap()
    if writer is None:
        return None, None
    try:
        return None, writer.commit()
    except Exception as e:  # noqa: BLE001 - agreed by the caller (raise_if_any)
        writer.abort()
        return e, None


@dataclass(frozen=True)
class SavePlan:
    """What a safetensors save takes from the model before any tensor moves (the front half of
    :func:`fsdptk.save_safetensors`); :func:`write_save` streams ``items`` into the files (the back
    half). A background save (:mod:`fsdptk.background`) swaps ``items`` for a snapshot."""

    path: Path
    items: list[tuple[str, torch.Tensor]]
    out_name: dict[str, str]
    dtypes: dict[str, torch.dtype]
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]]
    files: list[Any]
    limit: int
    metadata: Mapping[str, str] | None
    bucket_bytes: int
    progress: bool | None
    prefix: str = "model"  # file names: <prefix>.safetensors, or shards and <prefix>.safetensors.index.json
    split: Unconverter | None = None  # model tensors -> checkpoint tensors (a conversion's inverse)


def plan_save(model: nn.Module, path: PathLike, *, max_shard_size: int | str, tied: str,
               dtype: torch.dtype | None, rename: Rename, metadata: Mapping[str, str] | None,
               bucket_bytes: int | None, progress: bool | None,
               conversion: Mapping[str, Node] | None = None) -> SavePlan:
    """The front half of :func:`fsdptk.save_safetensors`: arguments checked, items and file layout
    planned. ``conversion`` (model key -> node over the checkpoint's layout) writes each model
    tensor as the checkpoint tensors its node reads (the Hub layout); ``rename`` then applies to
    those keys."""
    path = Path(path)
    limit = parse_size(max_shard_size)
    nbytes = bucket_size(bucket_bytes)
    if conversion is None:
        items, out_name, dtypes = save_items(model, tied, rename, dtype)
        entries = [(out_name[k], dtypes[k], tuple(t.shape)) for k, t in items]
        split = None
    else:
        items, _, dtypes = save_items(model, tied, None, dtype)
        pieces: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for k, _t in items:
            node = conversion[k]
            for leaf, box in node.leaves(full_box(node.shape)):
                pieces.setdefault(leaf, (dtypes[k], box_shape(box)))
        out_name = {old: new for new, old in rename_keys(list(pieces), rename, what="checkpoint key").items()}
        entries = [(out_name[k], d, s) for k, (d, s) in pieces.items() if k in out_name]
        split = Unconverter(conversion)
    files = plan_shards(entries, limit)  # validates dtypes on every rank
    return SavePlan(path=path, items=items, out_name=out_name, dtypes=dtypes, entries=entries, files=files,
                     limit=limit, metadata=metadata, bucket_bytes=nbytes, progress=progress, split=split)


def write_save(plan: SavePlan, stage_config: Callable[[], Any]) -> Path:
    """The back half of :func:`fsdptk.save_safetensors`: gather ``plan.items`` bucket by bucket and stream
    them into the files (rank 0), commit; ``stage_config()`` (rank 0, lock held) stages the config
    files, or returns ``None``. Collective."""
    path, entries, limit = plan.path, plan.entries, plan.limit

    def open_writer() -> tuple[ShardedWriter, Any]:
        w = ShardedWriter(path, entries, max_shard_size=limit, metadata=plan.metadata, prefix=plan.prefix)
        try:
            staged = stage_config()
        except BaseException:
            w.abort()
            raise
        if staged is not None:  # renamed in after the weights commit, under the directory's lock
            w.after_commit(staged.commit)
        return w, staged

    writer, config = run_agreed(open_writer, on=is_rank0()) or (None, None)
    try:
        buckets = cast(Generator[list[tuple[str, torch.Tensor]], None, None],  # collect/distribute are generators (annotated Iterator in the engine)
                       _engine.collect(plan.items, bucket_bytes=plan.bucket_bytes))
        error, result = stream_to_writer(buckets, writer, plan.out_name, plan.dtypes,
                                progress_bar(writer.total_size if writer else 0, f"save {path.name}",
                                             plan.progress), plan.split)
    except BaseException:  # the engine failed on every rank: leave nothing behind
        if writer is not None:
            writer.abort()
        if config is not None:
            config.abort()
        raise
    if config is not None and error is not None:  # no new weights (or the config step failed)
        try:
            config.abort()
        except Exception:  # noqa: BLE001 - the first error is the one agreed below
            pass
    raise_if_any(error)
    if result is not None:
        return result
    return path / (plan.files[0].name if len(plan.files) == 1 else plan.prefix + INDEX_SUFFIX)


def write_streamed(path: Path, items: list[tuple[str, torch.Tensor]], out_name: dict[str, str],
                    dtypes: dict[str, torch.dtype], *, limit: int, bucket_bytes: int | None,
                    metadata: Mapping[str, str] | None, progress: bool | None,
                    stage: Callable[[], Any], prefix: str = "model") -> Path:
    """Gather ``items`` to rank 0 bucket by bucket and write them as ``<prefix>.safetensors`` (or
    shards plus an index) in ``path``, as :func:`fsdptk.save_safetensors` does: the writer of
    :func:`fsdptk.hf.save_adapter`. ``stage()`` (rank 0, before any tensor moves) returns staged
    side files (``commit()`` / ``abort()``, e.g. a config) renamed in after the weights commit,
    under the directory's lock, or ``None``."""
    wait_for_pending()
    entries = [(out_name[k], dtypes[k], tuple(t.shape)) for k, t in items]
    files = plan_shards(entries, limit, prefix=prefix)  # validates dtypes on every rank
    plan = SavePlan(path=Path(path), items=items, out_name=out_name, dtypes=dtypes, entries=entries,
                     files=files, limit=limit, metadata=metadata, bucket_bytes=bucket_size(bucket_bytes),
                     progress=progress, prefix=prefix)
    return write_save(plan, stage)

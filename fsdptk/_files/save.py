"""A streamed safetensors save: the files of a plan's items, then the gather into the files.

:func:`plan_save` checks the arguments and plans the files of the items the caller planned
(:mod:`fsdptk._plans.hub_items`, what a model emits) before any tensor moves (the
front half of :func:`fsdptk.save_safetensors`); :func:`write_save` gathers the planned items to
rank 0 bucket by bucket (the engine's ``collect``) and writes each full tensor straight to its
place in its file, then commits (the back half). A background save (:mod:`fsdptk.background`)
swaps the plan's items for a snapshot; :func:`write_streamed` is the same writer for other files
of the same format (a PEFT adapter, :func:`fsdptk.hf.save_adapter`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from fsdptk import _engine
from fsdptk._core.dist import all_gather_object, run_agreed
from fsdptk._core.dist import world as _world
from fsdptk._engine import bucket_size
from fsdptk._engine.gather import Holdings
from fsdptk._engine.layouts import box_shape, full_box
from fsdptk._engine.sources.convert import Node, Unconverter
from fsdptk._files.common import Rename, progress_bar, rename_keys, trim_heap
from fsdptk._files.pending import wait_for_pending
from fsdptk._files.safetensors_io import INDEX_SUFFIX, _numel, parse_size
from fsdptk._files.safetensors_writer import ShardedWriter, ShardFiles, plan_shards
from fsdptk._files.writers import WriterAssignment, shard_limit, writer_ranks

__all__ = ["SavePlan", "plan_save", "stream_to_writer", "write_save", "write_streamed"]

PathLike = str | os.PathLike[str]


def stream_to_writer(buckets: Generator[list[tuple[str, torch.Tensor]], None, None], writer: ShardFiles | None,
                     out_name: dict[str, str], dtypes: dict[str, torch.dtype], bar: Any,
                     split: Unconverter | None = None, written: Mapping[str, torch.dtype] | None = None) -> None:
    """Write every gathered tensor this rank receives (a writer's). A write error is thrown into
    ``buckets`` (the engine's ``collect``): its next status agreement raises it on every rank at
    once. ``split`` turns each gathered model tensor into the checkpoint's tensors (a conversion's
    inverse: the Hub layout); ``out_name`` then maps checkpoint keys to file keys. ``written``:
    checkpoint keys ``split`` makes in their final dtype (a quantized save's weights and scales,
    quantized from the model tensor cast to its dtype in the file), written as they are."""
    written = written or {}
    with bar:
        for bucket in buckets:
            for key, full in bucket:  # a writer's own items; the other ranks get empty buckets
                if writer is not None:
                    try:
                        if split is None:
                            pieces = [(key, full)]
                        else:
                            pieces = split.feed(key, full.to(dtypes[key]) if written else full)
                        for name, piece in pieces:
                            if name in out_name:
                                piece = piece if name in written else piece.to(dtypes[key])
                                bar.update(writer.write(out_name[name], piece.contiguous()))
                        del pieces
                    except Exception as e:  # noqa: BLE001 - agreed by the engine, raised here
                        buckets.throw(e)
                del full
            if writer is not None and bucket:
                del bucket
                trim_heap()


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
    writers: tuple[int, ...] = (0,)  # the ranks that write files (rank 0 first: it coordinates)
    written: Mapping[str, torch.dtype] = field(default_factory=dict)  # checkpoint keys in their own dtype (quantized)


def plan_save(items: list[tuple[str, torch.Tensor]], dtypes: dict[str, torch.dtype], path: PathLike, *,
               max_shard_size: int | str, rename: Rename, metadata: Mapping[str, str] | None,
               bucket_bytes: int | None, progress: bool | None,
               conversion: Mapping[str, Node] | None = None, writers: int | str = 1,
               written: Mapping[str, torch.dtype] | None = None) -> SavePlan:
    """The front half of :func:`fsdptk.save_safetensors`: arguments checked, the file layout of
    ``items`` (the model's, :func:`fsdptk._plans.hub_items.save_items`, written in ``dtypes``)
    planned. ``conversion`` (model key -> node over the checkpoint's layout) writes each model
    tensor as the checkpoint tensors its node reads (the Hub layout); ``rename`` then applies to
    those keys. ``writers`` (an int or ``"host"``): :func:`fsdptk._files.writers.writer_ranks`
    (collective when above 1). The caller agrees every argument across ranks first
    (:func:`fsdptk._core.arguments.agree_arguments`: the same ``writers``, ``max_shard_size``,
    ``tied``, ``dtype``, ``rename``, ``metadata`` and ``bucket_bytes`` on every rank), so the
    checks here raise the same error on every rank and ``writers=1`` needs no exchange.
    ``written``: checkpoint keys of ``conversion``'s layout written in their own dtype, not
    ``dtype`` (a quantized save's weights and scales)."""
    written = dict(written or {})
    path = Path(path)
    ranks = writer_ranks(writers) if writers != 1 else [0]
    limit = parse_size(max_shard_size)
    nbytes = bucket_size(bucket_bytes)
    if conversion is None:
        out_name = {old: new for new, old in rename_keys([k for k, _ in items], rename,
                                                         what="model key").items()}
        items = [(k, t) for k, t in items if k in out_name]
        dtypes = {k: dtypes[k] for k, _ in items}
        entries = [(out_name[k], dtypes[k], tuple(t.shape)) for k, t in items]
        split = None
    else:
        pieces: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for k, _t in items:
            node = conversion[k]
            for leaf, box in node.leaves(full_box(node.shape)):
                pieces.setdefault(leaf, (written.get(leaf, dtypes[k]), box_shape(box)))
        out_name = {old: new for new, old in rename_keys(list(pieces), rename, what="checkpoint key").items()}
        entries = [(out_name[k], d, s) for k, (d, s) in pieces.items() if k in out_name]
        split = Unconverter(conversion)
    limit = shard_limit(limit, sum(_numel(s) * d.itemsize for _, d, s in entries), len(ranks))
    files = plan_shards(entries, limit)  # validates dtypes on every rank
    return SavePlan(path=path, items=items, out_name=out_name, dtypes=dtypes, entries=entries, files=files,
                     limit=limit, metadata=metadata, bucket_bytes=nbytes, progress=progress, split=split,
                     writers=tuple(ranks), written=written)


def _item_files(plan: SavePlan) -> list[list[int]]:
    """Per item of ``plan``, the files its checkpoint tensors are written to (ascending; empty
    when every one of them is renamed away: the item is then not gathered)."""
    file_of = {e.key: i for i, f in enumerate(plan.files) for e in f.entries}
    out = []
    for key, t in plan.items:
        names = ([leaf for leaf, _ in plan.split.nodes[key].leaves(full_box(tuple(t.shape)))]
                 if plan.split is not None else [key])
        out.append(sorted({file_of[plan.out_name[n]] for n in names if n in plan.out_name}))
    return out


def write_save(plan: SavePlan, stage_config: Callable[[], Any]) -> Path:
    """The back half of :func:`fsdptk.save_safetensors`: gather ``plan.items`` bucket by bucket to
    their writers and stream them into the files, seal, commit; ``stage_config()`` (rank 0, lock
    held) stages the config files, or returns ``None``. Collective.

    Rank 0 coordinates (:class:`ShardedWriter`: lock, recovery, free space, names, the commit and
    the config files). With several writers every other writer builds the same plan with rank 0's
    token and names (:class:`ShardFiles`), the engine assigns the files to writers once it has
    agreed who holds what (:class:`WriterAssignment`), each writer writes and fsyncs its own, and
    only when every writer's seal is agreed does rank 0 rename anything into place."""
    path, entries, limit = plan.path, plan.entries, plan.limit
    _, rank = _world()
    many = len(plan.writers) > 1

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

    coordinator, config = run_agreed(open_writer, on=rank == 0) or (None, None)
    writer: ShardFiles | None = coordinator
    try:
        item_files = _item_files(plan)
        keep = [i for i, files in enumerate(item_files) if files]
        items = [plan.items[i] for i in keep]
        bar = progress_bar(_share(writer), f"save {path.name}", plan.progress)
        dest: Any = None
        if many:
            target = all_gather_object(_SaveTarget(coordinator.token, coordinator.names)
                                       if coordinator is not None else None)[0]
            writer = run_agreed(lambda: ShardFiles(path, entries, max_shard_size=limit, metadata=plan.metadata,
                                                   prefix=plan.prefix, token=target.token, names=target.names),
                                on=rank != 0 and rank in plan.writers) or coordinator
            assignment = WriterAssignment(plan.writers, [item_files[i] for i in keep],
                                          [f.size for f in plan.files], items)

            def dest(holdings: Holdings) -> list[int]:
                out = assignment(holdings)
                if writer is not None:
                    writer.assign(assignment.own(rank))
                    bar.total = _share(writer)
                return out
        buckets = cast(Generator[list[tuple[str, torch.Tensor]], None, None],  # collect/distribute are generators (annotated Iterator in the engine)
                       # the writer below drops each tensor once written: its memory is reused
                       _engine.collect(items, bucket_bytes=plan.bucket_bytes, dest=dest, reuse_yielded=True))
        stream_to_writer(buckets, writer, plan.out_name, plan.dtypes, bar, plan.split, plan.written)
        run_agreed(lambda: writer.seal() if writer is not None else None)  # every writer's files durable, or no commit
        result = run_agreed(coordinator.commit if coordinator is not None else lambda: None)
    except BaseException:  # failed on every rank (agreed): leave nothing behind
        for undo in (coordinator.abort if coordinator is not None else None,
                     writer.discard if writer is not None and writer is not coordinator else None,
                     config.abort if config is not None else None):
            if undo is not None:
                try:
                    undo()
                except Exception:  # noqa: BLE001 - the error already propagating is the one reported
                    pass
        raise
    if result is not None:
        return result
    return path / (plan.files[0].name if len(plan.files) == 1 else plan.prefix + INDEX_SUFFIX)


class _SaveTarget(NamedTuple):
    """What the coordinating writer (rank 0) tells the other writers before any tensor moves."""

    token: str  # the save's token: every temporary name carries it
    names: list[str]  # the final name of every file, in plan order


def _share(writer: ShardFiles | None) -> int:
    """Bytes this rank writes (for its progress bar): its files' data, all of them until assigned."""
    if writer is None:
        return 0
    own = range(len(writer.files)) if writer._own is None else writer._own
    return sum(e.nbytes for i in own for e in writer.files[i].entries)


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

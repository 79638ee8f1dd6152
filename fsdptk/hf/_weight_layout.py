"""Who holds what, agreed (:func:`fsdptk.hf.weight_source`'s one exchange): the arguments every
rank must pass alike, the message each rank sends, and from every rank's message the owner of each
Hub tensor (the assignment of ``save_safetensors(writers=W)``) and the Hub tensors the ranks already
hold as a ``torch.chunk`` split. Everything here but :func:`assign` runs without communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdptk import _engine
from fsdptk._core.compat import local_tensor
from fsdptk._engine.gather import Holdings
from fsdptk._engine.layouts import Box, box_shape, layout_of
from fsdptk._engine.sources.convert import Node
from fsdptk.hf._weight_meta import chunk_grid, splittable
from fsdptk.hf._weight_plan import Items, Plan

__all__ = ["Arguments", "SourceView", "Layout", "check_arguments", "held", "raise_disagreement", "assign"]


class Arguments(NamedTuple):
    """The arguments every rank must pass alike (their reprs), exchanged before any tensor moves."""

    conversion: str
    dtype: str
    owners: str
    bucket_bytes: str
    adapters: str
    quantize: str


class SourceView(NamedTuple):
    """What each rank sends in the one exchange of :func:`fsdptk.hf.weight_source`."""

    arguments: Arguments
    error: Any  # error_payload of its local failure (a bad argument, a meta tensor), or None
    fingerprint: str | None  # of its items and Hub tensors (names, shapes, dtypes)
    boxes: list[Box | None]  # per item, the box of the full tensor it holds (None: none)
    plain: list[bool]  # per item, its local tensor is exactly that box, unquantized
    host: str


@dataclass(frozen=True)
class Layout:
    """Agreed on every rank: who receives each item, who owns each Hub tensor, which are split."""

    dests: list[int]  # per item, the rank its full tensor is gathered to
    owner: dict[str, int]  # Hub name -> the rank iter_full yields it on
    split: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]]  # Hub name -> grid
    boxes: list[Box | None]  # per item, this rank's box


def check_arguments(model: Any, conversion: Any, dtype: Any, owners: Any, bucket_bytes: Any, adapters: Any,
                    quantize: Any, world: int) -> int:
    """Every argument checked on this rank (no communication); ``bucket_bytes`` resolved."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if quantize is not None:
        raise ValueError("quantize must be None (quantizing on the way out is not supported yet), "
                         f"got {quantize!r}")
    if conversion not in ("auto", None):
        raise TypeError(f"conversion must be 'auto' or None, got {conversion!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if owners != "host":
        if isinstance(owners, bool) or not isinstance(owners, int):
            raise TypeError(f"owners must be an int (1 to the world size, {world}) or 'host', got {owners!r}")
        if not 1 <= owners <= world:
            raise ValueError(f"owners must be between 1 and the world size ({world}), or 'host'; got {owners}")
    if adapters not in (None, "merged", "only"):
        raise ValueError(f"adapters must be None, 'merged' or 'only', got {adapters!r}")
    return _engine.bucket_size(bucket_bytes)


def held(items: Items) -> tuple[list[Box | None], list[bool]]:
    """Per item, the box this rank holds and whether its local tensor is exactly that box."""
    boxes: list[Box | None] = []
    plain: list[bool] = []
    for key, t in items:
        local = local_tensor(t)
        if local.is_meta:
            raise ValueError(f"{key!r} is on the meta device (shape {list(t.shape)}); load or initialise it first")
        layout = layout_of(t)
        box = layout.held_box()
        boxes.append(box)
        plain.append(box is not None and not layout.quantized and local.layout == torch.strided
                     and tuple(local.shape) == box_shape(box))
    return boxes, plain


def raise_disagreement(views: list[SourceView]) -> None:
    """One ValueError naming every argument the ranks passed differently (with each rank's value),
    or a model that differs between ranks."""
    fields = [f for f in Arguments._fields if len({getattr(v.arguments, f) for v in views}) > 1]
    if fields:
        raise ValueError("weight_source: ranks passed different arguments: " + "; ".join(
            f"{f} = {[getattr(v.arguments, f) for v in views]} (by rank)" for f in fields)
            + "; pass the same on every rank")
    diff = [r for r, v in enumerate(views) if v.fingerprint != views[0].fingerprint]
    if diff:
        raise ValueError(f"weight_source: the model's tensors (names, shapes, dtypes) differ between rank 0 "
                         f"and ranks {diff}")


def assign(plan: Plan, views: list[SourceView], owners: int | str, rank: int) -> Layout:
    """Who receives each item, who owns each Hub tensor, which Hub tensors are split (every rank
    computes the same from the agreed views)."""
    from fsdptk._files.writers import WriterAssignment, writer_ranks

    ranks = [0] if owners == 1 else writer_ranks(owners)
    index = {name: j for j, (name, _, _) in enumerate(plan.hub)}
    sizes = [torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in plan.hub]
    item_files = [sorted(index[n] for n in plan.item_hub[k]) for k in plan.keys]
    assignment = WriterAssignment(ranks, item_files, sizes, [(k, _Dtype(plan.model_dtypes[k])) for k in plan.keys])
    holdings = Holdings(boxes=[v.boxes for v in views], hosts=[v.host for v in views])
    dests = assignment(holdings)
    assert assignment.files is not None
    owner = {name: assignment.files[j] for j, (name, _, _) in enumerate(plan.hub)}
    return Layout(dests=dests, owner=owner, split=split_grids(plan, views, owner), boxes=views[rank].boxes)


class _Dtype(NamedTuple):
    dtype: torch.dtype


def split_grids(plan: Plan, views: list[SourceView], owner: dict[str, int]) -> dict[str, Any]:
    """Hub name -> ``(owners, mesh_shape, placements)`` for the Hub tensors the ranks already hold
    as a ``torch.chunk`` split (each covered by one item that every holder holds exactly)."""
    covering: dict[str, list[int]] = {}
    for i, k in enumerate(plan.keys):
        for name in plan.item_hub[k]:
            covering.setdefault(name, []).append(i)
    shapes = {name: shape for name, _, shape in plan.hub}
    out: dict[str, Any] = {}
    for name, found in covering.items():
        if len(found) != 1:
            continue
        i = found[0]
        key = plan.keys[i]
        if key in plan.merges or key in plan.lora or not all(v.plain[i] or v.boxes[i] is None for v in views):
            continue
        node: Node | None = plan.nodes.get(plan.conv_key[key]) if plan.nodes is not None else None
        if node is not None and not splittable(node):
            continue
        boxes: dict[int, Box] = {}
        ok = True
        for r, v in enumerate(views):
            box = v.boxes[i]
            if box is None:
                continue
            mine = ([b for n, b in node.leaves(box) if n == name] if node is not None else [box])
            if len(mine) > 1:
                ok = False
            elif mine:
                boxes[r] = mine[0]
        grid = chunk_grid(shapes[name], boxes, prefer=owner[name]) if ok and boxes else None
        if grid is not None:
            out[name] = grid
    return out

"""Who holds what, agreed (:func:`fsdptk.hf.weight_source`'s one exchange): the message each rank
sends (its arguments, its error, what it holds), and from every rank's message the owners of each
Hub tensor (for ``owners=W`` the assignment of ``save_safetensors(writers=W)``) and, for
``owners="all"``, the Hub tensors the ranks already hold as a ``torch.chunk`` split in rank order
(on at most two mesh axes, one of them sharded: what vLLM's M2N engine takes).
Everything here but :func:`assign` (``writer_ranks``' exchange) runs without communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdptk import _engine
from fsdptk._core.arguments import ArgumentsView, check_arguments
from fsdptk._core.compat import local_tensor
from fsdptk._engine.gather import Holdings
from fsdptk._engine.layouts import Box, box_shape, layout_of
from fsdptk._engine.sources.convert import Node
from fsdptk._plans.hub_items import Items, Plan
from fsdptk.hf._weight_meta import rank_grid, splittable

__all__ = ["SourceView", "Ownership", "check", "held", "raise_disagreement", "assign"]


class SourceView(NamedTuple):
    """What each rank sends in the one exchange of :func:`fsdptk.hf.weight_source`."""

    arguments: ArgumentsView  # the arguments every rank must pass alike
    error: Any  # error_payload of its local failure (a bad argument, a meta tensor), or None
    fingerprint: str | None  # of its items and Hub tensors (names, shapes, dtypes)
    boxes: list[Box | None]  # per item, the box of the full tensor it holds (None: none)
    plain: list[bool]  # per item, its local tensor is exactly that box, unquantized
    meshes: list[tuple[int, ...] | None]  # per item, the shape of its mesh when it spans the ranks in order
    host: str
    records: str | None  # the record types it can import (RecordTypes.kind: vLLM's, with its version,
    # or fsdptk's own, and why); None when it failed before finding out


@dataclass(frozen=True)
class Ownership:
    """Agreed on every rank: where each item is gathered, who owns each Hub tensor, which are split."""

    dests: list[list[int]]  # per item, the ranks its full tensor is gathered to
    owners: dict[str, tuple[int, ...]]  # Hub name -> the ranks that yield it
    grids: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # Hub name -> (mesh shape, sharded dim
    # per mesh axis, -1: replicated) of the pieces the ranks already hold (owners="all" only)
    boxes: list[Box | None]  # per item, this rank's box


def check(model: Any, conversion: Any, dtype: Any, owners: Any, bucket_bytes: Any, adapters: Any,
          quantize: Any, block_size: Any, quantize_if: Any, world: int) -> int:
    """Every argument checked on this rank (no communication); ``bucket_bytes`` resolved."""
    from fsdptk._plans.quant_save import quant_format

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    quant_format(quantize, block_size, quantize_if)  # save_safetensors' own checks and messages
    if quantize is not None and adapters is not None:
        raise ValueError(f"quantize={quantize!r} quantizes a model's own Hub tensors (adapters=None); "
                         f"quantizing adapters, alone or merged, is not supported: got adapters={adapters!r}")
    if conversion not in ("auto", None):
        raise TypeError(f"conversion must be 'auto' or None, got {conversion!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if owners not in ("host", "all"):
        if isinstance(owners, bool) or not isinstance(owners, int):
            raise TypeError(f"owners must be an int (1 to the world size, {world}), 'host' or 'all', "
                            f"got {owners!r}")
        if not 1 <= owners <= world:
            raise ValueError(f"owners must be between 1 and the world size ({world}), 'host' or 'all'; "
                             f"got {owners}")
    if adapters not in (None, "merged", "only"):
        raise ValueError(f"adapters must be None, 'merged' or 'only', got {adapters!r}")
    return _engine.bucket_size(bucket_bytes)


def held(items: Items, world: int) -> tuple[list[Box | None], list[bool], list[tuple[int, ...] | None]]:
    """Per item: the box this rank holds, whether its local tensor is exactly that box, and the
    shape of its mesh when the mesh spans every rank in rank order (a plain tensor: ``(world,)``)."""
    boxes: list[Box | None] = []
    plain: list[bool] = []
    meshes: list[tuple[int, ...] | None] = []
    for key, t in items:
        local = local_tensor(t)
        if local.is_meta:
            raise ValueError(f"{key!r} is on the meta device (shape {list(t.shape)}); load or initialise it first")
        layout = layout_of(t)
        box = layout.held_box()
        boxes.append(box)
        plain.append(box is not None and not layout.quantized and local.layout == torch.strided
                     and tuple(local.shape) == box_shape(box))
        mesh = getattr(t, "device_mesh", None)
        if mesh is None:
            meshes.append((world,))
        else:
            ranks = mesh.mesh.flatten().tolist()
            meshes.append(tuple(mesh.mesh.shape) if ranks == list(range(world)) else None)
    return boxes, plain, meshes


def raise_disagreement(views: list[SourceView]) -> None:
    """One ValueError naming every argument the ranks passed differently (with each rank's value),
    ranks that would make the source of different record types (what each can import of vLLM), or
    a model that differs between ranks."""
    check_arguments([v.arguments for v in views])
    kinds: dict[str | None, list[int]] = {}
    for r, v in enumerate(views):
        kinds.setdefault(v.records, []).append(r)
    if len(kinds) > 1:
        shown = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {kind}"
                          for kind, ranks in kinds.items())
        raise ValueError("weight_source: the ranks can import different record types for the source (vLLM's "
                         "from vllm.distributed.weight_transfer.base where it imports, fsdptk's own otherwise), "
                         f"and every rank must make the same; install the same vLLM (or none) on every rank: "
                         f"{shown}")
    diff = [r for r, v in enumerate(views) if v.fingerprint != views[0].fingerprint]
    if diff:
        raise ValueError(f"weight_source: the model's tensors (names, shapes, dtypes) differ between rank 0 "
                         f"and ranks {diff}")


def assign(plan: Plan, views: list[SourceView], owners: int | str, rank: int) -> Ownership:
    """Where each item is gathered and who owns each Hub tensor (every rank computes the same from
    the agreed views): ``owners`` 1, W or ``"host"``: one rank per Hub tensor, whole Hub tensors
    assigned as a save's files are (all those of one model tensor together); ``"all"``: every rank."""
    world = len(views)
    if owners == "all":
        everyone = tuple(range(world))
        grids = _grids(plan, views)
        return Ownership(dests=[list(everyone) for _ in plan.keys], owners={n: everyone for n, _, _ in plan.hub},
                         grids=grids, boxes=views[rank].boxes)
    from fsdptk._files.writers import WriterAssignment, writer_ranks

    ranks = [0] if owners == 1 else writer_ranks(owners)
    index = {name: j for j, (name, _, _) in enumerate(plan.hub)}
    sizes = [torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in plan.hub]
    item_files = [sorted(index[n] for n in plan.item_hub[k]) for k in plan.keys]
    # WriterAssignment reads each item's dtype (bytes of a held box, for host locality)
    assignment = WriterAssignment(ranks, item_files, sizes, [(k, _Dtype(plan.model_dtypes[k])) for k in plan.keys])
    dests = assignment(Holdings(boxes=[v.boxes for v in views], hosts=[v.host for v in views]))
    assert assignment.files is not None, "set by the call"
    owner: dict[str, tuple[int, ...]] = {name: (assignment.files[j],) for j, (name, _, _) in enumerate(plan.hub)}
    return Ownership(dests=[[d] for d in dests], owners=owner, grids={}, boxes=views[rank].boxes)


class _Dtype(NamedTuple):
    dtype: torch.dtype


def _grids(plan: Plan, views: list[SourceView]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Hub name -> (mesh shape, sharded dim per axis) for the Hub tensors every rank already holds
    a piece of as a ``torch.chunk`` split in rank order (each covered by one unquantized item whose
    mesh spans the ranks in order, through renames, stacks, concatenations and transpositions;
    never a quantized weight or its scales)."""
    covering: dict[str, list[int]] = {}
    for i, k in enumerate(plan.keys):
        for name in plan.item_hub[k]:
            covering.setdefault(name, []).append(i)
    shapes = {name: shape for name, _, shape in plan.hub}
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, found in covering.items():
        i = found[0]
        key = plan.keys[i]
        if len(found) != 1 or key in plan.merges or name in plan.written or not all(v.plain[i] for v in views):
            continue  # quantized weights and scales: made on the owner from the whole tensor
        mesh = views[0].meshes[i] if all(v.meshes[i] == views[0].meshes[i] for v in views) else None
        node: Node | None = plan.nodes.get(plan.conv_key[key]) if plan.nodes is not None else None
        if node is not None and not splittable(node):
            continue
        boxes: list[Box | None] = []
        for v in views:
            box = v.boxes[i]
            mine = [b for n, b in node.leaves(box) if n == name] if node is not None and box is not None else [box]
            boxes.append(mine[0] if len(mine) == 1 else None)
        # the tensor's own mesh first, then the world laid out every other way (a sub-mesh's
        # tensor, FSDP's Shard(0) over dp of a dp x tp world, is a split of the whole world); only
        # what vLLM's M2N engine takes: at most two mesh axes, one of them sharded
        for candidate in ([mesh] if mesh is not None and len(mesh) <= 2 else []) + _layouts(len(views)):
            dims = rank_grid(shapes[name], boxes, candidate)
            if dims is not None and sum(d >= 0 for d in dims) <= 1:
                out[name] = (candidate, dims)
                break
    return out


def _layouts(world: int) -> list[tuple[int, ...]]:
    """Every row-major mesh shape of ``world`` ranks with one or two axes, each above 1.

    Examples:
        >>> _layouts(8), _layouts(1)
        ([(8,), (2, 4), (4, 2)], [(1,)])
    """
    return [(world,)] + [(a, world // a) for a in range(2, world) if world % a == 0]

"""A weight source's plan (:func:`fsdptk.hf.weight_source`): the Hub items of
:func:`fsdptk._plans.hub_items.plan_items` given their destination, the owners.

Two steps around the source's one exchange, both without communication:

- :func:`plan_source`, before it: the items and their Hub tensors, and what this rank holds of
  each item (:class:`Held`, what it sends in the exchange);
- :func:`ownership`, after it, from what every rank holds (the same answer on every rank): where
  each item is gathered and who owns each Hub tensor (for ``owners=W`` the assignment of
  ``save_safetensors(writers=W)``), for ``owners="all"`` the Hub tensors the ranks already hold as
  a ``torch.chunk`` split in rank order (on at most two mesh axes, one of them sharded: what vLLM's
  M2N engine takes), and with ``track_changes`` which pieces each holder compares
  (:class:`TrackPlan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdptk._core.compat import local_tensor
from fsdptk._engine.layouts import Box, box_shape, layout_of
from fsdptk._engine.routes import Holdings, choose_senders
from fsdptk._engine.sources.convert import Node
from fsdptk._files.writers import WriterAssignment, spread_ranks
from fsdptk._plans.hub_items import Items, Plan, plan_items
from fsdptk._plans.hub_pieces import rank_grid, splittable

__all__ = ["MAX_PATCHABLE", "Held", "Part", "TrackPlan", "Ownership", "plan_source", "held", "ownership"]

MAX_PATCHABLE = 2**31  # int32 flat indices of a patch: a tracked Hub tensor must have fewer elements


class Held(NamedTuple):
    """What this rank holds of each item (in the plan's order)."""

    boxes: list[Box | None]  # the box of the full tensor it holds (None: none)
    plain: list[bool]  # its local tensor is exactly that box, unquantized
    meshes: list[tuple[int, ...] | None]  # the shape of its mesh when it spans the ranks in order


class Part(NamedTuple):
    """One holder's piece of one Hub tensor, as every rank derives it from the agreed boxes."""

    sender: int  # the rank that keeps its baseline and sends its changes
    item: int  # the model tensor (index in the plan's keys) it is cut from
    box: Box  # its box in the Hub tensor


@dataclass(frozen=True)
class TrackPlan:
    """Who compares what (``track_changes=True``): the same on every rank."""

    gathered: set[str]  # Hub names compared whole on their owner (no holder can cut its piece alone)
    parts: dict[str, list[Part]]  # every other Hub name -> the holders' pieces (one per distinct box)


@dataclass(frozen=True)
class Ownership:
    """Agreed on every rank: where each item is gathered, who owns each Hub tensor, which are split."""

    dests: list[list[int]]  # per item, the ranks its full tensor is gathered to
    owners: dict[str, tuple[int, ...]]  # Hub name -> the ranks that yield it
    grids: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # Hub name -> (mesh shape, sharded dim
    # per mesh axis, -1: replicated) of the pieces the ranks already hold (owners="all" only)
    boxes: list[Box | None]  # per item, this rank's box
    track: TrackPlan | None  # with track_changes, who compares what; else None


def plan_source(model: nn.Module, *, conversion: Any, dtype: torch.dtype | None, adapters: str | None,
                quantize: str | None, block_size: Any, quantize_if: Any, world: int, track_changes: bool
                ) -> tuple[Plan, Held]:
    """The plan of :func:`fsdptk._plans.hub_items.plan_items` and what this rank holds of its items
    (the source's arguments checked by the caller).

    Raises:
        ValueError: a tensor still on ``meta`` (named); with ``track_changes``, a Hub tensor of
            ``2**31`` elements or more (int32 patch indices; named); and as ``plan_items``.
        TypeError / NotImplementedError / ConversionError: as ``plan_items``.

    Examples:
        >>> import torch
        >>> plan, holding = plan_source(torch.nn.Linear(2, 3), conversion=None, dtype=None, adapters=None,
        ...                             quantize=None, block_size=None, quantize_if=None, world=1, track_changes=True)
        >>> [(name, shape) for name, _, shape in plan.hub], holding.plain
        ([('weight', (3, 2)), ('bias', (3,))], [True, True])
    """
    plan, items = plan_items(model, conversion=conversion, dtype=dtype, adapters=adapters, quantize=quantize,
                             block_size=block_size, quantize_if=quantize_if)
    holding = held(items, world)
    if track_changes:  # a patch addresses its Hub tensor with int32 flat indices
        for name, _, shape in plan.hub:
            n = math.prod(shape)
            if n >= MAX_PATCHABLE:
                raise ValueError(f"weight_source(track_changes=True): the Hub tensor {name!r} has {n} elements "
                                 f"(shape {tuple(shape)}), and patches address it with int32 flat indices "
                                 f"(fewer than 2**31 elements); stream it with iter_full instead")
    return plan, holding


def held(items: Items, world: int) -> Held:
    """Per item: the box this rank holds, whether its local tensor is exactly that box, and the
    shape of its mesh when the mesh spans every rank in rank order (a plain tensor: ``(world,)``).

    Raises:
        ValueError: an item on the ``meta`` device (named).

    Examples:
        >>> import torch
        >>> held([("w", torch.zeros(2, 3))], 1)
        Held(boxes=[(slice(0, 2, None), slice(0, 3, None))], plain=[True], meshes=[(1,)])
    """
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
    return Held(boxes, plain, meshes)


def ownership(plan: Plan, owners: int | str, rank: int, holds: list[Held], hosts: list[str], *,
              track_changes: bool) -> Ownership:
    """Where each item is gathered and who owns each Hub tensor, from what every rank holds
    (``holds[r]``, on host ``hosts[r]``): every rank computes the same. ``owners`` 1, W or
    ``"host"``: one rank per Hub tensor, whole Hub tensors assigned as a save's files are (all
    those of one model tensor together); ``"all"``: every rank, with the pieces the ranks already
    hold as a ``torch.chunk`` split declared. With ``track_changes``, who compares what
    (:class:`TrackPlan`): each holder the pieces of the Hub tensors it can cut on its own (one holder
    per distinct box, as the gather picks it), the owner every other Hub tensor, whole.

    Examples:
        >>> import torch
        >>> from fsdptk._plans.hub_items import plan_items
        >>> plan, items = plan_items(torch.nn.Linear(2, 3), conversion=None, dtype=None, adapters=None)
        >>> layout = ownership(plan, 1, 0, [held(items, 1)], ["host"], track_changes=True)
        >>> layout.dests, layout.owners, sorted(layout.track.parts)
        ([[0], [0]], {'weight': (0,), 'bias': (0,)}, ['bias', 'weight'])
    """
    world = len(holds)
    grids = _grids(plan, holds) if owners == "all" else {}
    local, gathered = _compared(plan, holds) if track_changes else (set(), set())
    if owners == "all":
        everyone = tuple(range(world))
        dests = [list(everyone) for _ in plan.keys]
        owner = {name: everyone for name, _, _ in plan.hub}
    else:
        dests, owner = _by_writers(plan, owners, Holdings(boxes=[h.boxes for h in holds], hosts=hosts))
    track = None
    if track_changes:  # the pieces each holder sends its owner (choose_senders: as the gather sends them)
        sends = choose_senders(Holdings(boxes=[h.boxes for h in holds], hosts=hosts), [d[0] for d in dests])
        shapes = {name: shape for name, _, shape in plan.hub}
        parts: dict[str, list[Part]] = {}
        for i in sorted(local):
            k = plan.keys[i]
            node = plan.nodes.get(plan.conv_key[k]) if plan.nodes is not None else None
            for r, row in enumerate(sends):
                box = row[i]
                if box is None or 0 in box_shape(box):
                    continue
                leaves = node.leaves(box) if node is not None else [(plan.conv_key[k], box)]
                for name, hub_box in leaves:
                    if name in shapes and 0 not in box_shape(hub_box):
                        parts.setdefault(name, []).append(Part(r, i, hub_box))
        track = TrackPlan(gathered=gathered, parts=parts)
    return Ownership(dests=dests, owners=owner, grids=grids, boxes=holds[rank].boxes, track=track)


def _covering(plan: Plan) -> dict[str, list[int]]:
    """Hub name -> the items (indices) whose tensors make it."""
    covering: dict[str, list[int]] = {}
    for i, k in enumerate(plan.keys):
        for name in plan.item_hub[k]:
            covering.setdefault(name, []).append(i)
    return covering


def _compared(plan: Plan, holds: list[Held]) -> tuple[set[int], set[str]]:
    """(the items whose holders compare their own pieces, the Hub names compared whole on their
    owner): a holder compares its piece where every rank's local tensor is exactly its box, the
    item alone makes its Hub tensors and the conversion only moves data (renames, stacks,
    concatenations, transpositions); never a LoRA layer merged into its base weight, a quantized
    weight or its scales."""
    covering = _covering(plan)
    local: set[int] = set()
    for i, k in enumerate(plan.keys):
        if k in plan.merges or k in plan.lora:
            continue
        node = plan.nodes.get(plan.conv_key[k]) if plan.nodes is not None else None
        if (any(name in plan.written for name in plan.item_hub[k]) or not all(h.plain[i] for h in holds)
                or (node is not None and not splittable(node))
                or any(len(covering[name]) != 1 for name in plan.item_hub[k])):
            continue
        local.add(i)
    gathered = {name for name, _, _ in plan.hub if not any(i in local for i in covering.get(name, []))}
    return local, gathered


def _grids(plan: Plan, holds: list[Held]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Hub name -> (mesh shape, sharded dim per axis) for the Hub tensors every rank already holds
    a piece of as a ``torch.chunk`` split in rank order (each covered by one unquantized item whose
    mesh spans the ranks in order, through renames, stacks, concatenations and transpositions;
    never a quantized weight or its scales)."""
    shapes = {name: shape for name, _, shape in plan.hub}
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, found in _covering(plan).items():
        i = found[0]
        key = plan.keys[i]
        if len(found) != 1 or key in plan.merges or name in plan.written or not all(h.plain[i] for h in holds):
            continue  # quantized weights and scales: made on the owner from the whole tensor
        mesh = holds[0].meshes[i] if all(h.meshes[i] == holds[0].meshes[i] for h in holds) else None
        node: Node | None = plan.nodes.get(plan.conv_key[key]) if plan.nodes is not None else None
        if node is not None and not splittable(node):
            continue
        boxes: list[Box | None] = []
        for h in holds:
            box = h.boxes[i]
            mine = [b for n, b in node.leaves(box) if n == name] if node is not None and box is not None else [box]
            boxes.append(mine[0] if len(mine) == 1 else None)
        # the tensor's own mesh first, then the world laid out every other way (a sub-mesh's
        # tensor, FSDP's Shard(0) over dp of a dp x tp world, is a split of the whole world); only
        # what vLLM's M2N engine takes: at most two mesh axes, one of them sharded
        for candidate in ([mesh] if mesh is not None and len(mesh) <= 2 else []) + _layouts(len(holds)):
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


class _Dtype(NamedTuple):
    dtype: torch.dtype


def _by_writers(plan: Plan, owners: int | str, holdings: Holdings
                ) -> tuple[list[list[int]], dict[str, tuple[int, ...]]]:
    """(per item its owner, Hub name -> its owner) for ``owners`` 1, W or ``"host"``: whole Hub
    tensors assigned as ``save_safetensors(writers=W)`` assigns its files (all those of one model
    tensor together, near the bytes its host holds)."""
    ranks = spread_ranks(owners, holdings.hosts)
    index = {name: j for j, (name, _, _) in enumerate(plan.hub)}
    sizes = [torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in plan.hub]
    item_files = [sorted(index[n] for n in plan.item_hub[k]) for k in plan.keys]
    # WriterAssignment reads each item's dtype (bytes of a held box, for host locality)
    assignment = WriterAssignment(ranks, item_files, sizes, [(k, _Dtype(plan.model_dtypes[k])) for k in plan.keys])
    dests = assignment(holdings)
    assert assignment.files is not None, "set by the call"
    owner: dict[str, tuple[int, ...]] = {name: (assignment.files[j],) for j, (name, _, _) in enumerate(plan.hub)}
    return [[d] for d in dests], owner

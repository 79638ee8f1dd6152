"""The records and the placement math of :func:`fsdptk.hf.weight_source` (no communication here).

- :class:`ParamMeta`: fsdptk's own frozen record with the fields of vLLM 0.33's ``ParamMeta``
  (``name, dtype, shape, *, owners, mesh_shape, placements``), used when vLLM is not importable;
  :func:`vllm_classes` finds vLLM's ``WeightSource`` and ``ParamMeta`` when it is (imported here,
  lazily, and nowhere else in fsdptk).
- :func:`chunk_grid`: whether the pieces of one Hub tensor that the ranks already hold are a plain
  ``torch.chunk`` split (one or more dims, replicas allowed), and as which owners, mesh shape and
  placements.
- :func:`box_pieces`: a model tensor's local piece at its box cut into the Hub tensors' pieces,
  through a conversion's nodes (the box-wise form of ``Node.split``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard

from fsdptk._engine.layouts import Box
from fsdptk._engine.sources.convert import Concatenated, Leaf, Node, Stacked, Transposed

__all__ = ["ParamMeta", "chunk_grid", "box_pieces", "splittable", "vllm_classes"]

Placement = Shard | Replicate


@dataclass(frozen=True)
class ParamMeta:
    """One Hub tensor of a weight source: vLLM 0.33's ``ParamMeta`` fields, validated.

    ``owners`` are the ranks laid out row-major over ``mesh_shape`` (``len(owners) ==
    prod(mesh_shape)``); ``placements`` has one ``Shard(d)`` or ``Replicate()`` per mesh dim, a
    ``Shard(d)`` splitting tensor dim ``d`` like ``torch.chunk``. A tensor served whole by one rank
    is ``owners=(r,), mesh_shape=(1,), placements=(Replicate(),)``.

    Raises:
        TypeError / ValueError: a bad field, naming the parameter and the value.

    Examples:
        >>> import torch
        >>> from torch.distributed.tensor import Shard
        >>> m = ParamMeta("w", torch.float32, (4, 2), owners=(0, 1), mesh_shape=(2,), placements=(Shard(0),))
        >>> m.owners, m.placements
        ((0, 1), (Shard(dim=0),))
        >>> ParamMeta("w", torch.float32, (4, 2), owners=(0, 0), mesh_shape=(2,), placements=(Shard(0),))
        Traceback (most recent call last):
        ValueError: ParamMeta 'w': owners must be distinct ranks >= 0, got (0, 0)
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] = (0,)
    mesh_shape: tuple[int, ...] = (1,)
    placements: tuple[Placement, ...] = (Replicate(),)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"ParamMeta name must be a non-empty str, got {self.name!r}")
        where = f"ParamMeta {self.name!r}"
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"{where}: dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.shape, tuple) or not all(_nat(n) for n in self.shape):
            raise TypeError(f"{where}: shape must be a tuple of ints >= 0, got {self.shape!r}")
        if (not isinstance(self.owners, tuple) or not self.owners or not all(_nat(r) for r in self.owners)
                or len(set(self.owners)) != len(self.owners)):
            raise ValueError(f"{where}: owners must be distinct ranks >= 0, got {self.owners!r}")
        if (not isinstance(self.mesh_shape, tuple) or not self.mesh_shape
                or not all(_nat(n) and n > 0 for n in self.mesh_shape)):
            raise ValueError(f"{where}: mesh_shape must be a non-empty tuple of ints > 0, got {self.mesh_shape!r}")
        if math.prod(self.mesh_shape) != len(self.owners):
            raise ValueError(f"{where}: {len(self.owners)} owners do not fill mesh_shape {self.mesh_shape}")
        if not isinstance(self.placements, tuple) or len(self.placements) != len(self.mesh_shape):
            raise ValueError(f"{where}: placements must be a tuple of one placement per mesh dim "
                             f"({len(self.mesh_shape)}), got {self.placements!r}")
        for p in self.placements:
            if isinstance(p, Shard) and type(p) is Shard:
                if not 0 <= p.dim < len(self.shape):
                    raise ValueError(f"{where}: {p} is not a dim of shape {self.shape}")
            elif not isinstance(p, Replicate):
                raise ValueError(f"{where}: placements may be Shard(d) or Replicate(), got {p!r}")


def _nat(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def vllm_classes() -> tuple[type, type] | None:
    """``(vllm WeightSource, vllm ParamMeta)`` when vLLM is importable, else ``None`` (nothing is
    imported when ``importlib.util.find_spec("vllm")`` finds nothing)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    base = importlib.import_module("vllm.distributed.weight_transfer.base")  # only here, only when installed
    return base.WeightSource, base.ParamMeta


# ----------------------------------------------------------------------------------------------
# placements: is what the ranks hold a torch.chunk split?
def _chunk_spans(n: int, k: int) -> list[tuple[int, int]]:
    """``torch.chunk`` of a dim of length ``n`` into ``k``: the non-empty ``(start, stop)`` spans."""
    step = math.ceil(n / k) if n else 0
    return [(i * step, min((i + 1) * step, n)) for i in range(k) if i * step < n]


def chunk_grid(shape: Sequence[int], boxes: Mapping[int, Box], prefer: int | None = None
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...]] | None:
    """``(owners, mesh_shape, placements)`` when the boxes the ranks hold (``rank -> box`` of one
    Hub tensor) are a ``torch.chunk`` split of it along one or more dims, every piece held by some
    rank; else ``None``. Of the replicas of a piece the owner is ``prefer`` when it holds it, else
    the lowest rank. Empty boxes are ignored.

    Examples:
        >>> rows = {r: (slice(2 * r, 2 * r + 2), slice(0, 3)) for r in range(4)}
        >>> chunk_grid((8, 3), rows)
        ((0, 1, 2, 3), (4,), (Shard(dim=0),))
        >>> whole = {1: (slice(0, 8), slice(0, 3)), 3: (slice(0, 8), slice(0, 3))}
        >>> chunk_grid((8, 3), whole, prefer=3)
        ((3,), (1,), (Replicate(),))
        >>> chunk_grid((8, 3), {0: (slice(0, 5), slice(0, 3)), 1: (slice(5, 8), slice(0, 3))}) is None
        True
    """
    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for r in sorted(boxes):
        box = boxes[r]
        if len(box) != len(shape) or not all(isinstance(b, slice) for b in box):
            return None
        spans = tuple((b.start, b.stop) for b in box)
        if any(a >= b for a, b in spans):
            continue
        holders.setdefault(spans, []).append(r)
    if not holders:
        return None
    split: list[tuple[int, list[tuple[int, int]]]] = []
    for d, n in enumerate(shape):
        seen = sorted({spans[d] for spans in holders})
        if len(seen) == 1:
            if seen[0] != (0, n):
                return None
            continue
        if seen != _chunk_spans(n, len(seen)):
            return None
        split.append((d, seen))
    if math.prod(len(s) for _, s in split) != len(holders):
        return None

    def pick(spans: tuple[tuple[int, int], ...]) -> int:
        ranks = holders[spans]
        return prefer if prefer in ranks else ranks[0]

    if not split:
        (only,) = holders
        return (pick(only),), (1,), (Replicate(),)
    owners: list[int] = []
    for cell in _cells([len(s) for _, s in split]):
        at = [(0, n) for n in shape]
        for (d, seen), i in zip(split, cell):
            at[d] = seen[i]
        owners.append(pick(tuple(at)))
    if len(set(owners)) != len(owners):
        return None
    return tuple(owners), tuple(len(s) for _, s in split), tuple(Shard(d) for d, _ in split)


def _cells(sizes: list[int]) -> Iterator[tuple[int, ...]]:
    """Row-major coordinates of a grid of ``sizes``."""
    if not sizes:
        yield ()
        return
    for i in range(sizes[0]):
        for rest in _cells(sizes[1:]):
            yield (i, *rest)


# ----------------------------------------------------------------------------------------------
# a local piece through a conversion's nodes
def _as_box(idx: list[int]) -> slice | tuple[int, ...]:
    """A contiguous ascending run as a slice, anything else as a tuple of indices (as the nodes'
    own boxes are)."""
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return slice(idx[0], idx[0] + len(idx))
    return tuple(idx)


def splittable(node: Node) -> bool:
    """Whether :func:`box_pieces` can cut a box of ``node``'s tensor into its Hub tensors' pieces
    (renames, stacks, concatenations and transpositions; not a chunk of a Hub tensor or a hook)."""
    if isinstance(node, Leaf):
        return True
    if isinstance(node, (Stacked, Concatenated)):
        return all(splittable(c) for c in node.children)
    if isinstance(node, Transposed):
        return splittable(node.child)
    return False


def box_pieces(node: Node, box: Box, piece: torch.Tensor) -> Iterator[tuple[str, Box, torch.Tensor]]:
    """``(Hub key, box of that Hub tensor, its piece)`` for the piece of ``node``'s tensor at ``box``
    (views of ``piece``); the same keys and boxes as ``node.leaves(box)``.

    Examples:
        >>> import torch
        >>> from fsdptk._engine.sources.convert import Stack, apply_ops
        >>> leaves = {"g": [Leaf(f"e.{i}.g", (2, 3), torch.float32) for i in range(4)]}
        >>> node = apply_ops([Stack(0)], leaves, ["g"], ["w"])["w"]
        >>> [(k, b[0]) for k, b, _ in box_pieces(node, (slice(2, 4), slice(0, 2), slice(0, 3)),
        ...                                       torch.zeros(2, 2, 3))]
        [('e.2.g', slice(0, 2, None)), ('e.3.g', slice(0, 2, None))]
    """
    if isinstance(node, Leaf):
        yield node.key, box, piece
    elif isinstance(node, Stacked):
        sub = tuple(b for d, b in enumerate(box) if d != node.dim)
        at = box[node.dim]
        for j, i in enumerate(range(at.start, at.stop) if isinstance(at, slice) else at):
            yield from box_pieces(node.children[i], sub, piece.select(node.dim, j))
    elif isinstance(node, Concatenated):
        at = box[node.dim]
        idx = list(range(at.start, at.stop)) if isinstance(at, slice) else list(at)
        for child, lo, hi in zip(node.children, node.offsets, node.offsets[1:]):
            pos = [j for j, i in enumerate(idx) if lo <= i < hi]
            if not pos:
                continue
            if pos == list(range(pos[0], pos[0] + len(pos))):
                part = piece.narrow(node.dim, pos[0], len(pos))
            else:
                part = piece.index_select(node.dim, torch.tensor(pos, dtype=torch.long))
            child_box = box[:node.dim] + (_as_box([idx[j] - lo for j in pos]),) + box[node.dim + 1:]
            yield from box_pieces(child, child_box, part)
    elif isinstance(node, Transposed):
        b = list(box)
        b[node.dim0], b[node.dim1] = b[node.dim1], b[node.dim0]
        yield from box_pieces(node.child, tuple(b), piece.transpose(node.dim0, node.dim1))
    else:
        raise ValueError(f"{type(node).__name__} has no box-wise pieces")

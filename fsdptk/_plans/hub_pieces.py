"""The pieces of Hub tensors, from boxes alone (no communication, no tensor moves): what
:func:`fsdptk.hf.weight_source` plans its owners, its local pieces and its change tracker with.

- :func:`rank_grid`: whether the pieces of one Hub tensor that the ranks already hold are a
  ``torch.chunk`` split over the ranks in rank order, and under which placements.
- :func:`splittable` / :func:`box_pieces`: a model tensor's local piece at its box cut into the Hub
  tensors' pieces, through a conversion's nodes (the box-wise form of ``Node.split``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from fsdptk._engine.layouts import Box
from fsdptk._engine.sources.convert import Concatenated, Leaf, Node, Stacked, Transposed

__all__ = ["rank_grid", "splittable", "box_pieces"]


# ----------------------------------------------------------------------------------------------
# placements: is what the ranks hold a torch.chunk split?
def _chunk_spans(n: int, k: int) -> list[tuple[int, int]]:
    """``torch.chunk`` of a dim of length ``n`` into ``k``: the non-empty ``(start, stop)`` spans."""
    step = math.ceil(n / k) if n else 0
    return [(i * step, min((i + 1) * step, n)) for i in range(k) if i * step < n]


def _piece(box: Box) -> tuple[tuple[int, int], ...] | None:
    """A box as ``(start, stop)`` spans, ``None`` when it is empty."""
    spans = tuple((b.start, b.stop) for b in box)
    return None if any(a >= b for a, b in spans) else spans


def rank_grid(shape: Sequence[int], boxes: Sequence[Box | None], mesh_shape: Sequence[int]
              ) -> tuple[int, ...] | None:
    """The placements (per mesh axis: the tensor dim it shards, ``-1`` when it replicates) under which
    rank ``r``'s piece of a tensor of ``shape`` is ``boxes[r]``, the ranks laid out row-major over
    ``mesh_shape`` in rank order and each ``Shard`` splitting like ``torch.chunk`` (the outer axis
    first when two shard one dim); ``None`` when no placements give exactly those pieces (a rank
    without a piece, a strided box, uneven splits that are not ``torch.chunk``'s).

    Examples:
        >>> rows = [(slice(2 * r, 2 * r + 2), slice(0, 3)) for r in range(4)]
        >>> rank_grid((8, 3), rows, (4,)), rank_grid((8, 3), rows, (2, 2))
        ((0,), (0, 0))
        >>> hsdp = [(slice(4 * (r % 2), 4 * (r % 2) + 4), slice(0, 3)) for r in range(4)]
        >>> rank_grid((8, 3), hsdp, (2, 2)), rank_grid((8, 3), hsdp, (4,))
        ((-1, 0), None)
    """
    n = len(boxes)
    if math.prod(mesh_shape) != n or not n:
        return None
    pieces = []
    for b in boxes:
        if b is None or len(b) != len(shape) or not all(isinstance(x, slice) for x in b):
            return None
        pieces.append(_piece(b))
    coords = [_unravel(r, mesh_shape) for r in range(n)]
    rank_of = {c: r for r, c in enumerate(coords)}
    dims: list[int] = []
    for j in range(len(mesh_shape)):
        differ: set[int] = set()
        for r, c in enumerate(coords):
            mine, other = pieces[r], pieces[rank_of[c[:j] + (0,) + c[j + 1:]]]
            if c[j] and mine is not None and other is not None:
                differ |= {d for d in range(len(shape)) if mine[d] != other[d]}
        if len(differ) > 1:
            return None
        dims.append(differ.pop() if differ else -1)
    for r, c in enumerate(coords):
        want: list[tuple[int, int] | None] = [(0, size) for size in shape]
        for j, d in enumerate(dims):
            span = want[d] if d >= 0 else None
            if span is None:
                continue
            chunks = _chunk_spans(span[1] - span[0], mesh_shape[j])
            want[d] = (span[0] + chunks[c[j]][0], span[0] + chunks[c[j]][1]) if c[j] < len(chunks) else None
        expected = None if any(w is None for w in want) else tuple(w for w in want if w is not None)
        if expected != pieces[r]:
            return None
    return tuple(dims)


def _unravel(r: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of rank ``r`` on a mesh of ``mesh_shape``."""
    out = []
    for size in reversed(mesh_shape):
        out.append(r % size)
        r //= size
    return tuple(reversed(out))


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

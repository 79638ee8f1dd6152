"""The conversion trees' nodes: one tree per model key over the checkpoint's tensors.

Each node knows its shape and dtype from the checkpoint's headers (no read), reads the piece of
its tensor at a box reading only the checkpoint tensors and slices the box covers
(:meth:`Node.read`), and splits its full tensor back into the checkpoint's (:meth:`Node.split`).
The operations that build trees are in :mod:`.ops`, the view that serves them in :mod:`.view`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fsdptk._engine.layouts import Box, box_shape, extract, full_box

__all__ = ["ConversionProblem", "Node", "Leaf", "Stacked", "Concatenated", "Transposed", "Part", "Transformed",
           "box_indices"]


class ConversionProblem(ValueError):
    """Checkpoint tensors that cannot be converted as declared (names the keys and shapes); the
    public functions raise it as :class:`fsdptk.errors.ConversionError`."""


# ----------------------------------------------------------------------------------------------
# box helpers
def box_indices(b: Any) -> list[int]:
    """The indices one dim of a box selects (a slice or an index tuple), in order.

    Examples:
        >>> box_indices(slice(2, 5)), box_indices((0, 3))
        ([2, 3, 4], [0, 3])
    """
    return list(range(b.start, b.stop)) if isinstance(b, slice) else list(b)


def _show(box: Box) -> str:
    """A box as ``[0:2, 1:4]`` for messages (index tuples as lists)."""
    return "[" + ", ".join(f"{b.start}:{b.stop}" if isinstance(b, slice) else str(list(b)) for b in box) + "]"


def _as_box(idx: list[int]) -> Any:
    """A contiguous ascending run as a slice, anything else as an index tuple."""
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return slice(idx[0], idx[0] + len(idx))
    return tuple(idx)


# ----------------------------------------------------------------------------------------------
# nodes: one tree per model key
class Node:
    """A model tensor built from checkpoint tensors. ``shape`` and ``dtype`` come from headers."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, source: Any, box: Box) -> torch.Tensor:
        """The piece of this tensor at ``box``, reading only what the box covers from ``source``.

        By default one fresh tensor filled by :meth:`read_into`, so a tree of stacks and
        concatenations copies each checkpoint byte once, straight into its place."""
        out = torch.empty(box_shape(box), dtype=self.dtype)
        self.read_into(source, box, out)
        return out

    def read_into(self, source: Any, box: Box, out: torch.Tensor) -> None:
        """Write the piece at ``box`` into ``out`` (a view of the caller's tensor, cast on copy)."""
        out.copy_(self.read(source, box))

    def leaves(self, box: Box) -> Iterator[tuple[str, Box]]:
        """The checkpoint keys, and their boxes, that :meth:`read` of ``box`` reads."""
        raise NotImplementedError

    def split(self, full: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        """``full`` (this node's whole tensor) as the checkpoint's ``(key, tensor)`` pairs; a
        :class:`Part` yields ``(Part, tensor)`` for :class:`Unconverter` to reassemble."""
        raise NotImplementedError

    def files(self) -> list[str]:
        """Every checkpoint key under this node, in read order."""
        return [k for k, _ in self.leaves(full_box(self.shape))]


@dataclass(eq=False)
class Leaf(Node):
    """One checkpoint tensor, read as it is (a rename when it is the whole tree)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, source: Any, box: Box) -> torch.Tensor:
        return source.read(self.key, box)

    def leaves(self, box: Box) -> Iterator[tuple[str, Box]]:
        yield self.key, box

    def split(self, full: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        yield self.key, full


@dataclass(eq=False)
class Stacked(Node):
    """Children of equal shape stacked along a new dimension ``dim`` (per-expert tensors)."""

    children: list[Node]
    dim: int

    def __post_init__(self) -> None:
        first = self.children[0]
        for c in self.children[1:]:
            if c.shape != first.shape or c.dtype != first.dtype:
                raise ConversionProblem(
                    f"cannot stack {c.files()[0]!r} (shape {list(c.shape)}, {c.dtype}) with "
                    f"{first.files()[0]!r} (shape {list(first.shape)}, {first.dtype}): tensors that are "
                    "stacked must have one shape and dtype")
        self.dtype = first.dtype
        self.shape = first.shape[:self.dim] + (len(self.children),) + first.shape[self.dim:]

    def _sub(self, box: Box) -> Box:
        return tuple(b for d, b in enumerate(box) if d != self.dim)

    def read_into(self, source: Any, box: Box, out: torch.Tensor) -> None:
        sub = self._sub(box)
        for j, i in enumerate(box_indices(box[self.dim])):
            self.children[i].read_into(source, sub, out.select(self.dim, j))

    def leaves(self, box: Box) -> Iterator[tuple[str, Box]]:
        sub = self._sub(box)
        for i in box_indices(box[self.dim]):
            yield from self.children[i].leaves(sub)

    def split(self, full: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        for i, c in enumerate(self.children):
            yield from c.split(full.select(self.dim, i))


@dataclass(eq=False)
class Concatenated(Node):
    """Children concatenated along ``dim`` (gate and up projections into ``gate_up_proj``)."""

    children: list[Node]
    dim: int

    def __post_init__(self) -> None:
        first = self.children[0]
        for c in self.children[1:]:
            same = len(c.shape) == len(first.shape) and all(
                a == b for d, (a, b) in enumerate(zip(c.shape, first.shape)) if d != self.dim)
            if not same or c.dtype != first.dtype:
                raise ConversionProblem(
                    f"cannot concatenate {c.files()[0]!r} (shape {list(c.shape)}, {c.dtype}) with "
                    f"{first.files()[0]!r} (shape {list(first.shape)}, {first.dtype}) along dim {self.dim}")
        self.dtype = first.dtype
        self.offsets = [0]
        for c in self.children:
            self.offsets.append(self.offsets[-1] + c.shape[self.dim])
        self.shape = first.shape[:self.dim] + (self.offsets[-1],) + first.shape[self.dim + 1:]

    def _parts(self, box: Box) -> Iterator[tuple[Node, Box]]:
        idx = box_indices(box[self.dim])
        for c, lo, hi in zip(self.children, self.offsets, self.offsets[1:]):
            mine = [i - lo for i in idx if lo <= i < hi]
            if mine:
                yield c, box[:self.dim] + (_as_box(mine),) + box[self.dim + 1:]

    def read(self, source: Any, box: Box) -> torch.Tensor:
        parts = list(self._parts(box))
        if len(parts) == 1:  # the child's own read (a file view where the source gives one)
            return parts[0][0].read(source, parts[0][1])
        return super().read(source, box)

    def read_into(self, source: Any, box: Box, out: torch.Tensor) -> None:
        at = 0
        for c, b in self._parts(box):
            n = box_shape(b)[self.dim]
            c.read_into(source, b, out.narrow(self.dim, at, n))
            at += n

    def leaves(self, box: Box) -> Iterator[tuple[str, Box]]:
        for c, b in self._parts(box):
            yield from c.leaves(b)

    def split(self, full: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        for c, lo, hi in zip(self.children, self.offsets, self.offsets[1:]):
            yield from c.split(full.narrow(self.dim, lo, hi - lo))


@dataclass(eq=False)
class Transposed(Node):
    """The child with dims ``dim0`` and ``dim1`` swapped."""

    child: Node
    dim0: int
    dim1: int

    def __post_init__(self) -> None:
        s = list(self.child.shape)
        s[self.dim0], s[self.dim1] = s[self.dim1], s[self.dim0]
        self.shape, self.dtype = tuple(s), self.child.dtype

    def _child_box(self, box: Box) -> Box:
        b = list(box)
        b[self.dim0], b[self.dim1] = b[self.dim1], b[self.dim0]
        return tuple(b)

    def read(self, source: Any, box: Box) -> torch.Tensor:
        return self.child.read(source, self._child_box(box)).transpose(self.dim0, self.dim1)

    def read_into(self, source: Any, box: Box, out: torch.Tensor) -> None:
        self.child.read_into(source, self._child_box(box), out.transpose(self.dim0, self.dim1))

    def leaves(self, box: Box) -> Iterator[tuple[str, Box]]:
        return self.child.leaves(self._child_box(box))

    def split(self, full: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        return self.child.split(full.transpose(self.dim0, self.dim1))


@dataclass(eq=False)
class Part(Node):
    """Rows ``start:stop`` of the child along ``dim`` (one checkpoint tensor read as several)."""

    child: Node
    dim: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        s = list(self.child.shape)
        s[self.dim] = self.stop - self.start
        self.shape, self.dtype = tuple(s), self.child.dtype

    def _child_box(self, box: Box) -> Box:
        b = box[self.dim]
        shifted = (slice(b.start + self.start, b.stop + self.start) if isinstance(b, slice)
                   else tuple(i + self.start for i in b))
        return box[:self.dim] + (shifted,) + box[self.dim + 1:]

    def read(self, source: Any, box: Box) -> torch.Tensor:
        return self.child.read(source, self._child_box(box))

    def read_into(self, source: Any, box: Box, out: torch.Tensor) -> None:
        self.child.read_into(source, self._child_box(box), out)

    def leaves(self, box: Box) -> Iterator[tuple[str, Box]]:
        return self.child.leaves(self._child_box(box))

    def split(self, full: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        yield self, full


@dataclass(eq=False)
class Transformed(Node):
    """A per-tensor hook: ``forward(child's full tensor)`` is this tensor, ``inverse`` undoes it.

    A box reads the child's whole tensor (the hook may move any element anywhere), unless the
    hook says it keeps boxes (``box_wise``: ``forward(piece)`` of a box is that box's piece, e.g.
    a cast or an elementwise map), in which case only the box is read.

    What the hook yields is checked against what it declares (``shape``, ``dtype``): once when
    the node is built, by running ``forward`` on a ``meta`` tensor of the child's shape (no data;
    a hook that cannot run on ``meta`` is checked on read only), and on every read (the piece's
    shape and dtype against the box's), so a wrong declaration is a :class:`ConversionProblem`
    naming both shapes before a value reaches the model.
    """

    child: Node
    forward: Callable[[torch.Tensor], torch.Tensor]
    inverse: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    box_wise: bool = False

    def __post_init__(self) -> None:
        probe = torch.empty(self.child.shape, dtype=self.child.dtype, device="meta")
        try:
            out = self.forward(probe)
        except Exception:  # noqa: BLE001 - the hook needs values (or an op has no meta kernel): checked on read
            return
        self._check(out, tuple(self.shape), "the whole tensor")

    def _check(self, out: Any, want: tuple[int, ...], where: str) -> None:
        """Raise unless ``out`` is a tensor of shape ``want`` and the declared dtype."""
        if isinstance(out, torch.Tensor) and tuple(out.shape) == want and (
                self.dtype is None or out.dtype == self.dtype):
            return
        got = (f"shape {list(out.shape)} ({out.dtype})" if isinstance(out, torch.Tensor)
               else f"a {type(out).__name__}, not a tensor")
        raise ConversionProblem(
            f"the Transform of checkpoint tensor {self.child.files()[0]!r} (shape {list(self.child.shape)}, "
            f"{self.child.dtype}) declares shape {list(want)} ({self.dtype}) for {where}, but its forward "
            f"returned {got}; declare what it returns (Transform(..., shape=..., dtype=...)) or fix the forward")

    def read(self, source: Any, box: Box) -> torch.Tensor:
        if self.box_wise:
            out = self.forward(self.child.read(source, box))
            self._check(out, box_shape(box), f"box {_show(box)}")
            return out
        out = self.forward(self.child.read(source, full_box(self.child.shape)))
        self._check(out, tuple(self.shape), "the whole tensor")
        return extract(out, box)

    def leaves(self, box: Box) -> Iterator[tuple[str, Box]]:
        return self.child.leaves(box if self.box_wise else full_box(self.child.shape))

    def split(self, full: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        return self.child.split(self.inverse(full))

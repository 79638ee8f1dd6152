"""Conversion views: a checkpoint seen under the model's keys through declarative, reversible rules.

A checkpoint on the Hub often stores a tensor of the model as several tensors (one per MoE expert,
gate and up projections apart), or under another name, or transposed. A conversion is declared as
data: which checkpoint keys feed which model key, and a short list of small operations, each with
its inverse. This module turns such a declaration into a tree of :class:`Node` per model key and
serves the trees as an engine :class:`~fsdptk._engine.sources.Source` (:class:`ConvertedSource`).

Design notes
------------
* Planned per box, never per tensor. ``node.read(source, box)`` reads only the checkpoint tensors
  and the slices a box covers: the rank owning experts 2-3 of ``gate_up_proj`` reads the gate and
  up tensors of experts 2 and 3 only, and a box covering only gate rows reads no up rows. Metadata
  (shape, dtype) of every node comes from the checkpoint's headers, without reading.
* Every operation runs backwards. ``node.split(full)`` turns the model's full tensor back into the
  checkpoint's tensors (``(key, tensor)`` pairs, views where possible): the save path writes the
  Hub layout with it. A :class:`Chunk` (one checkpoint tensor read as several model tensors) is
  reassembled by :class:`Unconverter`, which holds the parts until the checkpoint tensor is whole.
* The operations are those of transformers' ``conversion_mapping`` (``MergeModulelist`` ->
  :class:`Stack`, ``Concatenate`` -> :class:`Concat`, ``Chunk`` -> :class:`Chunk`, ``Transpose`` ->
  :class:`Transpose`) plus :class:`Transform`, a per-tensor hook with its inverse (a RoPE
  permutation; dequantization reads through it). The rules themselves (which keys, which ops) are
  built by the callers: :mod:`fsdptk.conversions` for user rules and transformers' mappings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdptk._engine.layouts import Box, box_shape, extract, full_box

__all__ = [
    "ConversionProblem", "Node", "Leaf", "Stacked", "Concatenated", "Transposed", "Part",
    "Transformed", "ConvertedSource", "Unconverter", "Stack", "Concat", "Chunk", "Transpose",
    "Transform", "Op", "apply_ops", "box_indices",
]


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


# ----------------------------------------------------------------------------------------------
# operations: declared as data, applied to nodes (the same list transformers' converters hold)
class Op:
    """One step of a conversion, applied to ``{pattern: [nodes]}`` (see :func:`apply_ops`)."""

    def apply(self, state: dict[str, list[Node]], sources: Sequence[str], targets: Sequence[str]
              ) -> dict[str, list[Node]]:
        raise NotImplementedError


@dataclass(frozen=True)
class Stack(Op):
    """Stack each pattern's list of tensors (one per index: per-expert) along new dim ``dim``;
    inverse: unbind. transformers' ``MergeModulelist``.

    Examples:
        >>> Stack(0)
        Stack(dim=0)
    """

    dim: int = 0

    def apply(self, state: dict[str, list[Node]], sources: Sequence[str], targets: Sequence[str]
              ) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for pattern, nodes in state.items():
            name = (targets[0] if len(targets) == 1 else _undefined(self, targets)) if len(state) == 1 else pattern
            out[name] = [Stacked(nodes, self.dim)]
        return out


@dataclass(frozen=True)
class Concat(Op):
    """Concatenate every pattern's tensors, in the order the sources are declared, along ``dim``
    into the one target; inverse: split at the same sizes. transformers' ``Concatenate``.

    Examples:
        >>> Concat(1)
        Concat(dim=1)
    """

    dim: int = 0

    def apply(self, state: dict[str, list[Node]], sources: Sequence[str], targets: Sequence[str]
              ) -> dict[str, list[Node]]:
        if len(targets) != 1:
            _undefined(self, targets)
        nodes = [n for p in sources if p in state for n in state[p]]
        return {targets[0]: [Concatenated(nodes, self.dim)]}


@dataclass(frozen=True)
class Chunk(Op):
    """One tensor read as ``len(targets)`` equal chunks along ``dim`` (``torch.chunk``: the last
    may be smaller, and a dim too short for every target gives fewer chunks); inverse:
    concatenate. transformers' ``Chunk``.

    Examples:
        >>> Chunk(0)
        Chunk(dim=0)
    """

    dim: int = 0

    def apply(self, state: dict[str, list[Node]], sources: Sequence[str], targets: Sequence[str]
              ) -> dict[str, list[Node]]:
        nodes = [n for ns in state.values() for n in ns]
        if len(nodes) != 1:
            raise ConversionProblem(f"Chunk({self.dim}) takes one tensor, got {[n.files()[0] for n in nodes]}")
        node = nodes[0]
        length = node.shape[self.dim]
        step = math.ceil(length / len(targets)) if length else 0
        out: dict[str, list[Node]] = {}
        for i, t in enumerate(targets):  # as torch.chunk: fewer chunks when the tail runs out
            lo, hi = min(i * step, length), min((i + 1) * step, length)
            if lo >= hi and i:
                break
            out[t] = [Part(node, self.dim, lo, hi)]
        return out


@dataclass(frozen=True)
class Transpose(Op):
    """Swap dims ``dim0`` and ``dim1`` of the (one) tensor; inverse: the same swap. transformers'
    ``Transpose``.

    Examples:
        >>> Transpose(1, 2)
        Transpose(dim0=1, dim1=2)
    """

    dim0: int = 0
    dim1: int = 1

    def apply(self, state: dict[str, list[Node]], sources: Sequence[str], targets: Sequence[str]
              ) -> dict[str, list[Node]]:
        if len(state) != 1:
            _undefined(self, targets)
        (_pattern, nodes), = state.items()
        name = (sources[0] if len(sources) == 1 else _undefined(self, targets)) if len(targets) > 1 else targets[0]
        return {name: [Transposed(n, self.dim0, self.dim1) for n in nodes]}


@dataclass(frozen=True)
class Transform(Op):
    """A per-tensor hook with its inverse: ``forward(checkpoint tensor) -> model tensor`` and
    ``inverse(model tensor) -> checkpoint tensor`` (a RoPE permutation of q/k rows, a cast).

    ``shape`` maps the checkpoint shape to the model shape (default: unchanged) and ``dtype`` the
    checkpoint dtype to the model's (default: unchanged). A box reads the whole checkpoint tensor
    unless ``box_wise`` (the hook maps every box's piece to the same box's piece).

    Examples:
        >>> neg = Transform(lambda t: -t, lambda t: -t, box_wise=True)
        >>> neg.box_wise
        True
    """

    forward: Callable[[torch.Tensor], torch.Tensor]
    inverse: Callable[[torch.Tensor], torch.Tensor]
    shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None
    dtype: Callable[[torch.dtype], torch.dtype] | None = None
    box_wise: bool = False

    def apply(self, state: dict[str, list[Node]], sources: Sequence[str], targets: Sequence[str]
              ) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for i, (pattern, nodes) in enumerate(state.items()):
            name = targets[i] if len(targets) == len(state) else pattern
            out[name] = [Transformed(n, self.forward, self.inverse,
                                     tuple(self.shape(n.shape)) if self.shape else n.shape,
                                     self.dtype(n.dtype) if self.dtype else n.dtype, self.box_wise)
                         for n in nodes]
        return out


def _undefined(op: Op, targets: Sequence[str]) -> Any:
    raise ConversionProblem(f"{op} cannot produce targets {list(targets)} from this input")


def apply_ops(ops: Sequence[Op], inputs: Mapping[str, list[Node]], sources: Sequence[str],
              targets: Sequence[str]) -> dict[str, Node]:
    """Run ``ops`` over ``{source pattern: [nodes in index order]}``: ``{target pattern: node}``.

    Examples:
        >>> import torch
        >>> leaves = {p: [Leaf(f"e.{i}.{p}", (2, 3), torch.float32) for i in range(4)] for p in ("g", "u")}
        >>> out = apply_ops([Stack(0), Concat(1)], leaves, ["g", "u"], ["gate_up"])
        >>> out["gate_up"].shape
        (4, 4, 3)
    """
    state: dict[str, list[Node]] = {p: list(v) for p, v in inputs.items()}
    for op in ops:
        state = op.apply(state, sources, targets)
    out: dict[str, Node] = {}
    for name, nodes in state.items():
        if len(nodes) != 1:
            raise ConversionProblem(f"the conversion into {name!r} ends with {len(nodes)} tensors "
                                  f"({[n.files()[0] for n in nodes][:4]}...): add a Stack")
        out[name] = nodes[0]
    return out


# ----------------------------------------------------------------------------------------------
# the view
class ConvertedSource(Mapping[str, Any]):
    """A checkpoint (any engine source or Mapping) seen under the model's keys through ``nodes``.

    ``nodes`` maps each model key to its :class:`Node`; ``meta`` costs no read and ``read(key,
    box)`` reads only what the box covers. Read-only: ``release`` frees nothing.

    Args:
        inner: the checkpoint (read through :func:`~fsdptk._engine.sources.as_source`).
        nodes: model key -> node, in the order the keys are listed.
        on_read: called with each checkpoint key after it is read (progress, accounting).
        error: the class a read raises when a node finds what it reads to differ from what it
            declares (default :class:`ConversionProblem`; the public functions pass
            :class:`fsdptk.errors.ConversionError`).
    """

    def __init__(self, inner: Mapping[str, Any], nodes: Mapping[str, Node], *,
                 on_read: Callable[[str, Box], None] | None = None,
                 error: type[ValueError] = ConversionProblem) -> None:
        from fsdptk._engine.sources import as_source

        self.inner, self.nodes = inner, dict(nodes)
        self._source = as_source(inner)
        self._on_read = on_read
        self._error = error

    @property
    def private_reads(self) -> bool:
        """Reads are the inner source's (private where it is) or fresh memory."""
        return bool(getattr(self._source, "private_reads", False))

    # Mapping
    def __getitem__(self, key: str) -> torch.Tensor:
        return self.read(key)

    def __contains__(self, key: object) -> bool:
        return key in self.nodes

    def __iter__(self) -> Iterator[str]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    # Source
    def meta(self, key: str) -> Any:
        from fsdptk._engine.sources import TensorMeta

        node = self.nodes[key]
        if isinstance(node, Leaf):
            return self._source.meta(node.key)
        return TensorMeta(tuple(node.shape), node.dtype)

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        """The piece of model tensor ``key`` at ``box`` (the whole tensor by default).

        Raises:
            ConversionProblem: (or the class given as ``error``) a node found what it reads to
                differ from what it declares (a :class:`Transform` returning another shape or
                dtype); the message names ``key``.
        """
        node = self.nodes[key]
        box = full_box(node.shape) if box is None else box
        try:
            return node.read(self._reader, box)
        except ConversionProblem as e:
            raise self._error(f"model key {key!r}: {e}") from e

    @property
    def _reader(self) -> Any:
        if self._on_read is None:
            return self._source
        return _Counting(self._source, self._on_read)

    def release(self, key: str) -> None:
        """Nothing is held: the checkpoint is read-only."""

    def leaves(self, key: str, box: Box | None = None) -> list[tuple[str, Box]]:
        """The checkpoint keys and boxes a read of ``key`` at ``box`` reads."""
        node = self.nodes[key]
        return list(node.leaves(full_box(node.shape) if box is None else box))


class _Counting:
    def __init__(self, source: Any, on_read: Callable[[str, Box], None]) -> None:
        self.source, self.on_read = source, on_read

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        out = self.source.read(key, box)
        self.on_read(key, box if box is not None else full_box(out.shape))
        return out


class Unconverter:
    """The model's full tensors back into the checkpoint's: ``feed(model key, full)`` returns the
    ``(checkpoint key, tensor)`` pairs that are complete (a :class:`Chunk`'s checkpoint tensor
    once every model tensor read from it has been fed).

    Examples:
        >>> import torch
        >>> leaves = {"g": [Leaf(f"e.{i}.g", (2, 3), torch.float32) for i in range(2)]}
        >>> nodes = {"w": apply_ops([Stack(0)], leaves, ["g"], ["w"])["w"]}
        >>> [(k, tuple(t.shape)) for k, t in Unconverter(nodes).feed("w", torch.zeros(2, 2, 3))]
        [('e.0.g', (2, 3)), ('e.1.g', (2, 3))]
    """

    def __init__(self, nodes: Mapping[str, Node]) -> None:
        self.nodes = nodes
        self._partial: dict[int, tuple[Node, torch.Tensor, int]] = {}  # id(child) -> (child, buffer, rows)

    def feed(self, key: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        pending: list[tuple[Any, torch.Tensor]] = list(self.nodes[key].split(full))
        while pending:
            name, t = pending.pop(0)
            if isinstance(name, str):
                out.append((name, t))
                continue
            part: Part = name
            child, buf, rows = self._partial.get(id(part.child), (part.child, None, 0))
            if buf is None:
                buf = torch.empty(part.child.shape, dtype=t.dtype)
            buf.narrow(part.dim, part.start, part.stop - part.start).copy_(t)
            rows += part.stop - part.start
            if rows >= part.child.shape[part.dim]:
                self._partial.pop(id(part.child), None)
                pending.extend(part.child.split(buf))
            else:
                self._partial[id(part.child)] = (child, buf, rows)
        return out

    def unfinished(self) -> list[str]:
        """Checkpoint keys still waiting for parts (a save that fed every key leaves none)."""
        return [k for child, _, _ in self._partial.values() for k in child.files()]

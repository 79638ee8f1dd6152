"""The operations of a conversion, declared as data and applied to nodes: the list transformers'
converters hold (``MergeModulelist`` -> :class:`Stack`, ``Concatenate`` -> :class:`Concat`,
``Chunk`` -> :class:`Chunk`, ``Transpose`` -> :class:`Transpose`) plus :class:`Transform`, a
per-tensor hook with its inverse. :func:`apply_ops` runs a list of them into one node per target."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdptk._engine.sources.convert.nodes import (
    Concatenated,
    ConversionProblem,
    Node,
    Part,
    Stacked,
    Transformed,
    Transposed,
)

__all__ = ["Op", "Stack", "Concat", "Chunk", "Transpose", "Transform", "apply_ops"]


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

    What ``forward`` returns must be what ``shape`` and ``dtype`` declare: it is run on a ``meta``
    tensor when the rules are built (a forward that needs values is skipped there) and checked on
    every read, and a mismatch is an error naming the key and both shapes, before any value
    reaches the model.

    Examples:
        >>> neg = Transform(lambda t: -t, lambda t: -t, box_wise=True)
        >>> neg.box_wise
        True
        >>> half = Transform(lambda t: t[:, :2], lambda t: t, shape=lambda s: (s[0], 2))
        >>> from fsdptk._engine.sources.convert import Leaf
        >>> half.apply({"w": [Leaf("w", (3, 4), torch.float32)]}, ["w"], ["v"])["v"][0].shape
        (3, 2)
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
        >>> from fsdptk._engine.sources.convert import Leaf
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

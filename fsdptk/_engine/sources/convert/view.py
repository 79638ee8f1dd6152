"""The view: conversion trees served as an engine source (:class:`ConvertedSource`, a load's
reads), and the model's full tensors split back into the checkpoint's (:class:`Unconverter`, a
save's writes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from fsdptk._engine.layouts import Box, full_box
from fsdptk._engine.sources.convert.nodes import ConversionProblem, Leaf, Node, Part

__all__ = ["ConvertedSource", "Unconverter"]


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
        >>> from fsdptk._engine.sources.convert import Leaf, Stack, apply_ops
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

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
  permutation). The rules themselves (which keys, which ops) are built by the callers:
  :mod:`fsdptk.conversions` for user rules and transformers' mappings; quantized tensors are
  dequantizing leaves (:mod:`fsdptk._engine.sources.quant`).
* Declarations are checked before values move: a node's shape comes from its children's, and a
  :class:`Transform`'s forward is run on ``meta`` when it is built and checked on every read, so a
  hook that breaks its declaration is a :class:`ConversionProblem` naming the key and both shapes.

The package: :mod:`.nodes` (the trees), :mod:`.ops` (the operations that build them),
:mod:`.view` (the source over them, and the inverse for saves); every name is importable from here.
"""

from __future__ import annotations

from fsdptk._engine.sources.convert.nodes import (
    Concatenated,
    ConversionProblem,
    Leaf,
    Node,
    Part,
    Stacked,
    Transformed,
    Transposed,
    box_indices,
)
from fsdptk._engine.sources.convert.ops import Chunk, Concat, Op, Stack, Transform, Transpose, apply_ops
from fsdptk._engine.sources.convert.view import ConvertedSource, Unconverter

__all__ = [
    "ConversionProblem", "Node", "Leaf", "Stacked", "Concatenated", "Transposed", "Part",
    "Transformed", "ConvertedSource", "Unconverter", "Stack", "Concat", "Chunk", "Transpose",
    "Transform", "Op", "apply_ops", "box_indices",
]

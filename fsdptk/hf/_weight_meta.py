"""The records and the placement math of :func:`fsdptk.hf.weight_source` (no communication here).

- :class:`ParamMeta`, :class:`Shard`, :class:`Replicate`: fsdptk's own frozen records with the
  fields and validation of vLLM 0.33's (``ParamMeta(name, dtype, shape, *, owners, mesh_shape,
  placements)``), used where vLLM's are not importable; :func:`record_types` gives vLLM's own
  classes where they are (imported there, lazily, and nowhere else in fsdptk), and says which.
- :func:`rank_grid`: whether the pieces of one Hub tensor that the ranks already hold are a
  ``torch.chunk`` split over the ranks in rank order, and under which placements.
- :func:`box_pieces`: a model tensor's local piece at its box cut into the Hub tensors' pieces,
  through a conversion's nodes (the box-wise form of ``Node.split``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import torch

from fsdptk._engine.layouts import Box
from fsdptk._engine.sources.convert import Concatenated, Leaf, Node, Stacked, Transposed

__all__ = ["ParamMeta", "Shard", "Replicate", "SparseWeightPatch", "RecordTypes", "VLLM_RECORDS", "VLLM_PATCHES",
           "record_types", "patch_type", "rank_grid", "box_pieces",
           "splittable"]


@dataclass(frozen=True)
class Replicate:
    """Every coordinate along this mesh axis holds the whole extent (vLLM's ``Replicate``)."""


@dataclass(frozen=True)
class Shard:
    """This mesh axis splits tensor dim ``dim`` the way ``torch.chunk`` does (vLLM's ``Shard``)."""

    dim: int


Placement = Replicate | Shard


@dataclass(frozen=True)
class ParamMeta:
    """One Hub tensor of a weight source, with the fields and validation of vLLM 0.33's ``ParamMeta``
    (used where vLLM is not importable; vLLM's own class is used where it is).

    Attributes:
        name: the Hub checkpoint's name.
        dtype: the dtype the tensor is yielded in.
        shape: its full shape.
        owners: the ranks that yield it (in ``iter_full`` and ``iter_local`` alike), in mesh order;
            ``None``: every rank.
        mesh_shape: row-major shape of the mesh over ``owners`` (default ``(len(owners),)``).
        placements: one :class:`Replicate` or :class:`Shard` per mesh axis: what ``iter_local``
            yields on each owner (``Shard`` splits like ``torch.chunk``, the outer mesh axis first
            when two axes shard one dim); ``None`` (and all-``Replicate``): the whole tensor.

    Raises:
        ValueError: bad owners, a mesh that does not cover them, placements that do not fit the
            mesh or the tensor (naming the parameter).
        TypeError: a placement that is neither :class:`Replicate` nor :class:`Shard`.

    Examples:
        >>> import torch
        >>> m = ParamMeta("w", torch.float32, (4, 2), owners=(0, 1), placements=(Shard(0),))
        >>> m.mesh_shape, m.placements
        ((2,), (Shard(dim=0),))
        >>> ParamMeta("w", torch.float32, (4, 2), owners=(0, 0))
        Traceback (most recent call last):
        ValueError: parameter 'w' owners must be distinct non-negative ranks, got (0, 0)
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    placements: tuple[Placement, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.owners is None:
            if self.mesh_shape is not None or self.placements is not None:
                raise ValueError(f"parameter {self.name!r} declares a mesh or placements without owners")
            return
        owners = tuple(self.owners)
        if (not owners or any(not isinstance(r, int) or isinstance(r, bool) for r in owners) or min(owners) < 0
                or len(set(owners)) != len(owners)):
            raise ValueError(f"parameter {self.name!r} owners must be distinct non-negative ranks, got {self.owners}")
        mesh_shape = tuple((len(owners),) if self.mesh_shape is None else self.mesh_shape)
        if any(d <= 0 for d in mesh_shape) or math.prod(mesh_shape) != len(owners):
            raise ValueError(f"parameter {self.name!r} mesh_shape {mesh_shape} does not cover its "
                             f"{len(owners)} owners")
        placements = self.placements
        if placements is not None:
            placements = tuple(placements)
            if len(placements) != len(mesh_shape):
                raise ValueError(f"parameter {self.name!r} has {len(placements)} placements for a "
                                 f"{len(mesh_shape)}-D mesh")
            for p in placements:
                if isinstance(p, Shard):
                    if not 0 <= p.dim < len(self.shape):
                        raise ValueError(f"parameter {self.name!r} shards dim {p.dim} of a "
                                         f"{len(self.shape)}-D tensor")
                elif not isinstance(p, Replicate):
                    raise TypeError(f"parameter {self.name!r} placement {p!r} is neither Replicate nor Shard")
            if all(isinstance(p, Replicate) for p in placements):
                placements = None
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "placements", placements)


@dataclass
class SparseWeightPatch:
    """Only the changed elements of one Hub tensor, with the fields of vLLM 0.33's
    ``SparseWeightPatch`` (used where vLLM is not importable; vLLM's own class is used where it is).

    Attributes:
        name: the Hub checkpoint's name.
        indices: int32, 1-D, strictly ascending flat indices (C order) into the full tensor.
        values: 1-D, the new values at ``indices``, in the wire dtype.
        full_shape: the full tensor's shape.

    Examples:
        >>> import torch
        >>> p = SparseWeightPatch("w", torch.tensor([1, 4], dtype=torch.int32), torch.ones(2), (2, 3))
        >>> full = torch.zeros(p.full_shape); full.view(-1)[p.indices.long()] = p.values; full
        tensor([[0., 1., 0.],
                [0., 1., 0.]])
    """

    name: str
    indices: torch.Tensor
    values: torch.Tensor
    full_shape: tuple[int, ...]


VLLM_PATCHES = "vllm.distributed.weight_transfer.sparse_nccl_engine"  # vLLM 0.33's SparseWeightPatch


def patch_type(types: RecordTypes) -> type:
    """The patch record of a source whose records are ``types``: vLLM's ``SparseWeightPatch`` when the
    records are vLLM's, fsdptk's :class:`SparseWeightPatch` otherwise (imported only here).

    Raises:
        ImportError: the records are vLLM's but its sparse engine module cannot be imported (naming it).

    Examples:
        >>> patch_type(RecordTypes(None, ParamMeta, Shard, Replicate, "fsdptk's own")) is SparseWeightPatch
        True
    """
    if types.base is None:
        return SparseWeightPatch
    import importlib

    try:
        return cast(type, importlib.import_module(VLLM_PATCHES).SparseWeightPatch)
    except Exception as e:  # noqa: BLE001 - named, with the module
        raise ImportError(f"{types.kind}: vLLM's records import but {VLLM_PATCHES}.SparseWeightPatch does not: "
                          f"{type(e).__name__}: {e}") from e


class RecordTypes(NamedTuple):
    """The classes a source's records are made of: vLLM's where vLLM's are importable, else fsdptk's."""

    base: type | None  # vLLM's WeightSource (the source's base class), or None
    meta: type
    shard: type
    replicate: type
    kind: str  # which, and why (vLLM's version): agreed between the ranks by weight_source


VLLM_RECORDS = "vllm.distributed.weight_transfer.base"  # vLLM 0.33's WeightSource, ParamMeta, Shard, Replicate


def record_types() -> RecordTypes:
    """vLLM's ``WeightSource``, ``ParamMeta``, ``Shard`` and ``Replicate`` when vLLM's
    ``vllm.distributed.weight_transfer.base`` (vLLM 0.33 and later) is importable, else fsdptk's own:
    where vLLM is not installed (then nothing of vLLM is imported: ``importlib.util.find_spec("vllm")``
    finds nothing), or is a release without that module. This is the only place fsdptk imports vLLM.
    ``kind`` says which, with vLLM's version: :func:`fsdptk.hf.weight_source` agrees it between the
    ranks (ranks that would make different records raise one error naming each rank's kind).

    Raises:
        ImportError: vLLM has the module but importing it fails (a broken install), naming vLLM's
            version and the cause.

    Examples:
        >>> types = record_types()
        >>> types.meta.__name__, types.kind.startswith(("fsdptk's own records (vLLM ", "vLLM "))
        ('ParamMeta', True)
    """
    import importlib
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return RecordTypes(None, ParamMeta, Shard, Replicate, "fsdptk's own records (vLLM not installed)")
    version = _vllm_version()
    try:
        base = importlib.import_module(VLLM_RECORDS)  # only here, only when installed
    except ModuleNotFoundError as e:
        parts = VLLM_RECORDS.split(".")
        if e.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:  # an older vLLM
            return RecordTypes(None, ParamMeta, Shard, Replicate,
                               f"fsdptk's own records (vLLM {version} has no {VLLM_RECORDS})")
        raise ImportError(f"vLLM {version} is installed but {VLLM_RECORDS} cannot be imported: "
                          f"{type(e).__name__}: {e}") from e
    except Exception as e:  # noqa: BLE001 - named, with vLLM's version
        raise ImportError(f"vLLM {version} is installed but {VLLM_RECORDS} cannot be imported: "
                          f"{type(e).__name__}: {e}") from e
    return RecordTypes(base.WeightSource, base.ParamMeta, base.Shard, base.Replicate,
                       f"vLLM {version}'s records ({VLLM_RECORDS})")


def _vllm_version() -> str:
    """The installed vLLM's version, without importing it (its distribution's metadata, or an
    already imported module's ``__version__``)."""
    import importlib.metadata
    import sys

    try:
        return importlib.metadata.version("vllm")
    except Exception:  # noqa: BLE001 - no distribution metadata: a source tree on the path
        version = getattr(sys.modules.get("vllm"), "__version__", None)
        return str(version) if version is not None else "(version unknown)"


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

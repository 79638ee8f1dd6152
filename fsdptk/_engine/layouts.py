"""Layouts: how one target tensor is split into this rank's pieces and assembled back.

One small class per kind of target: :class:`PlainLayout` (a replicated plain tensor),
:class:`DTensorLayout` (any mesh and placements DTensor produces, ``_StridedShard`` included),
:class:`NF4Layout` (a plain ``NF4Tensor``) and :class:`DTensorNF4Layout` (a DTensor wrapping an
NF4 chunk). A layout knows this rank's ``local`` part of the full tensor (a box, or for NF4 the
path of dim-0 chunks), the ``(shape, dtype)`` of the pieces that carry it, how to cut any rank's
pieces out of a full tensor, and how to assemble and wrap received pieces.

All placement math comes from DTensor (``_get_shard_size_and_offsets``, the function behind
``compute_local_shape_and_global_offset``); only NF4 uses torchao's own dim-0 split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdptk._core import nf4 as _nf4
from fsdptk._core.compat import StridedShard, dtensor_like, get_shard_size_and_offsets, local_tensor

# A box is one rank's piece of a full tensor: per dim either a ``slice(start, stop)`` or a tuple of
# indices (only _StridedShard produces non-contiguous index sets).
Box = tuple[Any, ...]
Parts = list[tuple[tuple[int, ...], torch.dtype]]


# ---------------------------------------------------------------------------------------------
# boxes


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple(slice(0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the piece at ``box``."""
    return tuple(b.stop - b.start if isinstance(b, slice) else len(b) for b in box)


def is_dim0_run(box: Box, shape: Sequence[int]) -> bool:
    """Whether ``box`` is a run of whole dim-0 rows: a contiguous range of a contiguous tensor of
    ``shape`` (its piece is a view, with no copy, and can be sent from or received into place)."""
    return (len(box) > 0 and isinstance(box[0], slice)
            and all(isinstance(b, slice) and b.start == 0 and b.stop == n for b, n in zip(box[1:], shape[1:])))


def extract(full: Any, box: Box) -> Any:
    """``full``'s piece at ``box``; ``full`` is a tensor or anything indexable by a tuple of slices.

    Only the covering range is read from a lazy object (shard-on-read); strided dims are then
    picked with ``index_select``.
    """
    slices = tuple(b if isinstance(b, slice) else slice(min(b), max(b) + 1) for b in box)
    piece = full[slices] if slices else full[...]
    for d, b in enumerate(box):
        if not isinstance(b, slice):
            piece = piece.index_select(d, torch.tensor(b, dtype=torch.long) - min(b))
    return piece


class Reads:
    """How one load turns what it reads into local tensors: a copy, or the read itself.

    A source whose ``private_reads`` is true (see :mod:`fsdptk._engine.sources`) returns tensors
    that belong to this process alone: fresh memory, or copy-on-write views of a private file
    mapping (a safetensors file). A read that is already a local tensor (contiguous, of the
    output's dtype, on its device: a dim-0 shard of a file tensor of the same dtype) is then kept
    as it is, so the load copies nothing and its pages are read only when first used, and made
    private only when first written (as transformers' ``from_pretrained`` keeps them). Each kept
    read must be distinct memory: a second read of the same bytes in one load is copied, so two
    targets never share storage. Any other read (the caller's own tensors, a cast, a strided
    piece) is copied into fresh memory.
    """

    def __init__(self, source: Any) -> None:
        self.private = bool(getattr(source, "private_reads", False))
        self._kept: set[int] = set()

    def local(self, raw: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``raw`` as this rank's local tensor: ``raw`` itself where it may be kept, else a copy."""
        if (self.private and raw.dtype == dtype and raw.device == device and raw.is_contiguous()
                and raw.data_ptr() not in self._kept):
            if raw.numel():
                self._kept.add(raw.data_ptr())
            return raw.detach()
        return torch.empty(raw.shape, dtype=dtype, device=device).copy_(raw)


def place(full: torch.Tensor, box: Box, piece: torch.Tensor) -> None:
    """Write ``piece`` into ``full`` at ``box`` (the inverse of :func:`extract`)."""
    dims = [d for d, b in enumerate(box) if not isinstance(b, slice)]
    view = full[tuple(b if isinstance(b, slice) else slice(None) for b in box)]
    if not dims:
        view.copy_(piece)
    elif len(dims) == 1:
        view.index_copy_(dims[0], torch.tensor(box[dims[0]], dtype=torch.long), piece)
    else:  # several strided dims (not produced by FSDP2 + TP, kept for completeness): peel one
        d = dims[0]
        rest = tuple(slice(0, view.shape[i]) if i == d else b for i, b in enumerate(box))
        for j, g in enumerate(box[d]):
            sub = tuple(b for i, b in enumerate(rest) if i != d)
            place(view.select(d, g), sub, piece.select(d, j))


_BOXES: dict[tuple[Any, ...], Box] = {}  # (shape, placements, mesh shape, coordinate) -> box
_BOXES_MAX = 4096


def dtensor_box(t: DTensor) -> Box:
    """This rank's box of ``t`` from DTensor's own placement math (Shard, _StridedShard, Replicate).

    The box depends only on the shape, the placements, the mesh's shape and this rank's
    coordinate, so it is computed once per such key (a model repeats a few shapes many times).
    """
    mesh, shape = t.device_mesh, tuple(t.shape)
    coord = mesh.get_coordinate()
    if coord is None:
        return tuple(slice(0, 0) for _ in shape)
    key = (shape, tuple(t.placements), tuple(mesh.shape), tuple(coord))
    box = _BOXES.get(key)
    if box is None:
        if len(_BOXES) >= _BOXES_MAX:
            _BOXES.clear()
        box = _BOXES[key] = _compute_box(t, shape, mesh, coord)
    return box


def _compute_box(t: DTensor, shape: tuple[int, ...], mesh: Any, coord: Sequence[int]) -> Box:
    """:func:`dtensor_box` without the cache."""
    offsets: dict[int, torch.Tensor | None] = {}
    local = list(shape)
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, (Shard, StridedShard)):
            raise ValueError(f"unsupported placement {p} (mesh dim {mesh_dim}) for a full<->shard move")
        d = p.dim + len(shape) if p.dim < 0 else p.dim
        size, idx = get_shard_size_and_offsets(
            local[d], mesh.size(mesh_dim), coord[mesh_dim], p, offsets.get(d), shape[d], False
        )
        local[d] = size
        offsets[d] = idx if size else torch.empty(0, dtype=torch.long)
    box: list[Any] = []
    for d, n in enumerate(shape):
        idx = offsets.get(d)
        if idx is None:
            box.append(slice(0, n))
        elif idx.numel() == 0:
            box.append(slice(0, 0))
        elif bool((idx == torch.arange(int(idx[0]), int(idx[0]) + idx.numel())).all()):
            box.append(slice(int(idx[0]), int(idx[0]) + idx.numel()))
        else:
            box.append(tuple(int(i) for i in idx.tolist()))
    return tuple(box)


def _nf4_path(t: DTensor) -> list[tuple[int, int]]:
    coord = t.device_mesh.get_coordinate() or [0] * t.device_mesh.ndim
    path = []
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is not Shard or p.dim != 0:
            raise ValueError(f"NF4 tensors support only Shard(0) and Replicate placements, got {p}")
        path.append((t.device_mesh.size(mesh_dim), coord[mesh_dim]))
    return path


# ---------------------------------------------------------------------------------------------
# layouts


class Layout:
    """The base of the layouts, with a plain tensor's behaviour (see :class:`PlainLayout`).

    Attributes:
        target: the target tensor (may live on ``meta``).
        shape: its full shape.
        local: this rank's part (a box; for NF4 kinds a chunk path), exchanged with rank 0.
        parts: ``(shape, dtype)`` of the pieces carrying ``local`` (NF4 kinds only; else ``[]``).
    """

    replicated = True  # every rank holds the same full value (checked across ranks on a local load)
    quantized = False  # outputs always take the target's dtype

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self.shape = tuple(target.shape)
        self.local: Any = full_box(self.shape)
        self.parts: Parts = []

    def wire_parts(self, local: Any, parts: Parts, dtype: torch.dtype) -> Parts:
        """``(shape, dtype)`` of the pieces of a rank whose layout exchanged ``(local, parts)``."""
        return [(box_shape(local), dtype)]

    def read_local(self, source: Any, key: str, dtype: torch.dtype, device: torch.device,
                   release: bool, reads: Reads) -> torch.Tensor:
        """This rank's local tensor read from its own ``source`` (see :class:`Reads`)."""
        full = source.read(key)
        if release and full.dtype == dtype and full.device == device and full.is_contiguous():
            return full.detach()  # the caller gave the entry up: no copy
        return reads.local(full, dtype, device)

    def cut(self, full: torch.Tensor, locals_: Sequence[Any], dtype: torch.dtype,
            comm: torch.device) -> list[list[torch.Tensor]]:
        """Rank 0: every rank's pieces (by its exchanged ``local``) cut out of the full tensor."""
        full = full.to(dtype)
        return [[extract(full, local)] for local in locals_]

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """This rank's local tensor from its pieces."""
        return pieces[0]

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """The output value of the target's kind around ``local``."""
        return local

    def replica_tensors(self, local: torch.Tensor) -> list[torch.Tensor]:
        """The tensors whose checksum stands for a replicated local value."""
        return [local]

    def held_box(self) -> Box | None:
        """Gathering: the box of the full tensor this rank holds (on every replica), or ``None``
        when it holds none; the gather picks, per box, the holder nearest the destination."""
        return full_box(self.shape)

    def send_local(self) -> torch.Tensor:
        """Gathering: the (dequantised, detached) local tensor to send."""
        return self.target.detach()


class PlainLayout(Layout):
    """A plain (replicated) tensor: every rank holds all of it (a gather takes it from the
    destination itself)."""


class DTensorLayout(Layout):
    """A DTensor on any mesh: this rank's box from DTensor's placement math (a gather takes each
    box from one of its replicas: :func:`fsdptk._engine.routes.choose_senders`)."""

    replicated = False
    target: DTensor  # (narrowed: layout_of picks this class for DTensors only)

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__(target)
        self.local = dtensor_box(self.target)

    def read_local(self, source: Any, key: str, dtype: torch.dtype, device: torch.device,
                   release: bool, reads: Reads) -> torch.Tensor:
        return reads.local(source.read(key, self.local), dtype, device)

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        return dtensor_like(self.target, local)

    def held_box(self) -> Box | None:
        return self.local if self.target.device_mesh.get_coordinate() is not None else None

    def send_local(self) -> torch.Tensor:
        return local_tensor(self.target).detach()


class NF4Layout(Layout):
    """A plain ``NF4Tensor``: the full tensor is quantised with the target's block sizes; its
    pieces are the NF4 inner tensors (of this rank's dim-0 chunk, see :class:`DTensorNF4Layout`)."""

    quantized = True

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__(target)
        self.like = local_tensor(target)
        self.local = []
        self.parts = [(tuple(p.shape), p.dtype) for p in _nf4.inner_tensors(self.like)]

    def wire_parts(self, local: Any, parts: Parts, dtype: torch.dtype) -> Parts:
        return parts

    def read_local(self, source: Any, key: str, dtype: torch.dtype, device: torch.device,
                   release: bool, reads: Reads) -> torch.Tensor:
        q = _nf4.quantize_like(source.read(key).to(device), self.like)
        return _nf4.chunk(q, self.local)

    def cut(self, full: torch.Tensor, locals_: Sequence[Any], dtype: torch.dtype,
            comm: torch.device) -> list[list[torch.Tensor]]:
        q = _nf4.quantize_like(full.to(comm), self.like)
        return [_nf4.inner_tensors(_nf4.chunk(q, local)) for local in locals_]

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        return _nf4.from_inner_tensors(pieces, self.like)

    def replica_tensors(self, local: torch.Tensor) -> list[torch.Tensor]:
        return _nf4.inner_tensors(local)

    def send_local(self) -> torch.Tensor:
        return _nf4.dequantize(self.like)


class DTensorNF4Layout(NF4Layout):
    """A DTensor wrapping an NF4 chunk (Shard(0) / Replicate placements only)."""

    replicated = False
    target: DTensor  # (narrowed: layout_of picks this class for DTensors only)

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__(target)
        self.local = _nf4_path(target)  # type: ignore[arg-type]  # validates the placements
        self.box = dtensor_box(self.target)

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        return dtensor_like(self.target, local)

    def held_box(self) -> Box | None:
        return self.box if self.target.device_mesh.get_coordinate() is not None else None


def layout_of(t: torch.Tensor) -> Layout:
    """The layout of a target tensor."""
    if isinstance(t, DTensor):
        return DTensorNF4Layout(t) if _nf4.is_nf4(local_tensor(t)) else DTensorLayout(t)
    return NF4Layout(t) if _nf4.is_nf4(t) else PlainLayout(t)

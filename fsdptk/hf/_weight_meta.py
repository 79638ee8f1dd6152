"""The records of :func:`fsdptk.hf.weight_source` (no communication here).

- :class:`ParamMeta`, :class:`Shard`, :class:`Replicate`: fsdptk's own frozen records with the
  fields and validation of vLLM 0.33's (``ParamMeta(name, dtype, shape, *, owners, mesh_shape,
  placements)``), used where vLLM's are not importable; :func:`record_types` gives vLLM's own
  classes where they are (imported there, lazily, and nowhere else in fsdptk), and says which.
- :class:`SparseWeightPatch` and :func:`patch_type`: the record of one tensor's changes.

The placement math (which pieces the ranks hold, cut through a conversion's nodes) is planned in
:mod:`fsdptk._plans.hub_pieces`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import torch

__all__ = ["ParamMeta", "Shard", "Replicate", "SparseWeightPatch", "RecordTypes", "VLLM_RECORDS", "VLLM_PATCHES",
           "record_types", "patch_type"]


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

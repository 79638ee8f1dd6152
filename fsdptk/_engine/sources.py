"""The source protocol of the engine: where full tensors come from during a load.

A source answers three questions, and the engine asks nothing else (it knows no file format):

* metadata: ``keys()``, ``key in source`` and ``meta(key)`` (shape and dtype, ideally without
  reading the data);
* read a box: ``read(key, box)`` returns the piece of the full tensor at ``box`` (``box=None``:
  the full tensor); a lazy source reads only the covering region (shard-on-read);
* release: ``release(key)`` drops the caller's entry once it is no longer needed.

``TensorMeta.held_on`` adds one fact the engine uses to size buckets: whether the source already
holds the whole tensor in memory (reading it allocates nothing), see :func:`holds_value`.

:class:`MappingSource` adapts a Mapping of full tensors (a dict, a lazy Mapping). A Mapping whose
values are read through safetensors-style slice objects (``get_slice(key)``) is adapted by
:class:`SliceSource` (shard-on-read: only the region of a box is read).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from fsdptk._engine.layouts import Box, extract

_ST_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_CODES[getattr(torch, _name)] = _code
# safetensors dtype code (as a slice's ``get_dtype()`` returns it) -> torch dtype
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {v: k for k, v in _ST_CODES.items()}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a source tensor, as agreed on every rank.

    ``held_on`` is the device type where the source already holds the whole tensor, contiguous, in
    memory (a plain ``dict`` of tensors), so that reading it allocates nothing; ``None`` for a lazy
    source (a file) or when unknown. It only sizes buckets (memory a read would add), so it does
    not take part in comparisons between ranks.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    held_on: str | None = field(default=None, compare=False)


class SourceProblem(Exception):
    """A source entry that cannot be loaded as it is (``kind`` is ``"TypeError"``/``"ValueError"``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@runtime_checkable
class Source(Protocol):
    """What the engine reads full tensors from (see the module docstring)."""

    def keys(self) -> Iterable[str]: ...

    def __contains__(self, key: object) -> bool: ...

    def meta(self, key: str) -> TensorMeta: ...

    def read(self, key: str, box: Box | None = None) -> torch.Tensor: ...

    def release(self, key: str) -> None: ...


class MappingSource:
    """A Mapping of full tensors as a :class:`Source` (every read takes the full value)."""

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        self.mapping = mapping

    def keys(self) -> Iterable[str]:
        return self.mapping.keys()

    def __contains__(self, key: object) -> bool:
        return key in self.mapping

    def meta(self, key: str) -> TensorMeta:
        value = self.mapping[key]
        if isinstance(value, DTensor):
            raise SourceProblem("TypeError", f"{key!r}: the source holds a DTensor; expected a full (plain) tensor")
        if not isinstance(value, torch.Tensor):
            raise SourceProblem("TypeError", f"{key!r}: expected a tensor, got {type(value).__name__} ({value!r:.60})")
        problem = unreadable(key, value)
        if problem is not None:
            raise SourceProblem("ValueError", problem)
        holds = holds_value(self.mapping, key) and value.is_contiguous()
        return TensorMeta(tuple(value.shape), value.dtype, value.device.type if holds and not value.is_meta else None)

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        full = self.mapping[key]
        return full if box is None else extract(full, box)

    def release(self, key: str) -> None:
        if hasattr(self.mapping, "__delitem__"):
            try:
                del self.mapping[key]
            except (KeyError, TypeError, NotImplementedError):
                pass


class ShapesSource:
    """Shapes and dtypes only, no data: a :class:`Source` for agreeing on a plan whose tensors are
    read from another source later (an optimizer's state is agreed over its parameters' shapes).

    Example:
        >>> import torch
        >>> ShapesSource({"w": TensorMeta((2, 3), torch.float32)}).meta("w").shape
        (2, 3)
    """

    def __init__(self, metas: Mapping[str, TensorMeta]) -> None:
        self.metas = metas

    def keys(self) -> Iterable[str]:
        return self.metas.keys()

    def __contains__(self, key: object) -> bool:
        return key in self.metas

    def meta(self, key: str) -> TensorMeta:
        return self.metas[key]

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        raise TypeError(f"{key!r}: a ShapesSource holds shapes and dtypes only, no data to read")

    def release(self, key: str) -> None:
        """Nothing is held: nothing to release."""


def unreadable(key: str, value: torch.Tensor) -> str | None:
    """Why the engine cannot read the source tensor ``value`` of ``key``, or ``None`` when it can.

    Refused in the metadata agreement (on every rank, naming the key) rather than failing as a
    torch error without the key once the data moves: a tensor on the ``meta`` device (no data: a
    state dict built under ``torch.device("meta")``, or one whose entries an earlier load released),
    a sparse (or other non-strided) tensor, and a tensor on a device this process cannot copy from
    (neither the CPU nor its accelerator, where the transport's pieces are made).

    Example:
        >>> import torch
        >>> unreadable("w", torch.ones(2)) is None
        True
        >>> unreadable("w", torch.ones(2).to_sparse())
        "'w': the source's tensor is sparse (layout torch.sparse_coo): pass a dense tensor (.to_dense())"
    """
    if value.is_meta:
        return (f"{key!r}: the source's tensor is on the meta device (shape {list(value.shape)}): it has no "
                "data to load (a state dict built under torch.device('meta'), or whose entries an earlier "
                "load released with release_sd=True: read it from the checkpoint again)")
    if value.layout != torch.strided:
        kind = "sparse" if value.is_sparse or "sparse" in str(value.layout) else "not a dense tensor"
        return f"{key!r}: the source's tensor is {kind} (layout {value.layout}): pass a dense tensor (.to_dense())"
    accelerator = torch.accelerator.current_accelerator()
    if value.device.type not in ("cpu", getattr(accelerator, "type", "cpu")):
        return (f"{key!r}: the source's tensor is on {value.device}, which this process cannot take "
                f"(the CPU or {accelerator or 'no accelerator'}): move it to the CPU first")
    return None


def holds_value(mapping: Any, key: str) -> bool:
    """Whether ``mapping[key]`` returns a tensor the mapping already holds (reading it allocates
    nothing): true of a plain ``dict``; a Mapping that knows says so with a ``holds(key)``
    method; any other Mapping may build the value on access (e.g. from a file), so it does not.

    Example:
        >>> import torch
        >>> from types import MappingProxyType
        >>> holds_value({"w": torch.ones(1)}, "w"), holds_value(MappingProxyType({"w": torch.ones(1)}), "w")
        (True, False)
    """
    holds = getattr(mapping, "holds", None)
    if callable(holds):
        return bool(holds(key))
    return type(mapping).__getitem__ is dict.__getitem__


def as_source(obj: Any) -> Source:
    """``obj`` as a :class:`Source`: itself when it is one; a safetensors-style Mapping through the
    safetensors reader's adapter; any other Mapping through :class:`MappingSource`."""
    if isinstance(obj, Source):
        return obj
    if callable(getattr(obj, "get_slice", None)):
        return SliceSource(obj)
    return MappingSource(obj)


class SliceSource(MappingSource):
    """A Mapping read through safetensors-style slices, as a source of :mod:`fsdptk._engine`.

    ``mapping.get_slice(key)`` returns an object with ``get_shape()``, ``get_dtype()`` (a safetensors
    dtype code such as ``"BF16"``, or a torch dtype) and indexing by a tuple of slices that reads only
    that region: metadata costs no read, and a box reads only its covering region (shard-on-read).
    This is the safetensors side of the engine's source protocol (the engine knows no file format):
    :class:`fsdptk.checkpoint.SafetensorsCheckpoint` and the views over it are read through it.

    Args:
        mapping: the Mapping (``mapping[key]`` reads a full tensor; ``del mapping[key]`` releases).
    """

    mapping: Any  # a Mapping with get_slice(key)

    def meta(self, key: str) -> TensorMeta:
        """Shape and dtype of ``key`` from its slice's header (no data read)."""
        sl = self.mapping.get_slice(key)
        code = sl.get_dtype()
        dtype = SAFETENSORS_DTYPES.get(code, code) if isinstance(code, str) else code
        if not isinstance(dtype, torch.dtype):
            raise SourceProblem("TypeError", f"{key!r}: unknown dtype {code!r} in the source")
        return TensorMeta(tuple(int(n) for n in sl.get_shape()), dtype)

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        """The full tensor (``box=None``), or its piece at ``box`` read from the slice."""
        if box is None:
            return super().read(key)
        return extract(self.mapping.get_slice(key), box)

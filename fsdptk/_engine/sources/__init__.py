"""The source protocol of the engine: where full tensors come from during a load.

A source answers three questions, and the engine asks nothing else (it knows no file format):

* metadata: ``keys()``, ``key in source`` and ``meta(key)`` (shape and dtype, ideally without
  reading the data);
* read a box: ``read(key, box)`` returns the piece of the full tensor at ``box`` (``box=None``:
  the full tensor); a lazy source reads only the covering region (shard-on-read);
* release: ``release(key)`` drops the caller's entry once it is no longer needed.

``TensorMeta.held_on`` adds one fact the engine uses to size buckets: whether the source already
holds the whole tensor in memory (reading it allocates nothing), see :func:`holds_value`.

An optional attribute ``private_reads`` (default false) says that what ``read`` returns belongs to
this process alone and may be kept and written: fresh memory, or copy-on-write views of a private
file mapping (a safetensors file), never the caller's own tensors. The engine then keeps a read that
is already a local tensor instead of copying it (:class:`~fsdptk._engine.layouts.Reads`).

:class:`MappingSource` adapts a Mapping of full tensors (a dict, a lazy Mapping). A Mapping whose
values are read through safetensors-style slice objects (``get_slice(key)``) is adapted by
:class:`SliceSource` (shard-on-read: only the region of a box is read).

Views built by the public functions over what their caller passes (each once, at the call):
:class:`RenamedSource` (a Mapping under other keys: a checkpoint under the model's names, a tied
group under its canonical key through :func:`aliased`) and :class:`NestedSource` (a Mapping of
Mappings under flat names: the optimizer's saved state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
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
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("float8_e8m0fnu", "F8_E8M0"),
                     ("uint16", "U16"),
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

    Examples:
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

    Examples:
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

    Examples:
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

    @property
    def private_reads(self) -> bool:
        """The mapping's own ``private_reads`` (see the module docstring)."""
        return bool(getattr(self.mapping, "private_reads", False))

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


# ----------------------------------------------------------------------------------------------
# views: a caller's Mapping seen under other keys (built once, by the public function that takes it)
def release_keeping_key(mapping: Any, key: str) -> None:
    """torchtune's ``release_sd`` contract: free the entry's memory but keep its key.

    The value becomes a ``meta`` tensor of the same shape and dtype (no storage), so the caller's
    dict keeps every key it had (torchtune's LoRA recipe tests ``not state_dict`` afterwards) while
    the full tensor can be freed. A mapping that cannot be assigned to is left as it is.
    """
    value = mapping[key]
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return
    try:
        mapping[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    except (TypeError, NotImplementedError, AttributeError):
        pass


class RenamedSource(Mapping[str, Any]):
    """A Mapping seen under other keys, as a source: key ``k`` is the entry ``names[k]`` of
    ``mapping`` (read through ``as_source(mapping)``, so shard-on-read where the mapping allows).

    One adapter for every renaming view: the keys of a checkpoint under the model's names
    (``load_safetensors``' ``rename``), and a tied-parameter group under its canonical key
    (:func:`aliased`).

    Args:
        mapping: the caller's Mapping (or a source that is also a Mapping).
        names: key of this view -> key of ``mapping``, in this view's key order.
        released: key -> the keys of ``mapping`` that ``release(key)`` frees (default: ``[names[key]]``).
        release: how one entry of ``mapping`` is freed (``None``: never; the mapping is read-only).
        on_read: called with the key after each successful read (progress accounting).
    """

    def __init__(self, mapping: Mapping[str, Any], names: Mapping[str, str], *,
                 released: Mapping[str, list[str]] | None = None,
                 release: Callable[[Any, str], None] | None = None,
                 on_read: Callable[[str], None] | None = None) -> None:
        self.mapping, self.names = mapping, names
        self._inner = as_source(mapping)
        self._released = released or {}
        self._release, self._on_read = release, on_read

    @property
    def private_reads(self) -> bool:
        """The inner source's ``private_reads`` (see the module docstring)."""
        return bool(getattr(self._inner, "private_reads", False))

    def __getitem__(self, key: str) -> Any:
        out = self.mapping[self.names[key]]
        if self._on_read is not None:
            self._on_read(key)
        return out

    def __contains__(self, key: object) -> bool:
        return key in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def meta(self, key: str) -> TensorMeta:
        """Shape and dtype of ``key`` (its entry's, through the inner source)."""
        return self._inner.meta(self.names[key])

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        """``key``'s full tensor, or its piece at ``box`` (shard-on-read when the source can)."""
        out = self._inner.read(self.names[key], box)
        if self._on_read is not None:
            self._on_read(key)
        return out

    def release(self, key: str) -> None:
        """Free ``key``'s entries of ``mapping`` (all of a tied group's) with ``release``."""
        if self._release is None:
            return
        for k in self._released.get(key, [self.names.get(key, key)]):
            if k in self.mapping:
                self._release(self.mapping, k)


def aliased(mapping: Mapping[str, Any], aliases: Mapping[str, str]) -> RenamedSource:
    """The caller's full state dict seen through tied-parameter aliases: a tied group is one key.

    A group (``embed.weight`` / ``head.weight``, ``aliases`` maps each alias to its canonical key)
    is read from its canonical key, or from the first alias the mapping stores when it lacks that
    one; alias keys are not keys of the view (so not unexpected) and are released with the
    canonical key, keeping their keys (:func:`release_keeping_key`).
    """
    group: dict[str, list[str]] = {}
    for alias, canon in aliases.items():
        group.setdefault(canon, [canon]).append(alias)
    stored = {canon: next((k for k in keys if k in mapping), canon) for canon, keys in group.items()}
    names: dict[str, str] = {}
    for k in mapping:
        of = aliases.get(k)
        if of is None:
            names[k] = stored.get(k, k)
        elif of not in mapping and stored[of] == k:
            names[of] = k  # the mapping stores only an alias: it stands for the group
    return RenamedSource(mapping, names, released=group, release=release_keeping_key)


class _Nested(Mapping[str, Any]):
    """``outer[a][b]`` under flat names (``where[name] == (a, b)``); ``del`` deletes ``outer[a][b]``."""

    def __init__(self, outer: Mapping[str, Mapping[Any, Any]], where: Mapping[str, tuple[str, Any]]) -> None:
        self._outer, self._where = outer, where

    def __getitem__(self, name: str) -> Any:
        a, b = self._where[name]
        return self._outer[a][b]

    def __contains__(self, name: object) -> bool:
        where = self._where.get(name) if isinstance(name, str) else None
        return where is not None and where[1] in self._outer.get(where[0], {})

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._where if n in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __delitem__(self, name: str) -> None:
        a, b = self._where[name]
        del self._outer[a][b]  # type: ignore[attr-defined]  # the caller's inner dicts (a Mapping type)

    def holds(self, name: str) -> bool:
        """Whether ``self[name]`` is held in plain dicts (:func:`holds_value` at both levels)."""
        a, b = self._where[name]
        return holds_value(self._outer, a) and holds_value(self._outer[a], b)


class NestedSource(MappingSource):
    """Tensors of a Mapping of Mappings under flat names, as a source: ``name`` is
    ``outer[a][b]`` for each ``(name, a, b)`` of ``rows`` (the optimizer's saved per-parameter
    state as ``state.<fqn>.<key>``). Release deletes the inner entry (the caller's dicts); values
    held in plain dicts count as held (bucket sizing)."""

    def __init__(self, outer: Mapping[str, Mapping[Any, Any]], rows: Iterable[tuple[str, str, Any]]) -> None:
        super().__init__(_Nested(outer, {name: (a, b) for name, a, b in rows}))

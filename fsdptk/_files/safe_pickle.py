"""Reading DCP checkpoints without running code from them.

``torch.distributed.checkpoint`` pickles its ``.metadata`` and unpickles it with ``pickle.load``;
its default load planner unpickles non-tensor values (optimizer hyper-parameters, ``BytesIO``
entries) with ``torch.load(weights_only=False)``. Either runs any code a crafted file asks for. Here:

- :func:`safe_reader` returns a ``SafeFileSystemReader``, a ``FileSystemReader`` whose
  ``read_metadata`` (the documented ``StorageReader`` hook every DCP load goes through) unpickles
  with :class:`MetadataUnpickler`, which builds only the types DCP metadata is made of, and checks
  that every data file the metadata names is a plain file name in the directory and a regular
  file;
- :func:`safe_load_planner` returns a ``DefaultLoadPlanner`` whose ``load_bytes`` reads values with
  ``torch.load(weights_only=True)`` (tensors, numbers, strings, containers only; a ``BytesIO``
  entry, as ``save_dcp`` stores ``extra``, is unwrapped and its bytes read the same way).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch

from fsdptk._files.paths import plain_name, require_regular
from fsdptk.errors import CheckpointError

__all__ = ["MetadataUnpickler", "load_metadata", "safe_reader", "safe_load_planner"]

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # checkpoints written by older torch versions
    "torch.distributed._shard.sharded_tensor.metadata": frozenset({"TensorProperties",
                                                                    "MEM_FORMAT_ENCODING"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "complex", "slice"}),
}
# pathlib's classes, under every module name a Python version pickles them with: ``pathlib`` up to
# 3.12, ``pathlib._local`` from 3.13 on. They resolve to this interpreter's ``pathlib`` class of
# that name, so a checkpoint written under one Python version reads under any other.
_PATH_MODULES = frozenset({"pathlib", "pathlib._local"})
_PATH_CLASSES = frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                           "PureWindowsPath"})


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the classes DCP metadata is made of.

    Allowed: the dataclasses of ``torch.distributed.checkpoint.metadata``, DCP's ``_StorageInfo``,
    ``torch.Size``, torch dtypes and layouts, ``pathlib`` paths, ``OrderedDict`` and a few builtin
    containers. Anything else (``os.system``, ``builtins.exec``, any other class or function) is an
    ``pickle.UnpicklingError`` naming it, raised before it is called.
    """

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module in _PATH_MODULES and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        if module == "torch" and "." not in name:
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(
            f"{module}.{name} is not a DCP metadata type; refusing to load it (a checkpoint's "
            ".metadata may only hold torch.distributed.checkpoint metadata)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def load_metadata(path: Path) -> Any:
    """Read a DCP ``.metadata`` file with :class:`MetadataUnpickler` (regular files only).

    Args:
        path: the ``.metadata`` file.

    Returns:
        torch.distributed.checkpoint.metadata.Metadata: the metadata.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: not a regular file, not a pickle of DCP metadata, or holding other types.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    require_regular(path, "DCP metadata file")
    try:
        with open(path, "rb") as fh:
            meta = MetadataUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, MemoryError, RecursionError, UnicodeDecodeError, OverflowError) as e:
        raise CheckpointError(f"{str(path)!r} is not readable DCP metadata "
                              f"({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata) or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{str(path)!r} is not readable DCP metadata (it holds a "
                              f"{type(meta).__name__}, not torch.distributed.checkpoint Metadata)")
    return meta


def _check_storage(directory: Path, meta: Any) -> None:
    files: set[str] = set()
    for index, info in (meta.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        try:
            files.add(plain_name(rel, what=f"DCP metadata of {str(directory)!r} (entry {index.fqn!r})"))
        except AttributeError:
            raise CheckpointError(f"DCP metadata of {str(directory)!r} has a malformed storage "
                                  "entry") from None
    for name in sorted(files):
        require_regular(directory / name, f"DCP data file (named by {str(directory / '.metadata')!r})")


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` that reads ``.metadata`` with :class:`MetadataUnpickler` and checks
        the data files it names (plain names, regular files) before any is opened."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            path = Path(self._get_metadata_path(rank))
            meta = load_metadata(path)
            _check_storage(path.parent, meta)
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeFileSystemReader


_READER: list[type] = []  # the class, built on first use (torch.distributed.checkpoint imports lazily)


def safe_reader(path: str | os.PathLike[str]) -> Any:
    """A ``SafeFileSystemReader`` (a ``torch.distributed.checkpoint.FileSystemReader``) for ``path``
    that runs no code from the checkpoint (see the module docstring).

    Args:
        path: the DCP checkpoint directory.

    Returns:
        FileSystemReader: the reader, for ``dcp.load(..., storage_reader=...)``.
    """
    if not _READER:
        _READER.append(_reader_class())
    return _READER[0](str(path))


def safe_load_planner(*, allow_partial_load: bool = False) -> Any:
    """A ``DefaultLoadPlanner`` that reads non-tensor values with ``torch.load(weights_only=True)``.

    Args:
        allow_partial_load: as ``DefaultLoadPlanner``'s.

    Returns:
        DefaultLoadPlanner: the planner.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from fsdptk._core.compat import dcp_set_element

    set_element = dcp_set_element()

    class _SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                # DCP stores a BytesIO entry (save_dcp's ``extra``) as a pickled BytesIO: allow that
                # inert class, then read the bytes inside with weights_only too.
                with torch.serialization.safe_globals([io.BytesIO]):
                    obj = torch.load(value, weights_only=True)
                if isinstance(obj, io.BytesIO):
                    obj = torch.load(obj, weights_only=True) if obj.getbuffer().nbytes else None
            except Exception as e:  # noqa: BLE001 - any refusal is a bad checkpoint entry
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CheckpointError(
                    f"DCP entry {fqn!r} is not plain data (read with torch.load(weights_only=True), "
                    f"which allows only tensors, numbers, strings and containers): {first}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return _SafeLoadPlanner(allow_partial_load=allow_partial_load)

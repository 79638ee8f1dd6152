"""Atomic, streaming writer of safetensors checkpoints in the Hugging Face layout.

Writing lays every shard out from metadata first (keys, dtypes, shapes), so tensors can arrive in any order, one at a time, and go straight to their offset in their
file: the writer never holds more than the tensor it is given. The files are the standard format
(8-byte little-endian header length, JSON header padded to 8 bytes, then the data) and are checked
by ``safetensors.torch.load_file`` in the tests.

Atomicity: shards are written as hidden temporary files in the target directory, flushed and
``fsync``-ed; only then are they renamed into place, the index last (after the old index has been
removed), so a failure while writing leaves an existing checkpoint untouched and an interrupted
commit never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdptk._safetensors_io import (
    _SHARD_RE,
    INDEX_SUFFIX,
    CheckpointError,
    _numel,
    parse_size,
    st_dtype,
)

__all__ = ["ShardedWriter", "plan_shards"]




@dataclass
class _Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: int = 0
    offset: int = 0  # absolute offset of the data in its file


@dataclass
class _File:
    name: str
    entries: list[_Entry] = field(default_factory=list)
    header: bytes = b""
    size: int = 0
    remaining: int = 0  # keys not written yet


def plan_shards(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], max_shard_size: int,
                *, prefix: str = "model", metadata: Mapping[str, str] | None = None) -> list[_File]:
    """Assign tensors to files, in order, HF style: a new file when the next tensor would overflow
    ``max_shard_size`` (a tensor larger than that gets a file of its own)."""
    groups: list[list[_Entry]] = [[]]
    used = 0
    for key, dtype, shape in entries:
        st_dtype(dtype)
        e = _Entry(key, dtype, tuple(int(s) for s in shape), _numel(shape) * dtype.itemsize)
        if groups[-1] and used + e.nbytes > max_shard_size:
            groups.append([])
            used = 0
        groups[-1].append(e)
        used += e.nbytes
    n = len(groups)
    files = []
    for i, group in enumerate(groups):
        name = f"{prefix}.safetensors" if n == 1 else f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
        files.append(_layout(_File(name), group, i, metadata or {}))
    return files


def _layout(f: _File, entries: list[_Entry], index: int, metadata: Mapping[str, str]) -> _File:
    # Larger items first keeps every tensor aligned to its element size (the data starts 8-aligned).
    entries = sorted(entries, key=lambda e: (-e.dtype.itemsize, e.key))
    meta = {"format": "pt", **{str(k): str(v) for k, v in metadata.items()}}
    header: dict[str, Any] = {"__metadata__": meta}
    pos = 0
    for e in entries:
        header[e.key] = {"dtype": st_dtype(e.dtype), "shape": list(e.shape),
                         "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.header = len(raw).to_bytes(8, "little") + raw
    for e in entries:
        e.file = index
        e.offset = len(f.header) + int(header[e.key]["data_offsets"][0])
    f.entries, f.size = entries, len(f.header) + pos
    f.remaining = len(entries)  # keys still to be written
    return f


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


class ShardedWriter:
    """Stage a safetensors checkpoint in ``directory`` and make it visible atomically on commit.

    Create it with the full list of entries (metadata only); call :meth:`write` once per key in any
    order; then :meth:`commit` (or :meth:`abort`). Creating it checks the directory is writable and
    has room for the data, so an unusable target fails before any tensor is produced.
    """

    def __init__(self, directory: str | os.PathLike[str],
                 entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], *,
                 max_shard_size: int | str, metadata: Mapping[str, str] | None = None,
                 prefix: str = "model") -> None:
        self.directory = Path(directory)
        self.files = plan_shards(entries, parse_size(max_shard_size), prefix=prefix, metadata=metadata)
        self.index_path = self.directory / (prefix + INDEX_SUFFIX)
        self._entries = {e.key: e for f in self.files for e in f.entries}
        self.total_size = sum(e.nbytes for e in self._entries.values())
        self._token = uuid.uuid4().hex[:8]
        self._handles: dict[int, Any] = {}
        self._done: set[int] = set()
        self._written: set[str] = set()
        self._closed = False
        self._preflight()

    def _tmp(self, name: str) -> Path:
        return self.directory / f".{name}.{self._token}.tmp"

    def _preflight(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise type(e)(e.errno, f"cannot create checkpoint directory {str(self.directory)!r}: "
                                   f"{e.strerror}") from e
        if not self.directory.is_dir():
            raise NotADirectoryError(f"checkpoint target {str(self.directory)!r} is not a directory")
        need = sum(f.size for f in self.files)
        free = shutil.disk_usage(self.directory).free
        if need > free:
            raise OSError(28, f"not enough space in {str(self.directory)!r}: the checkpoint needs "
                              f"{need} bytes, {free} are free")
        self._open(0)

    def _open(self, i: int) -> Any:
        fh = self._handles.get(i)
        if fh is None:
            f = self.files[i]
            try:
                fh = open(self._tmp(f.name), "wb")
            except OSError as e:
                raise type(e)(e.errno, f"cannot write to checkpoint directory "
                                       f"{str(self.directory)!r}: {e.strerror}") from e
            self._handles[i] = fh
            fh.write(f.header)
        return fh

    def _finish(self, i: int) -> None:
        fh = self._handles[i]
        fh.flush()
        os.fsync(fh.fileno())
        fh.close()
        self._done.add(i)

    def write(self, key: str, tensor: torch.Tensor) -> int:
        """Write one tensor at its planned place; returns the bytes written."""
        e = self._entries.get(key)
        if e is None:
            raise CheckpointError(f"key {key!r} was not planned for this checkpoint")
        if tuple(tensor.shape) != e.shape or tensor.dtype != e.dtype:
            raise CheckpointError(f"key {key!r}: got {tuple(tensor.shape)} {tensor.dtype}, planned "
                                  f"{e.shape} {e.dtype}")
        if key in self._written:
            raise CheckpointError(f"key {key!r} written twice")
        fh = self._open(e.file)
        fh.seek(e.offset)
        fh.write(_tensor_bytes(tensor))
        self._written.add(key)
        f = self.files[e.file]
        f.remaining -= 1
        if f.remaining == 0:
            self._finish(e.file)
        return e.nbytes

    def commit(self) -> Path:
        """Rename the staged files into place (old index removed first, new index last) and delete
        the files of the previous checkpoint that the new one does not reuse.

        Returns:
            Path: the index file, or the single ``.safetensors`` file.
        """
        missing = [k for k in self._entries if k not in self._written]
        if missing:
            raise CheckpointError(f"{len(missing)} planned keys were never written, e.g. {missing[:5]}")
        prefix_index = self.index_path
        old = _old_files(self.directory, prefix_index)
        new_names = {f.name for f in self.files}
        index_tmp = None
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_size},
                     "weight_map": {k: self.files[e.file].name for k, e in sorted(self._entries.items())}}
            index_tmp = self._tmp(prefix_index.name)
            with open(index_tmp, "w") as fh:
                json.dump(index, fh, indent=2)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
        # From here on only renames: the old index goes first, so no mix ever looks complete.
        if prefix_index.exists():
            prefix_index.unlink()
        for f in self.files:
            os.replace(self._tmp(f.name), self.directory / f.name)
        if index_tmp is not None:
            os.replace(index_tmp, prefix_index)
        for p in old - new_names:
            (self.directory / p).unlink(missing_ok=True)
        _fsync_dir(self.directory)
        self._closed = True
        return prefix_index if index_tmp is not None else self.directory / self.files[0].name

    def abort(self) -> None:
        """Close and delete every staged file (the previous checkpoint is untouched)."""
        for fh in self._handles.values():
            try:
                fh.close()
            except OSError:
                pass
        for f in self.files:
            self._tmp(f.name).unlink(missing_ok=True)
        self._closed = True


def _old_files(directory: Path, index: Path) -> set[str]:
    """Names of the files of the checkpoint currently in ``directory`` under the same prefix."""
    prefix = index.name.removesuffix(INDEX_SUFFIX)
    names: set[str] = set()
    if index.is_file():
        try:
            names |= set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            pass
    if (directory / f"{prefix}.safetensors").is_file():
        names.add(f"{prefix}.safetensors")
    for p in directory.glob(f"{prefix}-*-of-*.safetensors"):
        m = _SHARD_RE.match(p.name)
        if m and m.group("prefix") == prefix:
            names.add(p.name)
    return {n for n in names if "/" not in n and n != ".."}


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

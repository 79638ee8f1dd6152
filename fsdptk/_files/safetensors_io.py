"""Safetensors files in the Hugging Face layout: the lazy reader, dtype codes and sizes.

Layout (what ``transformers`` writes and reads): either one ``model.safetensors`` or shards
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": <tensor bytes>}, "weight_map": {key: shard file}}``).

Reading goes through the ``safetensors`` library (``safe_open``; headers only until a tensor or a
slice of one is asked for).
The writer is :mod:`fsdptk._files.safetensors_writer`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fsdptk._engine.sources import SAFETENSORS_DTYPES as _ST_TO_DTYPE
from fsdptk._files.paths import plain_name, require_regular
from fsdptk.errors import CheckpointError

__all__ = ["SafetensorsCheckpoint", "parse_size", "resolve_files", "HeaderEntry", "read_header"]

INDEX_SUFFIX = ".safetensors.index.json"
# HF shard names; fsdptk adds a save token (``.1a2b3c4d``) when the plain names are taken
_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})(?:\.[0-9a-f]{8})?\.safetensors$")

_DTYPE_TO_ST: dict[torch.dtype, str] = {v: k for k, v in _ST_TO_DTYPE.items()}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9), ``"500MiB"`` (2**20) or ``"4096"``.

    Args:
        size: a positive int, or a number with an optional unit (B, KB, MB, GB, TB, KiB ... TiB).

    Returns:
        int: the size in bytes.

    Raises:
        ValueError: for a non-positive size or an unknown unit.

    Examples:
        >>> parse_size("5GB"), parse_size("1MiB"), parse_size(10)
        (5000000000, 1048576, 10)
    """
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be a size in bytes or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"cannot parse size {size!r}: expected e.g. 5GB, 500MB, 2GiB or an int")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a torch dtype (ValueError for one safetensors cannot store)."""
    code = _DTYPE_TO_ST.get(dtype)
    if code is None:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors (supported: "
                              f"{sorted(str(d) for d in _DTYPE_TO_ST)})")
    return code


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code such as ``"BF16"``."""
    dtype = _ST_TO_DTYPE.get(code)
    if dtype is None:
        raise CheckpointError(f"safetensors dtype {code!r} has no torch equivalent here")
    return dtype


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ----------------------------------------------------------------------------------------------
# reading


def _open(file: Path, origin: str) -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        st = require_regular(file, "safetensors file")
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"safetensors file {str(file)!r} is missing{origin}") from None
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise CheckpointError(
            f"{str(file)!r} is not a readable safetensors file (corrupt or truncated, "
            f"{st.st_size} bytes on disk): {e}") from e


def resolve_files(path: Path) -> tuple[Path | None, list[Path]]:
    """(index file or None, safetensors files) of a checkpoint path.

    In a directory, ``model.safetensors`` is preferred to an index, as ``transformers`` does
    (``modeling_utils._get_resolved_checkpoint_files`` checks the single file first): a stale
    ``model.safetensors.index.json`` beside a newer single file is ignored.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"no safetensors checkpoint at {str(path)!r}: no such file "
                                              "or directory") from None
    if not stat.S_ISDIR(st.st_mode):
        require_regular(path, "checkpoint file")
        if path.name.endswith(INDEX_SUFFIX) or path.suffix == ".json":
            return path, []
        return None, [path]
    single = path / "model.safetensors"
    if os.path.lexists(single):
        require_regular(single, "safetensors file")
        return None, [single]
    indexes = sorted(path.glob("*" + INDEX_SUFFIX))
    if len(indexes) > 1:
        preferred = path / ("model" + INDEX_SUFFIX)
        if preferred not in indexes:
            raise CheckpointError(f"{str(path)!r} holds several index files "
                                  f"{[p.name for p in indexes]}: pass the one to load")
        indexes = [preferred]
    if indexes:
        require_regular(indexes[0], "safetensors index")
        return indexes[0], []
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    sharded = [p.name for p in files if _SHARD_RE.match(p.name)]
    if sharded:
        raise CheckpointError(
            f"{str(path)!r} holds shard files {sharded[:3]}{'...' if len(sharded) > 3 else ''} but no "
            f"'*{INDEX_SUFFIX}': the save that wrote them did not complete")
    if not files:
        raise FileNotFoundError(errno.ENOENT, f"no '*.safetensors' file and no '*{INDEX_SUFFIX}' in "
                                              f"{str(path)!r}")
    return None, files


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """A lazy, read-only ``Mapping[str, Tensor]`` over a safetensors checkpoint.

    Opening reads only the JSON headers (and checks them: every file present and complete, every key
    of the index in the file it names). ``ckpt[key]`` reads one full tensor; ``get_slice(key)``
    returns the ``safetensors`` slice object (``get_shape()``, ``get_dtype()``, indexing with a tuple
    of slices reads only that region), which is what shard-on-read loading uses.
    ``fsdptk.load_from_full_model_state_dict`` accepts it as ``full_sd``.

    Args:
        path: a ``.safetensors`` file, an ``*.safetensors.index.json`` file, or a directory holding
            a ``model.safetensors`` (preferred, as ``transformers`` prefers it: an index beside it
            is stale), an index (``model.safetensors.index.json`` preferred), or unsharded
            ``*.safetensors`` files (their union).

    Index entries must be plain file names in the index's directory (a file may be a symlink, as
    in the Hugging Face cache); only regular files are opened (a FIFO or device never is).

    Raises:
        FileNotFoundError: no checkpoint at ``path``, or a shard the index names is missing.
        CheckpointError: a corrupt or truncated file, a bad index, an index naming a key its file
            does not hold or a file outside its directory (``../x``, an absolute path), a file that
            is not a regular file, a key in two files, or shard files left without their index.

    Examples:
        >>> import tempfile, torch
        >>> from safetensors.torch import save_file
        >>> d = tempfile.mkdtemp()
        >>> save_file({"w": torch.ones(2, 3)}, f"{d}/model.safetensors")
        >>> with SafetensorsCheckpoint(d) as ckpt:
        ...     list(ckpt), ckpt.shape("w"), ckpt.get_slice("w")[0:1, 1:3].tolist()
        (['w'], torch.Size([2, 3]), [[1.0, 1.0]])
    """

    # What ``safe_open(framework="pt")`` returns (a tensor, or a slice read along dim 0) is a view
    # of the file mapped copy-on-write (``MAP_PRIVATE``), never a mapping shared with the file: the
    # engine keeps such reads as local shards (``private_reads``, see docs/checkpoint.md).
    private_reads = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        index, files = resolve_files(self.path)
        self.index_file = index
        self._handles: dict[Path, Any] = {}
        self._file_of: dict[str, Path] = {}
        try:
            if index is not None:
                self._read_index(index)
            else:
                self._read_files(files)
        except BaseException:
            self.close()
            raise

    def _read_index(self, index: Path) -> None:
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"index {str(index)!r} is not a valid safetensors index "
                                  f"({type(e).__name__}: {e})") from e
        by_file: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            plain_name(fname, what=f"index {str(index)!r} (key {key!r})")
            by_file.setdefault(fname, []).append(str(key))
        for fname, keys in by_file.items():
            file = index.parent / fname
            handle = _open(file, f" (named by the index {str(index)!r} for {len(keys)} keys, "
                                 f"e.g. {keys[0]!r})")
            self._handles[file] = handle
            present = set(handle.keys())
            for key in keys:
                if key not in present:
                    raise CheckpointError(
                        f"index {str(index)!r} maps key {key!r} to {fname!r}, which does not contain "
                        f"it ({len(present)} tensors in that file)")
                self._file_of[key] = file

    def _read_files(self, files: list[Path]) -> None:
        for file in files:
            handle = _open(file, "")
            self._handles[file] = handle
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                if key in self._file_of:
                    raise CheckpointError(f"key {key!r} is in both {str(self._file_of[key])!r} and "
                                          f"{str(file)!r}")
                self._file_of[key] = file

    # Mapping protocol ---------------------------------------------------------------------
    def __getitem__(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, key: object) -> bool:
        return key in self._file_of

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({str(self.path)!r}, {len(self)} tensors, {len(self.files)} files)"

    # metadata ---------------------------------------------------------------------------------
    def _handle(self, key: str) -> Any:
        file = self._file_of.get(key)
        if file is None:
            raise KeyError(key)
        handle = self._handles.get(file)
        if handle is None:
            raise ValueError(f"{self!r} is closed")
        return handle

    def get_slice(self, key: str) -> Any:
        """The ``safetensors`` slice of ``key``: ``get_shape()``, ``get_dtype()``, ``[slices]``."""
        return self._handle(key).get_slice(key)

    def shape(self, key: str) -> torch.Size:
        """Shape of ``key`` (header only)."""
        return torch.Size(self.get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """torch dtype of ``key`` (header only)."""
        return torch_dtype(self.get_slice(key).get_dtype())

    def nbytes(self, key: str) -> int:
        """Bytes of ``key``'s data."""
        return _numel(self.shape(key)) * self.dtype(key).itemsize

    def metadata(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``{key: (shape, dtype)}`` of every tensor, read from the headers only."""
        return {k: (self.shape(k), self.dtype(k)) for k in self}

    @property
    def total_size(self) -> int:
        """Bytes of tensor data over all keys."""
        return sum(self.nbytes(k) for k in self)

    @property
    def files(self) -> list[Path]:
        """The safetensors files this checkpoint reads."""
        return list(self._handles)

    def file_of(self, key: str) -> Path:
        """The file that holds ``key``."""
        return self._file_of[key]

    def close(self) -> None:
        """Release the open files (the Mapping is unusable afterwards)."""
        for handle in self._handles.values():
            exit_ = getattr(handle, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._handles = {k: None for k in self._handles}

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# headers only (``fsdptk inspect``): no tensor data is read
class HeaderEntry(NamedTuple):
    """One tensor of a safetensors header, checked against the file's size."""

    key: str
    code: str  # the safetensors dtype code ("BF16")
    dtype: torch.dtype | None  # None: a code this torch does not know
    shape: list[int]
    nbytes: int


def _header_entry(key: str, meta: Any, data_len: int) -> HeaderEntry:
    """One validated header entry (ValueError naming what is wrong)."""
    if not isinstance(meta, dict):
        raise ValueError(f"entry {key!r} is a JSON {type(meta).__name__}, not an object")
    code, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(code, str):
        raise ValueError(f"entry {key!r} has no dtype")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"entry {key!r} has shape {shape!r}, not a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"entry {key!r} has data_offsets {offsets!r}, not [begin, end]")
    nbytes = offsets[1] - offsets[0]
    if offsets[1] > data_len:
        raise ValueError(f"entry {key!r} ends at data offset {offsets[1]} but the file holds only "
                         f"{data_len} data bytes (truncated?)")
    dtype = _ST_TO_DTYPE.get(code)
    if dtype is not None and nbytes != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"entry {key!r}: {nbytes} data bytes for shape {shape} of {code} "
                         f"({math.prod(shape) * dtype.itemsize} expected)")
    return HeaderEntry(key, code, dtype, shape, nbytes)


def read_header(path: Path, size: int) -> list[HeaderEntry]:
    """Every tensor entry of the safetensors file ``path`` (a regular file of ``size`` bytes) from
    its JSON header alone, each checked against the file size.

    Raises:
        ValueError: a header that does not fit, is not a JSON object, or an entry without a dtype,
            a valid shape or offsets inside the file (names the entry).
        RecursionError: a header nested too deeply for the JSON parser.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if size < 8 or n <= 0 or n > min(100 * 2**20, size - 8):
            raise ValueError(f"header length {n} does not fit in a {size}-byte file")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    data_len = size - 8 - n
    return [_header_entry(k, m, data_len) for k, m in header.items() if k != "__metadata__"]

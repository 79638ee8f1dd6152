"""Atomic, streaming writer of safetensors checkpoints in the Hugging Face layout.

Writing lays every shard out from metadata first (keys, dtypes, shapes), so tensors can arrive in
any order, one at a time, and go straight to their offset in their file: the writer never holds
more than the tensor it is given. The files are the standard format (8-byte little-endian header
length, JSON header padded to 8 bytes, then the data) and are checked by
``safetensors.torch.load_file`` in the tests.

Safety (see :mod:`fsdptk._files.commit` for the commit steps): the writer holds the directory's
lock (``.fsdptk.lock``) from creation to commit or abort, so a second writer fails at once; it first
finishes or undoes what a killed writer left (journal, temporary files); shards are written as
hidden temporary files, fsync-ed, and renamed to names that do not exist yet; the index (or the
single ``model.safetensors``) is renamed over the old one last, which is the commit. Killed at any
step, the directory loads as the complete old or the complete new checkpoint.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdptk._files.commit import commit_files, fsync_dir, journal_path, recover_safetensors, tmp_name
from fsdptk._files.lock import DirectoryLock
from fsdptk._files.safetensors_io import (
    INDEX_SUFFIX,
    CheckpointError,
    _numel,
    parse_size,
    st_dtype,
)

__all__ = ["ShardFiles", "ShardedWriter", "plan_shards"]

LOCK_NAME = ".fsdptk.lock"


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
        if key == "__metadata__":
            raise CheckpointError("a tensor cannot be named '__metadata__' in a safetensors file (that "
                                  "header entry holds the file's metadata): rename it")
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
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs lack __buffer__


# Direct I/O (O_DIRECT) for the shards: a save fsyncs every file before its commit anyway, so the
# data may as well go to the disk without passing through the page cache. On this project's machines
# (virtual, 2 cores) writing 2 GB through the page cache and then fsyncing took 3.3-8.2 s where the
# same bytes written with O_DIRECT took 1.4-1.8 s (dd, 16 MiB blocks), and the page cache keeps what
# it held. FSDPTK_DIRECT_IO=0 turns it off.
# offsets, lengths and buffer addresses of O_DIRECT writes: a multiple of this (a page, so no page
# of the page cache holds both a block written directly and one written through the cache)
_ALIGN = max(4096, mmap.PAGESIZE)
_STAGE = 16 << 20  # the staging buffer of one file (a multiple of _ALIGN)
_MIN_DIRECT = 8 << 20  # a write with fewer whole blocks goes through the page cache (a direct write waits for the disk)


def _direct_io() -> bool:
    return hasattr(os, "O_DIRECT") and os.environ.get("FSDPTK_DIRECT_IO", "1") != "0"


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class _ShardOut:
    """One temporary shard file being written: tensors at their planned offsets (any order), then
    :meth:`finish` (durable) or :meth:`close` (abandoned).

    Each write's whole aligned blocks go to the disk with ``O_DIRECT``, copied through a
    page-aligned staging buffer; its unaligned head and tail (under one block each, the blocks it
    shares with its neighbours) and writes too small to be worth it go through the page cache.
    No block is written both ways, and :meth:`finish` fsyncs the file, so the bytes on disk are
    those of ordinary writes. A filesystem that refuses ``O_DIRECT`` (``EINVAL`` from the open or
    from a write) gets ordinary writes from there on.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self._direct = False
        if _direct_io():
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o666)
                self._direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                    raise
        if not self._direct:
            self._fd = os.open(path, flags, 0o666)
        self._plain_fd = -1  # the same file without O_DIRECT, for the heads and tails
        self._buf: mmap.mmap | None = None

    def _plain(self) -> int:
        if not self._direct:
            return self._fd
        if self._plain_fd < 0:
            self._plain_fd = os.open(self._path, os.O_WRONLY)
        return self._plain_fd

    def write_at(self, offset: int, data: memoryview) -> None:
        """Write ``data`` (bytes) at ``offset``."""
        n = len(data)
        lo = -(-offset // _ALIGN) * _ALIGN  # the first whole block
        hi = (offset + n) // _ALIGN * _ALIGN  # the end of the last one
        if not self._direct or hi - lo < _MIN_DIRECT:
            _pwrite_all(self._plain(), data, offset)
            return
        if lo > offset:
            _pwrite_all(self._plain(), data[:lo - offset], offset)
        self._write_direct(data[lo - offset:hi - offset], lo)
        if offset + n > hi:
            _pwrite_all(self._plain(), data[hi - offset:], hi)

    def _write_direct(self, data: memoryview, offset: int) -> None:
        if self._buf is None:
            self._buf = mmap.mmap(-1, _STAGE)  # anonymous: page-aligned
        view = memoryview(self._buf)
        try:
            pos = 0
            while pos < len(data):
                k = min(len(data) - pos, _STAGE)  # a multiple of _ALIGN: so are len(data) and _STAGE
                view[:k] = data[pos:pos + k]
                if self._direct:
                    try:
                        _pwrite_all(self._fd, view[:k], offset + pos)
                        pos += k
                        continue
                    except OSError as e:
                        if e.errno != errno.EINVAL:  # e.g. ENOSPC: the save fails as before
                            raise
                        self._set_buffered()  # opened with O_DIRECT but will not write so
                _pwrite_all(self._fd, data[pos:], offset + pos)
                return
        finally:
            view.release()

    def _set_buffered(self) -> None:
        import fcntl

        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._direct = False

    def _release(self) -> None:
        buf, self._buf = self._buf, None
        if buf is not None:
            try:
                buf.close()
            except BufferError:  # a slice of it lives in a pending traceback: freed with it
                pass

    def finish(self) -> None:
        """fsync the file (its direct and its ordinary writes) and close it."""
        try:
            os.fsync(self._fd)  # the inode: both descriptors' writes
        finally:
            self.close()

    def close(self) -> None:
        """Close the file's descriptors (both, even when closing the first fails: its error is
        raised after the second is closed) and drop the staging buffer; idempotent."""
        self._release()
        error: OSError | None = None
        for name in ("_plain_fd", "_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                try:
                    os.close(fd)  # Linux frees the descriptor even when close reports an error
                except OSError as e:
                    error = error or e
        if error is not None:
            raise error


def _named(e: OSError, what: str) -> OSError:
    """``e`` (its type and errno) with a message that says ``what`` failed, and why."""
    if e.errno is None:
        return type(e)(f"{what}: {e}")
    return type(e)(e.errno, f"{what}: {e.strerror or e}")


def _drop(fh: _ShardOut, path: Path) -> None:
    """Close ``fh`` and remove its file ``path`` (a failed save: nothing of it stays, and the
    error already raised is the one reported)."""
    try:
        fh.close()
    except OSError:
        pass
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


class ShardFiles:
    """Write the tensors of some files of a planned checkpoint under their temporary names.

    One writer of a save with several (``save_safetensors(..., writers=W)``): the coordinating
    writer (:class:`ShardedWriter`, rank 0) holds the directory's lock, picks the save's
    ``token`` and the files' names, and commits; every other writer builds the same plan from the
    same entries with that token and those names, writes the tensors it is given (any order, each
    at its planned offset), and fsyncs its files (:meth:`seal`) before the commit. No lock, no
    directory check: the coordinator did those before any writer started.
    """

    def __init__(self, directory: str | os.PathLike[str],
                 entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], *,
                 max_shard_size: int | str, metadata: Mapping[str, str] | None = None,
                 prefix: str = "model", token: str | None = None, names: Sequence[str] | None = None) -> None:
        self.directory = Path(directory)
        self.prefix = prefix
        self.files = plan_shards(entries, parse_size(max_shard_size), prefix=prefix, metadata=metadata)
        if names is not None:
            if len(names) != len(self.files):
                raise CheckpointError(f"the coordinating writer named {len(names)} files, this writer "
                                      f"planned {len(self.files)}")
            for f, name in zip(self.files, names):
                f.name = name
        self.index_path = self.directory / (prefix + INDEX_SUFFIX)
        self._entries = {e.key: e for f in self.files for e in f.entries}
        self.total_size = sum(e.nbytes for e in self._entries.values())
        self._token = token or uuid.uuid4().hex[:8]
        self._handles: dict[int, _ShardOut] = {}
        self._done: set[int] = set()
        self._written: set[str] = set()
        self._own: set[int] | None = None  # the files this writer writes (None: all of them)

    @property
    def token(self) -> str:
        """The save's token (in every temporary name)."""
        return self._token

    @property
    def names(self) -> list[str]:
        """The final names of the files, in plan order."""
        return [f.name for f in self.files]

    def file_of(self, key: str) -> int:
        """The index of the file ``key`` is planned in."""
        return self._entries[key].file

    def assign(self, own: Collection[int]) -> None:
        """This writer writes the files ``own`` (plan indices) and no other: a file it opened
        that is not among them (the coordinator's writability check) is closed and removed
        before any other writer opens it."""
        self._own = set(own)
        for i in [i for i in self._handles if i not in self._own]:
            self._handles.pop(i).close()
            self._tmp(self.files[i].name).unlink(missing_ok=True)

    def _tmp(self, name: str) -> Path:
        return self.directory / tmp_name(name, self._token)

    def _open(self, i: int) -> Any:
        """File ``i``'s temporary file, created with its header on first use. A failure there
        (``EDQUOT``, ``EIO``, ...) leaves nothing: both descriptors closed, the file removed."""
        fh = self._handles.get(i)
        if fh is None:
            path = self._tmp(self.files[i].name)
            try:
                fh = _ShardOut(path)
            except OSError as e:
                raise _named(e, f"cannot write to checkpoint directory {str(self.directory)!r}") from e
            try:
                fh.write_at(0, memoryview(self.files[i].header))
            except BaseException as e:
                _drop(fh, path)
                if isinstance(e, OSError):
                    raise _named(e, f"cannot write the header of {self.files[i].name!r} (temporary file "
                                    f"{str(path)!r})") from e
                raise
            self._handles[i] = fh
        return fh

    def _finish(self, i: int) -> None:
        self._handles[i].finish()
        self._done.add(i)

    def write(self, key: str, tensor: torch.Tensor) -> int:
        """Write one tensor at its planned place; returns the bytes written."""
        e = self._entries.get(key)
        if e is None:
            raise CheckpointError(f"key {key!r} was not planned for this checkpoint")
        if self._own is not None and e.file not in self._own:
            raise CheckpointError(f"key {key!r} is in {self.files[e.file].name}, which another writer writes")
        if tuple(tensor.shape) != e.shape or tensor.dtype != e.dtype:
            raise CheckpointError(f"key {key!r}: got {tuple(tensor.shape)} {tensor.dtype}, planned "
                                  f"{e.shape} {e.dtype}")
        if key in self._written:
            raise CheckpointError(f"key {key!r} written twice")
        fh = self._open(e.file)
        try:
            fh.write_at(e.offset, _tensor_bytes(tensor))
        except OSError as err:  # the file stays open: discard() / abort() close and remove it
            raise _named(err, f"cannot write {key!r} to {self.files[e.file].name!r} (temporary file "
                              f"{str(self._tmp(self.files[e.file].name))!r})") from err
        self._written.add(key)
        f = self.files[e.file]
        f.remaining -= 1
        if f.remaining == 0:
            self._finish(e.file)
        return e.nbytes

    def seal(self) -> None:
        """Check that every key of this writer's files was written, and fsync those files (a file
        with no tensor gets its header): after this the files are durable under their temporary
        names, ready for the coordinator's commit."""
        own = range(len(self.files)) if self._own is None else sorted(self._own)
        missing = [e.key for i in own for e in self.files[i].entries if e.key not in self._written]
        if missing:
            raise CheckpointError(f"{len(missing)} planned keys were never written, e.g. {missing[:5]}")
        for i in own:  # an empty shard (no tensor) is complete with its header
            if i not in self._done:
                self._open(i)
                self._finish(i)

    def discard(self) -> None:
        """Close and delete the temporary files this writer opened (a failed save)."""
        for i, fh in list(self._handles.items()):
            try:
                fh.close()
            except OSError:
                pass
            self._tmp(self.files[i].name).unlink(missing_ok=True)
        self._handles = {}


class ShardedWriter(ShardFiles):
    """Stage a safetensors checkpoint in ``directory`` and make it visible atomically on commit.

    Create it with the full list of entries (metadata only); call :meth:`write` once per key in any
    order; then :meth:`commit` (or :meth:`abort`). Creating it takes the directory's lock (a second
    writer fails at once with :class:`fsdptk._files.lock.CheckpointLockedError` naming the
    holder), recovers what a killed writer left, and checks the directory is writable and has room
    for the data, so an unusable target fails before any tensor is produced. With several writers
    it is the coordinating one: it writes the files :meth:`assign` gives it, the others
    (:class:`ShardFiles`, same ``token`` and ``names``) write theirs, and its :meth:`commit`
    renames every writer's sealed files into place.
    """

    def __init__(self, directory: str | os.PathLike[str],
                 entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], *,
                 max_shard_size: int | str, metadata: Mapping[str, str] | None = None,
                 prefix: str = "model") -> None:
        super().__init__(directory, entries, max_shard_size=max_shard_size, metadata=metadata, prefix=prefix)
        self._closed = False
        self._after_commit: list[Callable[[], Any]] = []
        self._lock = DirectoryLock(self.directory / LOCK_NAME, self.directory)
        self._preflight()

    def after_commit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` once the files are committed, while the directory's lock is still held
        (e.g. renaming a staged ``config.json`` into place), so no other writer can interleave."""
        self._after_commit.append(fn)

    def _preflight(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise type(e)(e.errno, f"cannot create checkpoint directory {str(self.directory)!r}: "
                                   f"{e.strerror}") from e
        if not self.directory.is_dir():
            raise NotADirectoryError(f"checkpoint target {str(self.directory)!r} is not a directory")
        try:
            self._lock.acquire()
        except (FileNotFoundError, PermissionError) as e:
            raise type(e)(e.errno, f"cannot write to checkpoint directory {str(self.directory)!r}: "
                                   f"{e.strerror}") from e
        try:
            recover_safetensors(self.directory, self.prefix)
            self._unique_shard_names()
            need = sum(f.size for f in self.files)
            free = shutil.disk_usage(self.directory).free
            if need > free:
                raise OSError(28, f"not enough space in {str(self.directory)!r}: the checkpoint needs "
                                  f"{need} bytes, {free} are free")
            self._open(0)
        except BaseException:
            self.discard()
            self._lock.release()
            raise

    def _unique_shard_names(self) -> None:
        """Shards never overwrite a file in place: when a planned name exists (the current
        checkpoint's shards), every shard of this save gets the save's token in its name."""
        if len(self.files) > 1 and any(os.path.lexists(self.directory / f.name) for f in self.files):
            for f in self.files:
                f.name = f.name.removesuffix(".safetensors") + f".{self._token}.safetensors"

    def commit(self) -> Path:
        """Commit the staged files (crash-safe steps of :mod:`fsdptk._files.commit`): the new
        checkpoint replaces the old one, whose files are then deleted (only fsdptk's own shard
        files, never other files of the directory), the :meth:`after_commit` callbacks run, and
        the lock is released.

        Returns:
            Path: the index file, or the single ``.safetensors`` file.
        """
        self.seal()  # its own files (the other writers sealed theirs before this call)
        absent = [f.name for f in self.files if not self._tmp(f.name).is_file()]
        if absent:  # before the journal: nothing of the current checkpoint is touched
            raise CheckpointError(f"{len(absent)} file(s) of the new checkpoint are missing from "
                                  f"{str(self.directory)!r} at the commit, e.g. {absent[:3]}")
        index = None
        if len(self.files) > 1:
            data = {"metadata": {"total_size": self.total_size},
                    "weight_map": {k: self.files[e.file].name for k, e in sorted(self._entries.items())}}
            index = (self._tmp(self.index_path.name).name, self.index_path.name)
            with open(self.directory / index[0], "w") as fh:
                json.dump(data, fh, indent=2)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
        commit_files(self.directory, self.prefix, self._token,
                     [(self._tmp(f.name).name, f.name) for f in self.files], index)
        self._closed = True
        try:
            for fn in self._after_commit:
                fn()
        finally:
            self._lock.release()
        return self.index_path if index is not None else self.directory / self.files[0].name

    def abort(self) -> None:
        """Close and delete every staged file (the previous checkpoint is untouched); an
        interrupted commit is finished or undone as the next writer would. Releases the lock."""
        for fh in self._handles.values():
            try:
                fh.close()
            except OSError:
                pass
        try:
            journal = journal_path(self.directory, self.prefix)
            if journal.exists():
                recover_safetensors(self.directory, self.prefix)
            for f in self.files:
                self._tmp(f.name).unlink(missing_ok=True)
            self._tmp(self.index_path.name).unlink(missing_ok=True)
            fsync_dir(self.directory)
        finally:
            self._closed = True
            self._lock.release()

"""One writer per checkpoint target: a lock file that names its holder.

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local and NFS filesystems) holding
JSON ``{"pid", "host", "started", "proc_start", "token"}``. A second writer fails at once with a
:class:`CheckpointLockedError` naming the holder. A lock is stale, and is taken over, when its
holder ran on this host and that process is gone (no such pid, or the pid now belongs to a process
started at another time), or when it belongs to this very process but no live lock object holds
it (an abandoned writer). A lock from another host is never taken over: the message says which file
to delete once that job is known to be gone. A lock file whose holder cannot be read (a writer
killed between creating it and writing it) is stale after a grace period; a writer whose write of
the lock file fails (``EDQUOT``, ``EIO``) removes the file it created, so it leaves no such file.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

from fsdptk.errors import CheckpointLockedError

__all__ = ["DirectoryLock"]

# a lock file with no readable holder (its writer was killed while creating it) is stale after this
_UNREADABLE_GRACE_S = 60.0
_HELD: set[str] = set()  # tokens of the locks this process holds now


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, proc_start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except OverflowError:
        return False
    now = _proc_start(pid)
    return not (proc_start and now and now != proc_start)


def _unlink_if_token(path: str, token: str) -> None:
    """Remove the lock file at ``path`` if it still holds ``token`` (finaliser of a lost lock)."""
    _HELD.discard(token)
    try:
        if json.loads(Path(path).read_text()).get("token") == token:
            os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass


class DirectoryLock:
    """An exclusive, non-blocking lock on a checkpoint target, held through a lock file.

    Args:
        lock_file: where the lock file lives (its directory must exist when acquiring).
        target: the checkpoint the lock protects (named in errors).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> d = Path(tempfile.mkdtemp())
        >>> with DirectoryLock(d / ".fsdptk.lock", d):
        ...     (d / ".fsdptk.lock").exists()
        True
        >>> (d / ".fsdptk.lock").exists()
        False
    """

    def __init__(self, lock_file: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        self.path = Path(lock_file)
        self.target = Path(target)
        self.token = uuid.uuid4().hex
        self._finalizer: Any = None

    def _info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _proc_start(os.getpid()),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "token": self.token}

    def _holder(self) -> dict[str, Any] | None:
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                return None  # never open a FIFO
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None
        except (OSError, ValueError):
            return None

    def _stale(self, holder: dict[str, Any] | None) -> bool:
        if holder is None:
            try:
                return time.time() - self.path.stat().st_mtime > _UNREADABLE_GRACE_S
            except FileNotFoundError:
                return True
        if holder.get("host") != socket.gethostname():
            return False
        if holder["pid"] == os.getpid():
            return holder.get("token") not in _HELD
        return not _alive(holder["pid"], holder.get("proc_start"))

    def _describe(self, holder: dict[str, Any] | None) -> str:
        if holder is None:
            return (f"{str(self.target)!r} is locked by another writer (lock file {str(self.path)!r}, "
                    "holder unreadable); delete the lock file if no save is running")
        mine = holder["pid"] == os.getpid() and holder.get("host") == socket.gethostname()
        me = " (this process)" if mine else ""
        return (f"{str(self.target)!r} is being written by another writer: pid {holder['pid']}{me} on host "
                f"{holder.get('host')!r}, since {holder.get('started')} (lock file {str(self.path)!r}); "
                "wait for it, or delete the lock file if that process is gone")

    def _take_over(self, holder: dict[str, Any] | None) -> None:
        aside = self.path.with_name(f"{self.path.name}.stale-{self.token[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            taken = json.loads(aside.read_text())
        except (OSError, ValueError):
            taken = None
        fresh = isinstance(taken, dict) and isinstance(taken.get("pid"), int)
        if fresh and (holder is None or taken.get("token") != holder.get("token")):
            try:  # a live lock was created between our read and the rename: give it back
                os.link(aside, self.path)
            except OSError:
                pass
            aside.unlink(missing_ok=True)
            raise CheckpointLockedError(self._describe(self._holder()))
        aside.unlink(missing_ok=True)

    def _fill(self, fd: int) -> None:
        """Write the holder into the lock file this process just created (``fd``) and close it.

        If that fails (``EDQUOT``, ``EIO``, ...) the file is removed, so the failure does not leave
        an unreadable lock that refuses every writer for ``_UNREADABLE_GRACE_S``. Removing it is
        safe: the file is this process's (created with ``O_EXCL``, the same inode as ``fd``), and no
        other writer can have taken it over meanwhile (an unreadable lock file is only taken over
        after the grace period). Only a writer killed between the create and the write leaves an
        empty lock file; the grace period is for that case.
        """
        made: os.stat_result | None = None
        try:
            try:
                made = os.fstat(fd)
                data = memoryview(json.dumps(self._info()).encode())
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            finally:
                os.close(fd)  # on some filesystems (NFS) a failed write is only reported here
        except BaseException as e:
            try:
                now = os.stat(self.path)
                if made is not None and (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
                    os.unlink(self.path)
            except OSError:  # gone already
                pass
            if isinstance(e, OSError) and e.errno is not None:
                raise type(e)(e.errno, f"cannot write the lock file {str(self.path)!r} of "
                                       f"{str(self.target)!r}: {e.strerror or e}") from e
            raise

    def acquire(self) -> None:
        """Take the lock now or fail (never waits).

        Raises:
            CheckpointLockedError: another live writer holds it (the message names its pid, host and
                start time, and the lock file).
            OSError: the lock file cannot be created or written (names the lock file and the cause;
                a lock file this call created and could not fill is removed, so the next attempt
                can succeed at once).
        """
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if not self._stale(holder):
                    raise CheckpointLockedError(self._describe(holder)) from None
                self._take_over(holder)
                continue
            self._fill(fd)
            _HELD.add(self.token)
            self._finalizer = weakref.finalize(self, _unlink_if_token, str(self.path), self.token)
            return
        raise CheckpointLockedError(self._describe(self._holder()))

    def release(self) -> None:
        """Give the lock back (removes the lock file if it is still ours; idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

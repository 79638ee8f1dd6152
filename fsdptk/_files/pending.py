"""The background save a process has pending (internal; see :mod:`fsdptk.background`).

A process runs at most one background save at a time: a new save (synchronous or not), a load
of a path the pending save writes, and process exit wait for it first. This module is the one
place that remembers it, so :mod:`fsdptk.checkpoint` and :mod:`fsdptk.dcp` can wait without
importing the background machinery.

Design note (process state): the pending save is per process by nature (it owns a thread and a
snapshot of this rank's shards), like the process group itself; it is kept in one private
registry object rather than passed around, because the calls that must wait for it (a load, a
save, interpreter exit) do not receive it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Protocol


class Pending(Protocol):
    """What the registry needs of a background save."""

    @property
    def path(self) -> Path: ...

    def done(self) -> bool: ...

    def join(self) -> None:
        """Block until the save has finished (its outcome is kept for ``wait()``)."""


class _Registry:
    """The latest background save of this process (pending or finished), if any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Pending | None = None

    def set(self, pending: Pending) -> None:
        with self._lock:
            self._pending = pending

    def get(self) -> Pending | None:
        with self._lock:
            return self._pending


REGISTRY = _Registry()


def _related(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same path or one lies inside the other."""
    a, b = Path(os.path.abspath(a)), Path(os.path.abspath(b))
    return a == b or a in b.parents or b in a.parents


def wait_for_pending(path: str | os.PathLike[str] | None = None) -> None:
    """Wait for this process's pending background save (``path``: only if it writes ``path``, a
    directory holding it, or a file inside it). Its outcome stays with its ``wait()``; this only
    blocks. Not collective: each rank waits for its own, and every rank's finishes together."""
    pending = REGISTRY.get()
    if pending is None or (path is not None and not _related(Path(path), pending.path)):
        return
    pending.join()

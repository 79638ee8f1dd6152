"""Path checks: plain file names, regular files only, source and destination apart."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fsdptk.errors import CheckpointError

__all__ = ["plain_name", "require_regular", "check_disjoint", "file_kind"]


def plain_name(name: object, *, what: str) -> str:
    """``name`` if it is a plain file name (no directory part, not ``.``/``..``), else an error.

    The check is on the name only: the file it names may be a symlink (the Hugging Face cache links
    ``snapshots/<rev>/model.safetensors`` to ``../../blobs/<hash>``).

    Args:
        name: the name read from a file (an index's ``weight_map`` value, a DCP storage path).
        what: where the name comes from, for the error message.

    Returns:
        str: ``name``.

    Raises:
        CheckpointError: ``name`` is not a string, is empty, absolute, ``.``/``..``, holds a path
            separator or a NUL byte.
    """
    if not isinstance(name, str):
        raise CheckpointError(f"{what} names {name!r} ({type(name).__name__}), not a file name")
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if (not name or name in (".", "..") or "\0" in name or any(s in name for s in seps)
            or os.path.isabs(name)):
        raise CheckpointError(f"{what} names {name!r}: only plain file names inside the checkpoint "
                                "directory are allowed (no directory part, no '..', not absolute)")
    return name


def file_kind(mode: int) -> str:
    """A word for the kind of file of an ``st_mode`` (``"directory"``, ``"FIFO"``, ...)."""
    for test, word in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISREG, "file")):
        if test(mode):
            return word
    return "special file"


def require_regular(path: Path, what: str) -> os.stat_result:
    """Stat ``path`` (following symlinks) and refuse anything but a regular file, before any open.

    A FIFO opened for reading blocks until a writer comes; a device can be endless: neither is ever
    opened.

    Args:
        path: the file.
        what: how to name it in errors (e.g. ``"safetensors file"``).

    Returns:
        os.stat_result: its status.

    Raises:
        FileNotFoundError: ``path`` does not exist (or is a dangling symlink).
        CheckpointError: ``path`` is a directory, FIFO, device or socket.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(e.errno, f"{what} {str(path)!r} is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{what} {str(path)!r} is a {file_kind(st.st_mode)}, not a regular "
                                "file; refusing to open it")
    return st


def check_disjoint(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Refuse a destination that is the source, lies inside it, or contains it (symlinks resolved).

    A converter replaces its destination as a whole, so any overlap would destroy the source.

    Args:
        src: the converter's input.
        dst: its output.

    Raises:
        ValueError: the paths overlap (the message names both).
    """
    a, b = Path(src).resolve(), Path(dst).resolve()
    if a == b:
        how = "is the source"
    elif a in b.parents:
        how = "is inside the source"
    elif b in a.parents:
        how = "contains the source"
    else:
        return
    raise ValueError(f"destination {str(dst)!r} {how} {str(src)!r}; writing it would destroy the "
                     "source: choose a destination outside it")

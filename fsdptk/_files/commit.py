"""Crash-safe commits of checkpoint files, and recovery of what a killed writer left.

Safetensors directory (``ShardedWriter``), with the target's lock held:

1. every new file is written under a temporary name ``.<name>.fsdptk-<token>.tmp`` and fsync-ed;
   new shard names never exist yet (``model-0000i-of-0000n.safetensors``, or
   ``model-0000i-of-0000n.<token>.safetensors`` when those names are taken), so no file of the
   current checkpoint is ever overwritten in place;
2. a journal ``.<prefix>.safetensors.fsdptk-commit.json`` is written atomically: the new names, the
   temporary names, and the old files to delete once the new checkpoint is committed;
3. the shards are renamed to their final names; a single ``model.safetensors`` is renamed over the
   old one: that rename is the commit (readers prefer it to an index, as transformers does);
4. for a sharded checkpoint, the new index is renamed over the old one: that rename is the commit;
5. the old files are deleted: only the old index, the old single file, and the files the old
   index lists whose names match fsdptk's shard pattern (never ``config.json``, never a directory);
6. the journal is removed.

Killed anywhere, the directory holds the complete old checkpoint (before the commit rename) or the
complete new one (after it). The next save to the directory (:func:`recover_safetensors`) reads the
journal: committed, it finishes step 5; not committed, it deletes the new files; either way it
removes temporary files matching fsdptk's naming.

DCP directory (``save_dcp``): staged in ``.<name>.fsdptk-stage-<token>`` beside ``path``, then
swapped in with one atomic ``renameat2(RENAME_EXCHANGE)`` where the filesystem supports it (``path``
never missing). Elsewhere ``path`` is renamed to ``.<name>.fsdptk-old-<token>`` and the staging
directory to ``path``; killed between the two renames, readers load the backup
(:func:`dcp_backup`) and the next save renames it back (:func:`recover_dcp`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fsdptk._files.paths import plain_name

__all__ = [
    "fsync_dir", "tmp_name", "shard_pattern", "journal_path", "commit_files",
    "recover_safetensors", "exchange", "dcp_names", "recover_dcp", "dcp_backup", "swap_in_dcp",
]

_TMP_RE = re.compile(r"^\.(?P<name>.+)\.fsdptk-(?P<token>[0-9a-f]{8,32})\.tmp$")
INDEX_SUFFIX = ".safetensors.index.json"


def fsync_dir(directory: Path) -> None:
    """fsync a directory so the renames in it are durable (best effort where unsupported)."""
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


def tmp_name(name: str, token: str) -> str:
    """The temporary name under which ``name`` is written by the save ``token``."""
    return f".{name}.fsdptk-{token}.tmp"


def shard_pattern(prefix: str) -> re.Pattern[str]:
    """Names of the checkpoint files fsdptk writes under ``prefix`` (single file or shards)."""
    return re.compile(rf"^{re.escape(prefix)}(?:-\d{{5}}-of-\d{{5}}(?:\.[0-9a-f]{{8}})?)?\.safetensors$")


def journal_path(directory: Path, prefix: str) -> Path:
    """The commit journal of the checkpoint ``prefix`` in ``directory``."""
    return directory / f".{prefix}.safetensors.fsdptk-commit.json"


def _write_json(path: Path, obj: Any, token: str) -> None:
    tmp = path.with_name(tmp_name(path.name, token))
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _index_names(index: Path) -> set[str] | None:
    """The file names an index's weight_map lists (None when there is no readable index)."""
    try:
        st = os.stat(index)
        if not stat.S_ISREG(st.st_mode):
            return None
        data = json.loads(index.read_text())
        return {str(v) for v in data["weight_map"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def old_files(directory: Path, prefix: str, new_names: Iterable[str]) -> list[str]:
    """The files of the current checkpoint that a new one replaces: its index, its single file, and
    the files its index lists whose names match fsdptk's shard pattern (not among ``new_names``)."""
    pattern, keep = shard_pattern(prefix), set(new_names)
    index = f"{prefix}{INDEX_SUFFIX}"
    names = {index, f"{prefix}.safetensors"} | (_index_names(directory / index) or set())
    return sorted(n for n in names if n not in keep and (n == index or pattern.match(n)))


def _delete(directory: Path, names: Iterable[str], prefix: str) -> None:
    """Unlink the checkpoint files ``names`` (plain names matching fsdptk's patterns; regular files
    or symlinks only: never a directory, never anything else)."""
    pattern, index = shard_pattern(prefix), f"{prefix}{INDEX_SUFFIX}"
    for name in names:
        try:
            plain_name(name, what="commit journal")
        except ValueError:
            continue
        if not (name == index or pattern.match(name)):
            continue
        p = directory / name
        try:
            mode = os.lstat(p).st_mode
            if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
                p.unlink()
        except OSError:
            pass


def commit_files(directory: Path, prefix: str, token: str, renames: Sequence[tuple[str, str]],
                 index: tuple[str, str] | None) -> None:
    """Steps 2 to 6 of the safetensors commit (see the module docstring).

    Args:
        directory: the checkpoint directory (the caller holds its lock).
        prefix: the checkpoint's file prefix (``"model"``).
        token: the save's token (in the journal, for recovery).
        renames: ``(temporary name, final name)`` of every data file, written and fsync-ed.
        index: ``(temporary name, final name)`` of the index, for a sharded checkpoint.
    """
    new = [final for _, final in renames]
    journal: dict[str, Any] = {"token": token, "sharded": index is not None, "new": new,
               "tmp": [t for t, _ in renames] + ([index[0]] if index else []),
               "delete": old_files(directory, prefix, new + ([index[1]] if index else []))}
    jpath = journal_path(directory, prefix)
    _write_json(jpath, journal, token)
    for tmp, final in renames:
        os.replace(directory / tmp, directory / final)
    fsync_dir(directory)
    if index is not None:
        os.replace(directory / index[0], directory / index[1])
        fsync_dir(directory)
    _delete(directory, journal["delete"], prefix)
    fsync_dir(directory)
    jpath.unlink(missing_ok=True)
    fsync_dir(directory)


def _committed(directory: Path, prefix: str, journal: dict[str, Any]) -> bool:
    new = [str(n) for n in journal.get("new", [])]
    if journal.get("sharded"):
        return _index_names(directory / f"{prefix}{INDEX_SUFFIX}") == set(new)
    # a single file: committed once its temporary file was renamed over the final name
    return bool(new) and all(not (directory / str(t)).exists() for t in journal.get("tmp", []))


def recover_safetensors(directory: Path, prefix: str) -> None:
    """Finish or undo a killed commit and remove fsdptk's stale temporary files (lock held).

    Args:
        directory: the checkpoint directory.
        prefix: the checkpoint's file prefix.
    """
    jpath = journal_path(directory, prefix)
    try:
        if not stat.S_ISREG(os.stat(jpath).st_mode):
            raise ValueError("not a regular file")  # never open a FIFO
        journal = json.loads(jpath.read_text())
        if not isinstance(journal, dict):
            raise ValueError("not an object")
    except FileNotFoundError:
        journal = None
    except (OSError, ValueError):
        journal = {}  # unreadable: only the temporary files are removed
    if journal:
        if _committed(directory, prefix, journal):
            _delete(directory, [str(n) for n in journal.get("delete", [])], prefix)
        elif journal.get("sharded"):  # not committed: the new shard names did not exist before
            _delete(directory, [str(n) for n in journal.get("new", [])], prefix)
    for p in directory.iterdir():
        if _TMP_RE.match(p.name):
            try:
                if stat.S_ISREG(os.lstat(p).st_mode):
                    p.unlink()
            except OSError:
                pass
    if journal is not None:
        try:
            jpath.unlink(missing_ok=True)
        except IsADirectoryError:
            pass
    fsync_dir(directory)


# ----------------------------------------------------------------------------------------------
# DCP directories
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns:
        bool: True when swapped; False when the system or filesystem cannot (nothing changed).

    Raises:
        OSError: any other failure of the call.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"cannot swap {str(a)!r} and {str(b)!r}: {os.strerror(err)}")


def _remove_tree(p: Path) -> None:
    """Delete a directory fsdptk staged (a symlink, as a swapped-out symlinked ``path``, is unlinked:
    what it points to is never deleted)."""
    if p.is_symlink():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


def dcp_names(path: Path) -> dict[str, str]:
    """Name prefixes of a DCP target's siblings: lock file, staging and backup directories."""
    return {"lock": f".{path.name}.fsdptk.lock", "stage": f".{path.name}.fsdptk-stage-",
            "old": f".{path.name}.fsdptk-old-"}


def _siblings(path: Path, start: str) -> list[Path]:
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(start)
                  and re.fullmatch(r"[0-9a-f]{8,32}", p.name[len(start):]))


def dcp_backup(path: Path) -> Path | None:
    """The backup of a DCP checkpoint a save left when killed between its two renames (``path``
    missing, the previous checkpoint under its backup name), or None."""
    if os.path.lexists(path):
        return None
    for p in _siblings(path, dcp_names(path)["old"]):
        if (p / ".metadata").is_file():
            return p
    return None


def recover_dcp(path: Path) -> None:
    """Restore a DCP checkpoint a killed save left under its backup name; delete stale staging and
    backup directories of ``path``. Lock held."""
    names = dcp_names(path)
    backup = dcp_backup(path)
    if backup is not None:
        os.rename(backup, path)
        fsync_dir(path.parent)
    for p in _siblings(path, names["stage"]) + _siblings(path, names["old"]):
        _remove_tree(p)


def swap_in_dcp(stage: Path, path: Path, token: str) -> None:
    """Make the complete staged DCP directory ``stage`` the checkpoint at ``path`` (lock held)."""
    if not os.path.lexists(path):
        os.rename(stage, path)
        fsync_dir(path.parent)
        return
    if exchange(stage, path):
        fsync_dir(path.parent)
        _remove_tree(stage)  # now the previous checkpoint
        return
    backup = path.parent / f"{dcp_names(path)['old']}{token}"
    os.rename(path, backup)
    os.rename(stage, path)
    fsync_dir(path.parent)
    _remove_tree(backup)

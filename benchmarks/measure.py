"""What each rank measures about itself: OS peak RSS, current RSS, bytes written to sockets/files.

All from the OS, so they count every allocation and every byte whatever library made it:
- peak RSS: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (Linux: KiB; the high-water mark of the
  process since it started, so a delta over an operation is "how far above everything before it");
- current RSS: ``/proc/self/statm``;
- bytes sent: ``wchar`` of ``/proc/self/io`` (every byte this process passed to write/writev,
  all threads). gloo's TCP transport sends with ``writev``, so over an operation that writes no
  file this is the number of bytes the rank sent over the process group (checked: a 100 MB
  broadcast from rank 0 of 2 adds 100.0 MB on rank 0 and ~0 on rank 1);
- bytes written to files: ``write_bytes`` of ``/proc/self/io`` (bytes this process dirtied in the
  page cache of a disk-backed file system: its file writes, not its sockets).
"""

from __future__ import annotations

import os
import re
import resource
import time
from dataclasses import dataclass

__all__ = ["Snapshot", "snapshot", "peak_rss_bytes", "current_rss_bytes", "bytes_written", "file_bytes_written",
           "status_bytes", "proc_status_bytes", "reset_peak"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """Resident set size of this process now (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def bytes_written() -> int:
    """Bytes this process has passed to write-family syscalls (sockets and files), or -1."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def file_bytes_written() -> int:
    """Bytes this process has written to disk-backed files (``write_bytes``), or -1."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


@dataclass
class Snapshot:
    """One reading of the clocks and counters above."""

    t: float
    peak_rss: int
    rss: int
    wchar: int
    write_bytes: int = -1


def snapshot() -> Snapshot:
    """Read everything now."""
    return Snapshot(time.perf_counter(), peak_rss_bytes(), current_rss_bytes(), bytes_written(),
                    file_bytes_written())


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes; -1 if absent."""
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else -1


def proc_status_bytes(pid: int, field: str) -> int:
    """A ``kB`` field of another process's ``/proc/<pid>/status`` (``RssAnon``, ...) in bytes; -1
    when the process is gone or has no such field. Read from outside, so sampling it costs the
    measured process nothing."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return -1
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else -1


def reset_peak() -> None:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0), so a later
    ``status_bytes("VmHWM")`` is the peak of what ran since."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

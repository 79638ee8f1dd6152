"""Many writers for one safetensors checkpoint: who writes, and which files each one writes.

``save_safetensors(..., writers=W)`` (see :func:`fsdptk.save_safetensors`):

- :func:`writer_ranks`: the ranks that write. ``W`` ranks spread evenly over the world
  (``[w * N // W]``: with ranks numbered host by host, as ``torchrun`` does, ``W`` = hosts gives one
  per host), or ``"host"``: the lowest rank of every host. Agreed with one object exchange, which
  also checks every rank passed the same value; :func:`spread_ranks` is the same answer from
  every rank's host where a caller's own exchange agreed them (a weight source's ``owners``).
- :func:`file_groups`: files that must have one writer. A model tensor is gathered whole by one
  writer, which writes every checkpoint tensor it splits into (the Hub layout of a fused MoE
  tensor) and every checkpoint tensor assembled from it and others (a ``Chunk``); so the files of
  all the pieces of one model tensor, and of every model tensor sharing a piece, form a group.
- :func:`assign_files`: groups to writers, largest first: among the writers that stay within
  ``1.25 x`` the even share, the one whose host holds the most of the group's bytes (``local``),
  then the least loaded; when none stays within it, the least loaded. No writer ends above
  ``max(1.25 x share, share + largest group)``. Deterministic: every rank computes the same.
- :class:`WriterAssignment`: the engine's ``collect`` destination callable: with the holdings the
  engine agreed (which rank holds which box, each rank's host), it assigns the files and returns
  each model tensor's writer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from fsdptk._core.arguments import ArgumentsView, check_arguments, describe
from fsdptk._core.dist import all_gather_object, error_payload, host_key, raise_lowest
from fsdptk._core.dist import world as _world
from fsdptk._engine.gather import Holdings
from fsdptk._engine.layouts import box_shape
from fsdptk._engine.wire import nbytes

__all__ = ["WriterAssignment", "assign_files", "file_groups", "shard_limit", "spread_ranks", "writer_ranks"]

SHARE_SLACK = 1.25  # a writer may take a group up to this multiple of the even share for locality


class _WritersView(NamedTuple):
    """What each rank sends when the writers are agreed."""

    writers: str  # the ``writers`` argument it was given (_core.arguments.describe)
    host: str  # its host (host name and network namespace)
    error: Any  # error_payload of its bad argument, or None


def _check(writers: object, world: int) -> None:
    if writers == "host":
        return
    if isinstance(writers, bool) or not isinstance(writers, int):
        raise TypeError(f"writers must be an int (1 to the world size, {world}) or 'host', got {writers!r}")
    if not 1 <= writers <= world:
        raise ValueError(f"writers must be between 1 and the world size ({world}), or 'host'; got {writers}")


def writer_ranks(writers: int | str) -> list[int]:
    """The ranks that write, agreed on every rank (collective when there are several ranks).

    Args:
        writers: how many (spread evenly over the ranks: ``[w * N // W for w in range(W)]``), or
            ``"host"``: the lowest rank of every host (host name and network namespace).

    Returns:
        list[int]: the writer ranks, ascending; rank 0 is always the first.

    Raises:
        TypeError: ``writers`` is neither an int nor ``"host"`` (names the value), on every rank.
        ValueError: ranks passed different values (names every rank's; checked before the
            values themselves), or ``writers`` is below 1 or above the world size, on every rank.

    Examples:
        >>> writer_ranks(1)
        [0]
    """
    world, _ = _world()
    error = None
    try:
        _check(writers, world)
    except (TypeError, ValueError) as e:
        error = e
    views = all_gather_object(_WritersView(writers=describe(writers), host=host_key(), error=error_payload(error)))
    check_arguments([ArgumentsView(call="writer_ranks", values=(("writers", v.writers),)) for v in views])
    raise_lowest([v.error for v in views], error)
    return spread_ranks(writers, [v.host for v in views])


def spread_ranks(writers: int | str, hosts: Sequence[str]) -> list[int]:
    """The writer ranks of a checked ``writers`` argument, given every rank's host (``hosts[r]``):
    no communication (what :func:`writer_ranks` returns once it has agreed them).

    Args:
        writers: how many (spread evenly over the ranks: ``[w * N // W for w in range(W)]``), or
            ``"host"``: the lowest rank of every host.
        hosts: per rank, its host (host name and network namespace).

    Returns:
        list[int]: the writer ranks, ascending; rank 0 is always the first.

    Examples:
        >>> spread_ranks(2, ["a"] * 4), spread_ranks("host", ["a", "a", "b", "b"])
        ([0, 2], [0, 2])
    """
    if writers == "host":
        first: dict[str, int] = {}
        for r, host in enumerate(hosts):
            first.setdefault(host, r)
        return sorted(first.values())
    assert isinstance(writers, int)
    return [w * len(hosts) // writers for w in range(writers)]


FILES_PER_WRITER = 4  # a save with W writers has about this many files per writer at least


def shard_limit(max_shard_size: int, total: int, writers: int) -> int:
    """The file size limit of a save with ``writers`` writers: ``max_shard_size``, lowered so that
    the checkpoint has about ``4 x writers`` files when it would have fewer (with
    ``max_shard_size`` alone a 16 GB model in 5 GB files has 4 files, which 8 writers could not
    share; several files per writer also let the assignment even out a large tensor, which always
    has a file of its own).

    Examples:
        >>> shard_limit(5 * 10**9, 16 * 10**9, 1), shard_limit(5 * 10**9, 16 * 10**9, 8)
        (5000000000, 500000000)
    """
    if writers <= 1 or total <= 0:
        return max_shard_size
    return min(max_shard_size, max(1, math.ceil(total / (FILES_PER_WRITER * writers))))


def file_groups(item_files: Sequence[Sequence[int]], n_files: int) -> list[list[int]]:
    """Files joined by the model tensors written to them (union-find): each group must have one
    writer. Groups in the order of their first file; files ascending in each.

    Examples:
        >>> file_groups([[0], [1, 2], [2], [3]], 5)
        [[0], [1, 2], [3], [4]]
    """
    parent = list(range(n_files))

    def root(f: int) -> int:
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    for files in item_files:
        files = list(files)
        for f in files[1:]:
            a, b = root(files[0]), root(f)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for f in range(n_files):
        groups.setdefault(root(f), []).append(f)
    return [groups[r] for r in sorted(groups)]


def assign_files(sizes: Sequence[int], groups: Sequence[Sequence[int]], writers: int,
                 local: Callable[[int, int], int] | None = None) -> list[int]:
    """The writer (0 to ``writers - 1``) of every file; the files of a group share one.

    Groups go largest first to a writer that stays within ``1.25 x`` the even share: the one whose
    host holds the most of the group's bytes (``local(group, writer)``), then the least loaded,
    then the lowest; when no writer stays within it, to the least loaded. No writer ends above
    ``max(1.25 x total / writers, total / writers + largest group)``.

    Args:
        sizes: bytes of every file.
        groups: :func:`file_groups`.
        writers: how many writers.
        local: bytes of a group its writer's host holds (``None``: all equal).

    Returns:
        list[int]: per file, its writer.

    Examples:
        >>> assign_files([4, 4, 4, 4], [[0], [1], [2], [3]], 2)
        [0, 1, 0, 1]
    """
    size = [sum(sizes[f] for f in g) for g in groups]
    share = sum(size) / writers
    load = [0] * writers
    out = [0] * len(sizes)
    for g in sorted(range(len(groups)), key=lambda g: (-size[g], g)):
        fits = [w for w in range(writers) if load[w] + size[g] <= SHARE_SLACK * share]
        if fits:
            w = min(fits, key=lambda w: (-(local(g, w) if local else 0), load[w], w))
        else:
            w = min(range(writers), key=lambda w: (load[w], w))
        load[w] += size[g]
        for f in groups[g]:
            out[f] = w
    return out


class WriterAssignment:
    """The destination of every gathered model tensor in a save with several writers: the
    engine's ``collect`` calls it with the agreed holdings (every rank, the same holdings).

    Args:
        ranks: the writer ranks (:func:`writer_ranks`).
        item_files: per gathered item, the files of its checkpoint tensors.
        file_sizes: bytes of every file.
        items: the gathered ``(fqn, tensor)`` items (for their dtypes: bytes of a held box).

    Attributes:
        files: per file, its writer rank (set by the call).
    """

    def __init__(self, ranks: Sequence[int], item_files: Sequence[Sequence[int]], file_sizes: Sequence[int],
                 items: Sequence[tuple[str, Any]]) -> None:
        self.ranks = list(ranks)
        self.item_files = [list(f) for f in item_files]
        self.file_sizes = list(file_sizes)
        self.dtypes = [t.dtype for _, t in items]
        self.groups = file_groups(self.item_files, len(self.file_sizes))
        self.files: list[int] | None = None

    def own(self, rank: int) -> list[int]:
        """The files ``rank`` writes (after the call)."""
        assert self.files is not None, "the engine assigns the files before the first bucket"
        return [f for f, r in enumerate(self.files) if r == rank]

    def _local(self, holdings: Holdings) -> Callable[[int, int], int]:
        """Bytes of each group held on each writer's host (each distinct box counted once)."""
        group_of = {f: g for g, files in enumerate(self.groups) for f in files}
        on_host: list[dict[str, int]] = [{} for _ in self.groups]
        for i, files in enumerate(self.item_files):
            held: dict[Any, tuple[int, set[str]]] = {}
            for r, boxes in enumerate(holdings.boxes):
                b = boxes[i]
                if b is not None:
                    key = repr(b)
                    n, hosts = held.get(key, (nbytes(box_shape(b), self.dtypes[i]), set()))
                    hosts.add(holdings.hosts[r])
                    held[key] = (n, hosts)
            tally = on_host[group_of[files[0]]]
            for n, hosts in held.values():
                for h in hosts:
                    tally[h] = tally.get(h, 0) + n
        writer_host = [holdings.hosts[r] for r in self.ranks]
        return lambda g, w: on_host[g].get(writer_host[w], 0)

    def __call__(self, holdings: Holdings) -> list[int]:
        local = self._local(holdings) if len(set(holdings.hosts)) > 1 else None
        writer = assign_files(self.file_sizes, self.groups, len(self.ranks), local)
        self.files = [self.ranks[w] for w in writer]
        return [self.files[files[0]] for files in self.item_files]

"""Lost peers: waiting for transfers without hanging on a dead rank, and naming the ranks lost.

Why a waiting thread (gloo's TCP transport, read in its ``pair.cc``): when a peer dies, gloo closes
the connection and fails every operation still queued for it, EXCEPT a point-to-point message whose
bytes are already being written or read (an unbound buffer's operation in the connection's send or
receive slot, which the close does not signal). ``Work.wait()`` on such a message returns only at
the process group's timeout (30 minutes by default); ``Work.wait(timeout)`` that expires closes
every connection of the group, and there is no abort from Python. A rank-0 load hits it whenever a
receiver's host dies while rank 0 still writes to it (its socket buffer full: the link is slower
than rank 0), and a gather when a sender dies mid-message.

So a :class:`Waiter` waits in a helper thread (one per engine call), and the calling thread
watches the process group's store meanwhile: once any rank reports a communication failure there,
the caller stops waiting and raises (the helper thread is left to gloo's own timeout; it holds the transfers' tensors until
then). A rank reports in :func:`roll_call`, which every fsdptk communication error runs: it
appends ``<rank>@<time>;`` to one key of the group and waits up to :data:`ROLL_CALL_S` for every
rank of the group to append too; the ranks that do not are the ones lost. Only the failure path
writes to the store; a wait that ends within :data:`POLL_S` never reads it, a longer one checks
the key at doubling intervals up to once a second (at most ``N`` small reads a second for ``N``
waiting ranks), and a roll call reads the key 4 times.

Freshness (no call id needed, so a failure between calls is covered too): an answer counts when its
time is within :data:`FRESH_S` of the reader's own; answers left by an earlier failure of the same
group (a job that went on after one) are older, and a rank that took a roll call ignores every
answer older than its end (:func:`_since`), so its next waits do not take that failure for a new one. Clocks of different hosts must agree within a few
seconds (NTP does).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from fsdptk._core.compat import default_store

POLL_S = 0.2  # a waiting rank first looks for a failure report after this long, then at doubling
POLL_MAX_S = 1.0  # intervals up to this (a long wait reads the store once a second)
ROLL_CALL_S = 2.0  # how long a failing rank waits for the others to answer
ROLL_CALL_READS = (0.1, 0.5, 1.0)  # when it reads the answers early (every rank answered: done)
FRESH_S = 10.0  # answers this much older than the reader's own belong to an earlier failure
# per group key: when this rank's last roll call ended; every answer of that failure is older, so a
# later wait or roll call of the same process (a job that went on after the error) ignores them
_ROLL_CALL_ENDED: dict[str, float] = {}
_NAMED = 8  # lost ranks named one by one; more are counted


def _key(group: Any) -> str:
    pg = group if group is not None else dist.group.WORLD
    return f"fsdptk/roll-call/{getattr(pg, 'group_name', 'default')}"


def _answers(raw: bytes | str, since: float) -> dict[int, float]:
    """``{rank: time}`` of the answers at or after ``since`` (the newest answer of each rank)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    out: dict[int, float] = {}
    for item in text.split(";"):
        rank, _, stamp = item.partition("@")
        if rank.strip().isdigit() and stamp:
            t = float(stamp)
            if t >= since:
                out[int(rank)] = max(t, out.get(int(rank), t))
    return out


def watched(group: Any) -> bool:
    """Whether transfers on ``group`` are waited for by a :class:`Waiter`'s thread: gloo only (an
    NCCL ``wait`` blocks a stream, not this thread; its lost peers are the watchdog's)."""
    return "gloo" in str(dist.get_backend(group)).lower() and default_store() is not None


class _Job:
    """Works for the waiting thread, and what became of them."""

    def __init__(self, works: Sequence[dist.Work]) -> None:
        self.works = works
        self.error: BaseException | None = None
        self.done = threading.Event()


def _serve(jobs: queue.SimpleQueue) -> None:
    """The waiting thread: wait for each job's works in order until ``None`` arrives."""
    while (job := jobs.get()) is not None:
        try:
            for w in job.works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            job.error = e
        finally:
            job.done.set()


class Waiter:
    """Waits for one engine call's transfers and collectives so that a lost peer cannot hang it.

    With gloo, one helper thread (started at the first wait, ended by :meth:`close`) waits for the
    works while the calling thread watches the store (module docstring); otherwise (NCCL, no
    process group) :meth:`wait` waits inline. A handover costs about 20 us; the store is read only
    once a wait has lasted :data:`POLL_S`.

    Args:
        group: the process group of the works (``None``: the default group).
        size: its world size.
        rank: this rank, for the message.
    """

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.rank = group, rank
        self.threaded = size > 1 and watched(group)
        self._jobs: queue.SimpleQueue | None = None

    def wait(self, works: Sequence[dist.Work], *, look_first: bool = False) -> None:
        """Wait for every work, in order; raise as soon as any rank reports a failure in the store.

        Args:
            works: posted transfers, or collectives posted with ``async_op=True``.
            look_first: read the store before the first :data:`POLL_S` (a wait on an error path,
                where a failure is likely known already).

        Raises:
            RuntimeError: a work's own error, or a report of another rank's failure (naming that
                rank); the works are then left to the helper thread (and gloo's own timeout).
        """
        if not works:
            return
        if not self.threaded:
            for w in works:
                w.wait()
            return
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="fsdptk-wait", daemon=True).start()
        job = _Job(works)
        started = time.time()
        self._jobs.put(job)
        timeout = 0.0 if look_first else POLL_S
        while not job.done.wait(timeout):
            timeout = min(max(2 * timeout, POLL_S), POLL_MAX_S)
            reporters = _reported(self.group, _since(self.group, started))
            if reporters:
                self.close()  # the thread ends once gloo gives up on this job; a later wait starts another
                who = "the store's host is unreachable" if reporters == [-1] else f"rank {reporters[0]} reported a communication failure"
                raise RuntimeError(f"{who} while rank {self.rank} waited for its transfers (those are "
                                   "left to the process group's timeout)")
        if job.error is not None:
            raise job.error

    def close(self) -> None:
        """End the helper thread once it has waited for what it holds (idempotent)."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None


def _reported(group: Any, since: float) -> list[int]:
    """The ranks that reported a failure at or after ``since`` (the store unreachable: ``[-1]``)."""
    store, key = default_store(), _key(group)
    try:
        if store is None or not store.check([key]):
            return []
        return sorted(_answers(store.get(key), since))
    except Exception:  # noqa: BLE001 - the store's host is gone: that is a failure too
        return [-1]


def _since(group: Any, now: float) -> float:
    """The time from which answers in ``group``'s key count: at most :data:`FRESH_S` before
    ``now``, and never before this rank's own last roll call in that group ended."""
    return max(now - FRESH_S, _ROLL_CALL_ENDED.get(_key(group), 0.0))


def roll_call(group: Any, size: int, rank: int) -> str:
    """Report this rank's communication failure and name the ranks that do not answer.

    Collective in spirit only: every rank that meets the failure runs it, none waits for a peer's
    message; it returns after :data:`ROLL_CALL_S` at most (at once when every rank answered).

    Returns:
        A sentence for the error message: the lost ranks (``"Lost: rank 2 and rank 3 did not
        answer ..."``), that every rank answered, or why no roll call could be taken.
    """
    try:
        return _take_roll_call(group, size, rank)
    finally:
        _ROLL_CALL_ENDED[_key(group)] = time.time()


def _take_roll_call(group: Any, size: int, rank: int) -> str:
    store, key = default_store(), _key(group)
    if store is None:
        return ""
    mine = time.time()
    try:
        store.append(key, f"{rank}@{mine:.3f};")
        begun = time.monotonic()
        for at in (*ROLL_CALL_READS, ROLL_CALL_S):  # a few reads: a store serves every survivor
            time.sleep(max(0.0, begun + at - time.monotonic()))
            missing = sorted(set(range(size)) - set(_answers(store.get(key), _since(group, mine))))
            if not missing:
                break
    except Exception as e:  # noqa: BLE001 - the message says why
        return (f"No roll call could be taken through the process group's store ({type(e).__name__}: "
                f"{str(e).strip()[:200]}): the host that holds it (under torchrun, the first host) "
                "is most likely lost too.")
    if not missing:
        return ("Every rank answered a roll call through the process group's store: none was lost; "
                "the connections between them failed.")
    named = [f"rank {r}" for r in missing[:_NAMED]]
    more = len(missing) - len(named)
    listed = (", ".join(named[:-1]) + " and " + named[-1]) if len(named) > 1 else named[0]
    if more:
        listed = f"{', '.join(named)} and {more} more ranks, the last rank {missing[-1]}"
    return (f"Lost: {listed} did not answer a roll call through the process group's store within "
            f"{ROLL_CALL_S:g} s (killed, out of memory, their host down, or no longer in this operation); "
            "their logs have the cause.")

"""Rank agreement: the one place fsdptk asks which rank it is, logs on rank 0, exchanges objects
and agrees on errors across ranks (internal; the public facts live in :mod:`fsdptk.runtime`).

Every helper runs on the process group of :func:`comm_group` (the default group unless a caller
chose another one for this thread with :func:`using_group`) and degrades to a single process
without one.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist

from fsdptk._core.peers import Waiter, roll_call

# The group fsdptk's collectives use in this thread (a context variable: per thread, no global
# state shared between threads); None is the default group.
_GROUP: ContextVar[Any] = ContextVar("fsdptk_comm_group", default=None)


def comm_group() -> Any:
    """The process group fsdptk's collectives run on in this thread; ``None``: the default group."""
    return _GROUP.get()


@contextmanager
def using_group(group: Any) -> Iterator[None]:
    """Run fsdptk's collectives in this thread on ``group`` (it must span every rank, in order, so
    that its ranks are the global ranks); the previous choice is restored on exit."""
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(f"fsdptk's process group must span every rank: it has "
                         f"{dist.get_world_size(group)} of {dist.get_world_size()}")
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def has_process_group() -> bool:
    """Whether the default process group is initialised (False where torch.distributed is absent)."""
    return dist.is_available() and dist.is_initialized()


def world() -> tuple[int, int]:
    """``(world_size, rank)`` of :func:`comm_group`, ``(1, 0)`` without a process group."""
    if has_process_group():
        return dist.get_world_size(comm_group()), dist.get_rank(comm_group())
    return 1, 0


def is_rank0() -> bool:
    """Whether this process is global rank 0 (True without a process group)."""
    return world()[1] == 0


def log_rank0(logger: logging.Logger, msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log ``msg % args`` through ``logger`` on rank 0 only (every process without a group)."""
    if is_rank0():
        logger.log(level, msg, *args)




def host_key() -> str:
    """What tells this process's host apart from the others': the host name and the network
    namespace (``/proc/self/ns/net``), so that ranks in separate namespaces of one machine (the
    simulated hosts of :mod:`fsdptk.testing.hosts`, containers) count as separate hosts, as their
    links do. Internal helper; not exported from ``fsdptk``."""
    try:
        ns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        ns = 0
    return f"{socket.gethostname()}/{ns}"


def comm_device() -> torch.device:
    """The device small agreement tensors live on: CPU when the default group has gloo."""
    backend = str(dist.get_backend(comm_group())).lower()
    if "gloo" in backend:
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type if acc is not None else "cuda", torch.accelerator.current_device_index())


def check_rank_zero(fn: str, is_rank_zero: bool) -> bool:
    """Whether the caller's ``is_rank_zero`` holds here; warns (once per call site) when it
    disagrees with the real global rank. Internal helper; not exported from ``fsdptk``."""
    rank = world()[1]
    if bool(is_rank_zero) != (rank == 0):
        warnings.warn(f"{fn}(is_rank_zero={is_rank_zero!r}) called on global rank {rank}: the gathered "
                      "state is returned only where is_rank_zero is True AND the rank is 0 (only rank 0 "
                      "receives it); pass is_rank_zero=(rank == 0)", UserWarning, stacklevel=3)
    return bool(is_rank_zero) and rank == 0


def check_comm_device(fn: str, device: torch.device | str | None) -> None:
    """torchtune's ``device`` argument of a gather: the device its communication runs on.

    fsdptk communicates on the device the default process group's backend uses (CPU for gloo, the
    current accelerator otherwise); a ``device`` of another type cannot be honoured, so it warns
    (once per call site). ``None``, or no process group (nothing is communicated): nothing to check.
    Internal helper; not exported from ``fsdptk``.
    """
    if device is None or world()[0] == 1:
        return
    wanted, used = torch.device(device), comm_device()
    if wanted.type != used.type:
        warnings.warn(f"{fn}(device={str(wanted)!r}) is not used: the process group's backend "
                      f"({dist.get_backend(comm_group())}) communicates on {used.type}; the results are CPU tensors "
                      "either way (pass device=None)", UserWarning, stacklevel=3)


@contextmanager
def comm_errors(what: str) -> Iterator[None]:
    """Turn a failure of ``torch.distributed`` itself into an error that says what it means.

    A collective or point-to-point call fails when a peer is gone (killed, out of memory, its
    connection closed); the backend's own message (gloo: ``Connection closed by peer
    [10.0.0.2]:2243``) names no operation and no rank. This rank first reports the failure through
    the process group's store and takes a roll call there (:func:`fsdptk._core.peers.roll_call`, at
    most 2 s), so the message names the ranks that did not answer, and a rank still waiting for a
    transfer to a lost peer stops waiting. Internal helper; not exported from ``fsdptk``.

    Args:
        what: the operation, for the message (e.g. ``"load_from_full_model_state_dict"``).

    Raises:
        RuntimeError: naming ``what``, this rank, the backend's message (chained) and the lost ranks.
    """
    try:
        yield
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        if getattr(e, "fsdptk_comm_failure", False):  # an inner comm_errors already said it all
            raise
        size, rank = world()
        lost = roll_call(comm_group(), size, rank) if size > 1 else ""
        err = RuntimeError(
            f"fsdptk {what}: communication with the other ranks failed on rank {rank} "
            f"({type(e).__name__}: {str(e).strip()[:400]}). "
            + (lost or "Another rank most likely died (killed, out of memory) or stopped taking part "
               "in this operation; its log has the cause."))
        err.fsdptk_comm_failure = True  # type: ignore[attr-defined]
        raise err from e


def waiter() -> Waiter:
    """A :class:`~fsdptk._core.peers.Waiter` for one engine call on :func:`comm_group`: with gloo it
    waits for transfers in a helper thread and stops, within a fraction of a second, once another
    rank reported a communication failure, instead of waiting for a transfer to a lost peer until
    the process group's timeout. Run its waits inside :func:`comm_errors`. Internal helper."""
    size, rank = world()
    return Waiter(comm_group(), size, rank)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a list indexed by rank); ``[obj]`` without a process group.

    The one object collective fsdptk's higher modules use to agree on metadata and errors before
    any tensor moves (internal helper; not exported from ``fsdptk``). Collective: every rank of the
    default process group must call it.

    Args:
        obj: any picklable object.

    Returns:
        list: ``obj`` of every rank, indexed by rank.

    Raises:
        RuntimeError: when the communication itself fails (a peer died), see :func:`comm_errors`.
    """
    size, _ = world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    with comm_errors("agreement"):
        dist.all_gather_object(out, obj, group=comm_group())
    return out


def _exc_class(module: str, qualname: str) -> type[BaseException] | None:
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, Exception) else None


def error_payload(error: BaseException | None) -> tuple[str, str, str] | None:
    """What crosses the wire for an error: ``(module, qualname, message)``; ``None`` when fine.

    The message includes the exception's notes (``add_note``), where fsdptk records context such
    as the key being read. Internal helper; not exported from ``fsdptk``.
    """
    if error is None:
        return None
    notes = [str(n) for n in getattr(error, "__notes__", ())]
    message = "; ".join([str(error), *notes]) if notes else str(error)
    return type(error).__module__, type(error).__qualname__, message


def raise_lowest(payloads: Sequence[tuple[str, str, str] | None], error: BaseException | None) -> None:
    """Raise the lowest failing rank's error from every rank's :func:`error_payload` (no collective).

    That rank re-raises its own exception (with its traceback, and a note naming the rank); every
    other rank an exception of the same type (when it is importable there) whose message ends with
    ``(on rank N)``, else a ``RuntimeError`` naming the type. Returns when no rank failed.
    Internal helper; not exported from ``fsdptk``.

    Args:
        payloads: one :func:`error_payload` per rank, indexed by rank.
        error: this rank's exception, or ``None``.
    """
    _, me = world()
    for rank, item in enumerate(payloads):
        if item is None:
            continue
        if rank == me and error is not None:
            note = f"(raised on rank {rank}; every rank of the operation raises it)"
            if len(payloads) > 1 and note not in getattr(error, "__notes__", ()):
                error.add_note(note)
            raise error
        module, qualname, message = item
        cls = _exc_class(module, qualname)
        try:
            exc = cls(f"{message} (on rank {rank})") if cls is not None else None
        except Exception:  # noqa: BLE001 - an exception type with an unusual constructor
            exc = None
        raise exc or RuntimeError(f"{qualname} on rank {rank}: {message}")


def raise_if_any(error: BaseException | None) -> None:
    """Raise on every rank when any rank has an error; collective (every rank must call it).

    Every rank raises the lowest failing rank's error: that rank re-raises its own exception
    (with its traceback), every other rank (failing or not) an exception of the same type (when it
    is importable there) whose message names that rank. Cheap when nothing failed: one one-element
    ``all_reduce``; only when some rank failed are the messages exchanged (one object all-gather).
    Only strings cross the wire, so an unpicklable exception cannot break the agreement. Internal
    helper; not exported from ``fsdptk``.

    Args:
        error: this rank's exception, or ``None`` when this rank is fine.

    Raises:
        BaseException: the lowest failing rank's error (itself on that rank; elsewhere the same
            type, or ``RuntimeError`` naming the type when it cannot be rebuilt).
    """
    size, rank = world()
    if size == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else size - rank], dtype=torch.int64, device=comm_device())
    with comm_errors("agreement"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=comm_group())
    if int(flag.item()):
        raise_lowest(all_gather_object(error_payload(error)), error)


@contextmanager
def agreed() -> Iterator[None]:
    """Run a block on every rank; an exception in it on any rank is raised on every rank.

    ``with agreed(): ...`` is :func:`raise_if_any` around a block of local work (validation,
    metadata) that must not leave the other ranks waiting in the next collective. Collective:
    every rank must enter it. Internal helper; not exported from ``fsdptk``.

    Raises:
        Exception: the lowest failing rank's error, on every rank (see :func:`raise_if_any`).
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - agreed just below
        error = e
    raise_if_any(error)


def check_type(value: Any, expected: type | tuple[type, ...], name: str, what: str) -> None:
    """Raise a TypeError naming the argument, what it must be and the type it has.

    Internal helper; not exported from ``fsdptk``. In a collective call run it inside
    :func:`agreed`, so that every rank raises it.

    Args:
        value: the argument.
        expected: the accepted type(s).
        name: the argument's name (``"full_sd"``).
        what: what it must be, for the message (``"a Mapping of fqn -> tensor"``).

    Raises:
        TypeError: ``"<name> must be <what>, got <type>"``.
    """
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")


def run_agreed(fn: Callable[[], Any], *, on: bool = True) -> Any:
    """Run ``fn`` (when ``on``) and agree on its outcome: its result, or the same error everywhere."""
    result, error = None, None
    if on:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank just below
            error = e
    raise_if_any(error)
    return result


def raise_problems(problems: list[tuple[str, str]], what: str) -> None:
    """Raise every ``(kind, message)`` problem found (agreed already) as one error; none: return.

    Args:
        problems: ``("TypeError" | "ValueError", message)`` pairs.
        what: what failed, the message's start (``"cannot load the state"``).

    Raises:
        TypeError: when every problem is a TypeError; else ValueError. The message lists the first
            20 problems and counts the rest.
    """
    if not problems:
        return
    lines = [m for _, m in problems]
    shown = "\n  - ".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
    cls = TypeError if all(k == "TypeError" for k, _ in problems) else ValueError
    raise cls(f"{what}: {len(lines)} problem(s):\n  - {shown}")

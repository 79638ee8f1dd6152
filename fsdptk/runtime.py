"""Process-group facts: is this run distributed, which rank am I, which backend, thread count.

These are the small questions every training loop asks before it builds a model. They never
initialise anything on their own and are safe to call in a single process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "is_distributed",
    "get_world_size_and_rank",
    "get_distributed_backend",
    "set_torch_num_threads",
    "validate_no_params_on_meta_device",
]

_BACKENDS = {
    "cuda": "nccl", "cpu": "gloo", "xpu": "xccl", "mps": "gloo", "hpu": "hccl", "npu": "hccl",
}


def is_distributed() -> bool:
    """Tell whether this process is part of a multi-process launch.

    True when the default process group is initialised, or when the environment of a launcher such
    as ``torchrun`` describes more than one process (``WORLD_SIZE`` > 1 with ``MASTER_ADDR`` and
    ``MASTER_PORT`` set), so it can be asked before ``init_process_group``.

    Returns:
        bool: whether the job runs with several processes.

    Example:
        >>> from fsdptk import is_distributed
        >>> is_distributed()  # a plain ``python`` process
        False
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    port = os.environ.get("MASTER_PORT", "")
    addr = os.environ.get("MASTER_ADDR", "")
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError as e:
        raise ValueError(
            f"WORLD_SIZE ({os.environ.get('WORLD_SIZE')!r}) and RANK ({os.environ.get('RANK')!r}) "
            "must be integers"
        ) from e
    return bool(port and addr and size > 1 and rank >= 0)


def get_world_size_and_rank() -> tuple[int, int]:
    """Return ``(world_size, rank)`` of the default process group, or ``(1, 0)`` without one.

    Returns:
        tuple[int, int]: the world size and this process's global rank.

    Example:
        >>> from fsdptk import get_world_size_and_rank
        >>> world_size, rank = get_world_size_and_rank()
        >>> (world_size, rank)  # single process
        (1, 0)
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def get_distributed_backend(device_type: str, offload_ops_to_cpu: bool = False) -> str:
    """Return the ``torch.distributed`` backend string for a device type.

    Args:
        device_type: ``"cuda"``, ``"cpu"``, ``"xpu"``, ... (a ``torch.device`` type; an index such
            as ``"cuda:1"`` is accepted and ignored).
        offload_ops_to_cpu: also register gloo for CPU tensors on an accelerator
            (``"cuda:nccl,cpu:gloo"``), needed when optimizer state or checkpoints live on CPU.

    Returns:
        str: a backend string for ``init_process_group(backend=...)``.

    Raises:
        ValueError: when the device type is not known.

    Example:
        >>> from fsdptk import get_distributed_backend
        >>> get_distributed_backend("cuda")
        'nccl'
        >>> get_distributed_backend("cuda", offload_ops_to_cpu=True)
        'cuda:nccl,cpu:gloo'
        >>> get_distributed_backend("cpu")
        'gloo'
    """
    dev = torch.device(device_type).type
    backend = _BACKENDS.get(dev)
    if backend is None:
        raise ValueError(
            f"Unknown device type {device_type!r}: expected one of {sorted(_BACKENDS)}"
        )
    if offload_ops_to_cpu and dev != "cpu":
        return f"{dev}:{backend},cpu:gloo"
    return backend


def set_torch_num_threads() -> int:
    """Give each local process an equal share of the CPU cores for torch's intra-op threads.

    With several processes per machine, each one defaulting to every core oversubscribes the CPU.
    This divides the cores by ``LOCAL_WORLD_SIZE`` (set by ``torchrun``; 1 otherwise).

    Returns:
        int: the number of threads set (at least 1).

    Example:
        >>> from fsdptk import set_torch_num_threads
        >>> n = set_torch_num_threads()
        >>> n >= 1
        True
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    threads = max(1, (cores or 1) // local)
    torch.set_num_threads(threads)
    return threads


def validate_no_params_on_meta_device(model: nn.Module) -> None:
    """Raise when any parameter or buffer of ``model`` is still on the ``meta`` device.

    Call it after loading weights into a model built on meta: a tensor left on meta means a key was
    missing from the checkpoint or a buffer was never initialised.

    Args:
        model: the module to check (sharded or not; DTensor parameters are checked by their local
            tensor).

    Raises:
        RuntimeError: ``"Unexpected param or buffer <fqn> on meta device. ..."`` (torchtune's
            wording, so its tests' ``match="Unexpected param or buffer"`` holds) for the first
            parameter, then buffer, on meta; the rest names its kind, shape and dtype.

    Example:
        >>> import torch
        >>> from fsdptk import validate_no_params_on_meta_device
        >>> validate_no_params_on_meta_device(torch.nn.Linear(2, 2))  # fine on CPU
        >>> with torch.device("meta"):
        ...     m = torch.nn.Linear(2, 2)
        >>> validate_no_params_on_meta_device(m)
        Traceback (most recent call last):
        ...
        RuntimeError: Unexpected param or buffer weight on meta device. It is a parameter of shape (2, 2), dtype torch.float32: load or initialise it before training.
    """
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for fqn, tensor in named:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local.is_meta:
                raise RuntimeError(
                    f"Unexpected param or buffer {fqn} on meta device. It is a {kind} of shape "
                    f"{tuple(tensor.shape)}, dtype {tensor.dtype}: load or initialise it before "
                    "training."
                )


# ----------------------------------------------------------------------------------------------
# agreement across ranks (internal helpers used by state_dict, optim and checkpoint modules)


def _comm_device() -> torch.device:
    """The device small agreement tensors live on: CPU when the default group has gloo."""
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend:
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc or "cuda", torch.accelerator.current_device_index())


@contextmanager
def comm_errors(what: str) -> Iterator[None]:
    """Turn a failure of ``torch.distributed`` itself into an error that says what it means.

    A collective or point-to-point call fails when a peer is gone (killed, out of memory, its
    connection closed); the backend's own message (gloo: ``Connection closed by peer``) names no
    operation. Internal helper; not exported from ``fsdptk``.

    Args:
        what: the operation, for the message (e.g. ``"load_from_full_model_state_dict"``).

    Raises:
        RuntimeError: naming ``what``, this rank and the backend's message (chained).
    """
    try:
        yield
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        _, rank = get_world_size_and_rank()
        raise RuntimeError(
            f"fsdptk {what}: communication with the other ranks failed on rank {rank} "
            f"({type(e).__name__}: {str(e).strip()[:400]}). Another rank most likely died (killed, "
            "out of memory) or stopped taking part in this operation; its log has the cause."
        ) from e


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
    size, _ = get_world_size_and_rank()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    with comm_errors("agreement"):
        dist.all_gather_object(out, obj)
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
    _, me = get_world_size_and_rank()
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
    size, rank = get_world_size_and_rank()
    if size == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else size - rank], dtype=torch.int64, device=_comm_device())
    with comm_errors("agreement"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
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

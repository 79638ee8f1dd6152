"""Process-group facts: is this run distributed, which rank am I, which backend, thread count.

These are the small questions every training loop asks before it builds a model. They never
initialise anything on their own and are safe to call in a single process.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fsdptk._core import dist as _dist

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

    Raises:
        ValueError: ``WORLD_SIZE`` or ``RANK`` is set but not an integer (names both values).

    Examples:
        >>> from fsdptk import is_distributed
        >>> is_distributed()  # a plain ``python`` process
        False
    """
    if _dist.has_process_group():
        return _dist.world()[0] > 1
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

    Examples:
        >>> from fsdptk import get_world_size_and_rank
        >>> world_size, rank = get_world_size_and_rank()
        >>> (world_size, rank)  # single process
        (1, 0)
    """
    return _dist.world()


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

    Examples:
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

    Examples:
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

    Examples:
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

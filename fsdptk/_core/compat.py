"""Every private torch API fsdptk relies on, in one place, so a torch upgrade touches one file.

Only cheap imports happen at module import (DTensor's placement math, already loaded with
``torch.distributed.tensor``); the composable-API and cache helpers are imported when called.
torchao is imported only by :mod:`fsdptk._core.nf4` (public as :mod:`fsdptk.nf4`), lazily.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.modules.module import _IncompatibleKeys

__all__ = [
    "IncompatibleKeys",
    "StridedShard",
    "get_shard_size_and_offsets",
    "local_tensor",
    "dtensor_like",
    "composable_checkpoint",
    "composable_registry",
    "checkpoint_wrapper_api",
    "clear_dtensor_caches",
    "dcp_set_element",
    "default_store",
]

# what nn.Module.load_state_dict returns: (missing_keys, unexpected_keys); the loads return it too
IncompatibleKeys = _IncompatibleKeys
# FSDP2-over-TP placement (a Shard whose pieces interleave); see DTensor's placement_types
StridedShard = _StridedShard
# DTensor's own placement math: (local size, global indices) of one mesh coordinate's shard
get_shard_size_and_offsets = _get_shard_size_and_offsets


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor, without ``to_local``'s autograd wrapping; ``t`` otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


def dtensor_like(target: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``target``'s mesh, placements and shape around ``local`` (its dtype).

    Not ``DTensor.from_local``: it moves a CPU local to the mesh's device type, so a CPU-offload
    load (local on CPU, mesh on cuda) would land on the GPU, and FSDP2 then copies it back into
    pinned memory, leaving a DTensor whose ``.device`` (cuda) disagrees with its local tensor
    (cpu). Built directly (as FSDP2 and torchtune's ``.cpu()`` do), the DTensor is where its local
    tensor is.
    """
    spec = target._spec
    if spec.tensor_meta is not None and spec.tensor_meta.dtype != local.dtype:  # (specs are immutable: shared)
        spec = replace(spec, tensor_meta=spec.tensor_meta._replace(dtype=local.dtype))
    return DTensor(local, spec, requires_grad=local.requires_grad)


def composable_checkpoint() -> Any:
    """``torch.distributed._composable.checkpoint`` (activation checkpointing by hooks)."""
    from torch.distributed._composable import checkpoint

    return checkpoint


def composable_registry(module: torch.nn.Module) -> dict[str, Any]:
    """The composable APIs applied to ``module`` (``{}`` when none)."""
    from torch.distributed._composable.contract import _get_registry

    return _get_registry(module) or {}


def checkpoint_wrapper_api() -> tuple[type, Any]:
    """``(CheckpointWrapper, checkpoint_wrapper)`` of torch's activation-checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    return CheckpointWrapper, checkpoint_wrapper


def dcp_set_element() -> Any:
    """DCP's ``set_element(root, path, value)``: put a value at a flattened state-dict path."""
    from torch.distributed.checkpoint._traverse import set_element

    return set_element


def clear_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches (a no-op on older torch)."""
    try:
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        getattr(_redistribute._gen_transform_infos, "cache_clear", lambda: None)()
    except (ImportError, AttributeError):  # older torch: no such caches to clear
        pass


def default_store() -> Any:
    """The key-value store of the default process group (its rendezvous store, under torchrun the
    agent's on the first host), or ``None`` when there is no process group."""
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except (RuntimeError, ValueError):  # no default process group
        return None

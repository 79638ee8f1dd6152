"""Every private torch API fsdptk relies on, in one place, so a torch upgrade touches one file.

Only cheap imports happen at module import (DTensor's placement math, already loaded with
``torch.distributed.tensor``); the composable-API and cache helpers are imported when called.
torchao is imported only by :mod:`fsdptk._core.nf4` (public as :mod:`fsdptk.nf4`), lazily.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.modules.module import _IncompatibleKeys
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

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
    "p2p_batch",
    "shared_mesh_concatenation",
    "muon_zeropower",
    "muon_adjust_lr",
    "optim_to_scalar",
]

# what nn.Module.load_state_dict returns: (missing_keys, unexpected_keys); the loads return it too
IncompatibleKeys = _IncompatibleKeys
# FSDP2-over-TP placement (a Shard whose pieces interleave); see DTensor's placement_types
StridedShard = _StridedShard
# DTensor's own placement math: (local size, global indices) of one mesh coordinate's shard
get_shard_size_and_offsets = _get_shard_size_and_offsets
# torch.optim.Muon's functional core (torch/optim/_muon.py): fsdptk.Muon runs exactly this math per
# matrix; ``_to_scalar`` is how torch's optimizers read a (possibly tensor) learning rate
muon_zeropower = _zeropower_via_newtonschulz
muon_adjust_lr = _adjust_lr
optim_to_scalar = _to_scalar


def storage_users(t: torch.Tensor) -> int | None:
    """How many holders share ``t``'s storage, ``t`` included; ``None`` where this torch does not
    say (``torch._C._storage_Use_Count``, private: present in torch 2.4-2.15).

    Counted: every tensor and view over the storage (torch's use count of it), and Python
    references to the storage object itself (``t.untyped_storage()`` kept by someone: torch gives
    one Python object per storage, which its use count sees once however many hold it, so the
    references to that object are counted here, above what a fresh handle has). Not counted: raw
    pointers (``data_ptr()``, ctypes, registered host memory), and whether the memory was shared
    with another process (``t.untyped_storage().is_shared()`` says that). A count of 1 means
    nothing but ``t`` holds its memory through torch.

    Examples:
        >>> import torch
        >>> t = torch.empty(4)
        >>> storage_users(t)
        1
        >>> kept = t.untyped_storage()  # a Python handle of the storage, kept
        >>> storage_users(t)
        2
        >>> del kept
        >>> storage_users(t)
        1
    """
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        refs, uses = _storage_refs(t, count)
        base = _fresh_handle_refs(count)
    except Exception:  # noqa: BLE001 - an unknown storage kind: say nothing, never reuse
        return None
    return uses - 1 + max(refs - base, 0)  # less the handle made here


def _storage_refs(t: torch.Tensor, count: Any) -> tuple[int, int]:
    """``(Python references to t's storage object, torch's use count of the storage)``, both with
    this function's own handle included (the same code path for every tensor, so the handle's own
    references are the same constant: :func:`_fresh_handle_refs`)."""
    storage = t.untyped_storage()
    return sys.getrefcount(storage), int(count(storage._cdata))


_FRESH_REFS: list[int] = []


def _fresh_handle_refs(count: Any) -> int:
    """The Python references :func:`_storage_refs` sees for a storage nobody else holds a handle
    of (measured once: the interpreter's own counting differs between Python versions)."""
    if not _FRESH_REFS:
        _FRESH_REFS.append(_storage_refs(torch.empty(1), count)[0])
    return _FRESH_REFS[0]


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


_CONCAT_LOCK = threading.Lock()
# Every block of every thread shares one patch: the first block to enter installs it, the last one
# to leave (whatever the order: a block of one thread may exit while another's is still open)
# puts back the function torch had before the first, saved here when that block installed it.
_CONCAT_DEPTH = 0
_CONCAT_SAVED: tuple[Any, Any] | None = None  # (torch's own staticmethod, the one installed over it)
# (id of each mesh, ...) -> (the meshes, kept alive so their ids stay theirs; the concatenation)
_CONCAT_CACHE: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}


def _cached_concatenation(raw: Any) -> Any:
    """``raw`` (torch's ``DeviceMesh._concatenate``) with its results kept in ``_CONCAT_CACHE``."""

    def concatenate(device_mesh_list: list[Any]) -> Any:
        key = tuple(id(m) for m in device_mesh_list)
        hit = _CONCAT_CACHE.get(key)
        if hit is None:
            hit = (tuple(device_mesh_list), raw(device_mesh_list))
            _CONCAT_CACHE[key] = hit
        return hit[1]

    return staticmethod(concatenate)


@contextmanager
def shared_mesh_concatenation() -> Iterator[None]:
    """Inside the block, ``DeviceMesh._concatenate`` of the same meshes returns one mesh.

    FSDP2's ``fully_shard`` concatenates the data-parallel mesh with each DTensor parameter's own
    (TP, EP) mesh, once per parameter, and each concatenation builds a new ``DeviceMesh`` (layout
    checks, the rank map remapped, coordinates computed): for a 10-layer Llama on 4 ranks, FSDP x TP,
    that was a third of ``shard_model``'s time. Every call with the same meshes builds an equal
    mesh, so the block hands back the first one (meshes compare by layout and rank map, so the
    parameters' specs are equal either way).

    The patch is process-wide (it replaces the class attribute), so blocks share it: nested blocks
    and blocks open at the same time in several threads use one patch and one cache, installed
    (under a lock) by the first block to enter, with torch's own function saved then; when the last
    open block exits, whichever it is and in whatever order the blocks exit, torch's own function
    is put back and the cache dropped, also when a block exits with an exception. While any block
    is open, ``fully_shard`` calls outside every block (another thread) share the cache too. Where
    this torch has no ``_concatenate`` (or it is not a staticmethod), nothing changes; where
    something else replaced the patch while a block was open, that replacement is left as it is.
    """
    global _CONCAT_DEPTH, _CONCAT_SAVED
    from torch.distributed.device_mesh import DeviceMesh

    with _CONCAT_LOCK:  # _CONCAT_SAVED is set exactly while _CONCAT_DEPTH > 0
        if _CONCAT_DEPTH == 0:
            original = DeviceMesh.__dict__.get("_concatenate")
            if isinstance(original, staticmethod):  # else a torch without it, or a different shape of it
                patched = _cached_concatenation(original.__func__)
                DeviceMesh._concatenate = patched  # type: ignore[method-assign]
                _CONCAT_SAVED = (original, patched)
        entered = _CONCAT_SAVED is not None
        if entered:
            _CONCAT_DEPTH += 1
    if not entered:
        yield
        return
    try:
        yield
    finally:
        with _CONCAT_LOCK:
            _CONCAT_DEPTH -= 1
            saved = _CONCAT_SAVED
            if _CONCAT_DEPTH == 0 and saved is not None:  # the last open block: torch's own back
                if DeviceMesh.__dict__.get("_concatenate") is saved[1]:
                    DeviceMesh._concatenate = saved[0]  # type: ignore[method-assign]
                _CONCAT_SAVED = None
                _CONCAT_CACHE.clear()


def default_store() -> Any:
    """The key-value store of the default process group (its rendezvous store, under torchrun the
    agent's on the first host), or ``None`` when there is no process group."""
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except (RuntimeError, ValueError):  # no default process group
        return None


@dataclass
class P2PBatch:
    """What :func:`p2p_batch` yields. ``grouped``: the backend groups the block's posts; then, after
    the block, ``works`` holds the batch's own work, the one to wait for (what the posts return
    inside a group is not waited for, as in ``batch_isend_irecv``). Otherwise each post's own work
    is the one to wait for and ``works`` stays empty."""

    grouped: bool = False
    works: list[Any] = field(default_factory=list)


@contextmanager
def p2p_batch(group: Any, device: torch.device) -> Iterator[P2PBatch]:
    """Post the point-to-point operations of the block as one batch where the backend groups them.

    On a backend that supports coalescing (NCCL) the block runs inside torch's coalescing manager,
    exactly as ``torch.distributed.batch_isend_irecv`` does: one ``ncclGroupStart`` /
    ``ncclGroupEnd``, so NCCL progresses every operation of the batch together. On others (gloo)
    the posts go out one by one as they are made (each returns its own work). Unlike
    ``batch_isend_irecv`` it takes the posts as calls made in the block (made through
    ``torch.distributed.isend`` / ``irecv`` as looked up at call time), so a caller can retry a
    post that raised and keep every tensor alive.

    Args:
        group: the process group of every post in the block (``None``: the default group).
        device: the device of their tensors.
    """
    from torch.distributed.distributed_c10d import ProcessGroup, _coalescing_manager, _get_default_group

    pg = group if group is not None else _get_default_group()
    batch = P2PBatch(grouped=type(pg) is ProcessGroup and pg._get_backend(device).supports_coalescing)
    if batch.grouped:
        with _coalescing_manager(pg, device, async_ops=True) as cm:
            yield batch
        batch.works.extend(cm.works)
    else:
        yield batch

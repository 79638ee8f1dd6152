"""fsdptk: composable, memory-lean helpers for PyTorch FSDP2 training loops.

Public names are imported lazily (PEP 562), so ``import fsdptk`` stays fast and quiet and never
imports torchao; the first attribute access loads the module that defines it.

Examples:
    >>> import fsdptk
    >>> fsdptk.get_distributed_backend("cpu")
    'gloo'
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> submodule (relative to fsdptk) that defines it
_LAZY: dict[str, str] = {
    # runtime
    "is_distributed": "runtime",
    "get_world_size_and_rank": "runtime",
    "get_distributed_backend": "runtime",
    "set_torch_num_threads": "runtime",
    "validate_no_params_on_meta_device": "runtime",
    "ParallelDims": "mesh",
    "get_shard_conditions": "predicates", "no_split_modules": "predicates",
    "shard_model": "sharding",
    "describe_sharding": "sharding",
    "ShardingPlan": "sharding",
    "ShardConditionError": "errors",
    "apply_activation_checkpointing": "activation",
    "load_safetensors": "checkpoint", "save_safetensors": "checkpoint", "SafetensorsCheckpoint": "checkpoint", "CheckpointError": "errors", "save_dcp": "checkpoint", "load_dcp": "checkpoint", "dcp_to_safetensors": "checkpoint", "safetensors_to_dcp": "checkpoint",
    "save_safetensors_async": "background", "save_dcp_async": "background", "PendingSave": "background", "release_snapshot": "background",
    "materialize": "buffers", "params_on_meta": "buffers", "register_buffer_init": "buffers",
    "load_from_full_model_state_dict": "state_dict", "gather_cpu_state_dict": "state_dict", "iter_full_state_dict": "state_dict",
    "get_full_optimizer_state_dict": "optim", "load_from_full_optimizer_state_dict": "optim", "iter_full_optimizer_state": "optim", "get_optimizer_param_groups": "optim", "to_fqn_optimizer_state_dict": "optim",
    "hf_meta_model": "hf", "save_hf_config": "hf",
    "prepare_mha_for_tp": "tp", "apply_tp": "tp", "build_tp_plan": "tp_plan", "llama_tp_plan": "tp_plan",
    "hf_tp_plan": "hf",
    "apply_ep": "ep", "expert_modules": "ep",
    "Muon": "muon",
    # one exception module (each class also importable from the module that raises it)
    "StateDictMismatchError": "errors", "CheckpointLockedError": "errors", "ConversionError": "errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdptk' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fsdptk.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY)  # noqa: PLE0605 (names resolved lazily by __getattr__)

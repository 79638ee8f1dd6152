"""Scenarios and the methods that run them: fsdptk and its peers, on the same input.

A method is three functions of a :class:`Ctx`: ``setup`` (untimed: build the input every rank
needs, as that library's users would hold it), ``run`` (the timed operation, between barriers)
and ``check`` (untimed: did the operation produce the right thing; returns ``"ok"`` or what was
wrong). A peer that cannot run a scenario is listed in :data:`NOT_APPLICABLE` with the reason.

How each library is used is how its own users do it:
- torchtune's recipes read the checkpoint on EVERY rank and pass it to
  ``load_from_full_model_state_dict`` (which casts and ``distribute_tensor``s each entry);
- PyTorch DCP and accelerate load with only rank 0 holding the state (``broadcast_from_rank0``);
- fsdptk is measured both ways (``fsdptk`` = rank 0 holds it, ``fsdptk_all`` = every rank does).
"""

from __future__ import annotations

from .common import Ctx, Method, check_model_loaded, materialise_random, nothing
from .model_state import (
    _check_gather,
    _check_save,
    _gather_dcp,
    _gather_fsdptk,
    _gather_torchtune,
    _load_accelerate,
    _load_dcp,
    _load_fsdptk,
    _load_fsdptk_all,
    _load_torchtune,
    _save_fsdptk,
    _save_fsdptk_writers,
    _save_via,
    _sd_all,
    _sd_rank0,
    _st_accelerate,
    _st_dcp,
    _st_fsdptk_rank0_read,
    _st_fsdptk_shard_on_read,
    _st_torchtune,
)
from .optim_state import (
    _check_ogather,
    _check_oload,
    _ogather_dcp,
    _ogather_fsdptk,
    _ogather_torchtune,
    _oload_dcp,
    _oload_fsdptk,
    _oload_setup,
    _oload_torchtune,
    _opt_state_setup,
)

__all__ = ["Ctx", "Method", "METHODS", "NOT_APPLICABLE", "SCENARIOS", "PEERS", "SCENARIO_TITLES", "method_needs"]

# ----------------------------------------------------------------------------------------------
# the registry
METHODS: dict[str, dict[str, Method]] = {
    "load_mem": {
        "fsdptk": Method(_sd_rank0, _load_fsdptk, check_model_loaded, "fsdptk",
                         "load_from_full_model_state_dict(broadcast_from_rank0=True); rank 0 holds the sd"),
        "fsdptk_all": Method(_sd_all, _load_fsdptk_all, check_model_loaded, "fsdptk",
                             "load_from_full_model_state_dict(); every rank holds the sd (torchtune's usage)"),
        "dcp": Method(_sd_rank0, _load_dcp, check_model_loaded, "torch",
                      "set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)"),
        "torchtune": Method(_sd_all, _load_torchtune, check_model_loaded, "torchtune",
                            "torchtune.training.load_from_full_model_state_dict; every rank holds the sd"),
        "accelerate": Method(_sd_rank0, _load_accelerate, check_model_loaded, "accelerate",
                             "fsdp2_load_full_state_dict(accelerator, model, sd); rank 0 holds the sd"),
    },
    "load_st": {
        "fsdptk_shard_on_read": Method(nothing, _st_fsdptk_shard_on_read, check_model_loaded, "fsdptk",
                                       "load_safetensors(shard_on_read=True): each rank reads its slices"),
        "fsdptk_rank0_read": Method(nothing, _st_fsdptk_rank0_read, check_model_loaded, "fsdptk",
                                    "load_safetensors(shard_on_read=False): rank 0 reads and scatters"),
        "dcp": Method(nothing, _st_dcp, check_model_loaded, "torch",
                      "rank 0 safetensors.load_file + set_model_state_dict(broadcast_from_rank0=True)"),
        "torchtune": Method(nothing, _st_torchtune, check_model_loaded, "torchtune",
                            "every rank safetensors.load_file + load_from_full_model_state_dict"),
        "accelerate": Method(nothing, _st_accelerate, check_model_loaded, "accelerate",
                             "rank 0 safetensors.load_file + fsdp2_load_full_state_dict"),
    },
    "gather": {
        "fsdptk": Method(materialise_random, _gather_fsdptk, _check_gather, "fsdptk",
                         "gather_cpu_state_dict(model, is_rank_zero)"),
        "dcp": Method(materialise_random, _gather_dcp, _check_gather, "torch",
                      "get_model_state_dict(full_state_dict=True, cpu_offload=True)"),
        "torchtune": Method(materialise_random, _gather_torchtune, _check_gather, "torchtune",
                            "torchtune.training.gather_cpu_state_dict(model, is_rank_zero)"),
    },
    "save": {
        "fsdptk": Method(materialise_random, _save_fsdptk, _check_save, "fsdptk",
                         "save_safetensors(model, dir) (streams buckets to rank 0's writer)"),
        "fsdptk_w2": Method(materialise_random, _save_fsdptk_writers(2), _check_save, "fsdptk",
                            "save_safetensors(model, dir, writers=2) (min(2, ranks) writers)"),
        "fsdptk_w4": Method(materialise_random, _save_fsdptk_writers(4), _check_save, "fsdptk",
                            "save_safetensors(model, dir, writers=4) (min(4, ranks) writers)"),
        "dcp": Method(materialise_random, _save_via(_gather_dcp), _check_save, "torch",
                      "get_model_state_dict(full, cpu_offload) + rank 0 safetensors.save_file"),
        "torchtune": Method(materialise_random, _save_via(_gather_torchtune), _check_save, "torchtune",
                            "gather_cpu_state_dict + rank 0 safetensors.save_file"),
    },
    "optim_gather": {
        "fsdptk": Method(_opt_state_setup, _ogather_fsdptk, _check_ogather, "fsdptk",
                         "get_full_optimizer_state_dict(model, opt, is_rank_zero)"),
        "dcp": Method(_opt_state_setup, _ogather_dcp, _check_ogather, "torch",
                      "get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)"),
        "torchtune": Method(_opt_state_setup, _ogather_torchtune, _check_ogather, "torchtune",
                            "torchtune.training.get_full_optimizer_state_dict"),
    },
    "optim_load": {
        "fsdptk": Method(_oload_setup(True, False), _oload_fsdptk, _check_oload, "fsdptk",
                         "load_from_full_optimizer_state_dict(broadcast_from_rank0=True); rank 0 holds it"),
        "dcp": Method(_oload_setup(True, False), _oload_dcp, _check_oload, "torch",
                      "set_optimizer_state_dict(full_state_dict=True, broadcast_from_rank0=True)"),
        "torchtune": Method(_oload_setup(False, True), _oload_torchtune, _check_oload, "torchtune",
                            "torchtune.training.load_from_full_optimizer_state_dict; every rank holds it"),
    },
}

_ACC_DCP = "accelerate's FSDP2 path for this is torch.distributed.checkpoint.state_dict ({}), i.e. the dcp row"
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("gather", "accelerate"): _ACC_DCP.format("Accelerator.get_state_dict -> get_model_state_dict"),
    ("save", "accelerate"): _ACC_DCP.format("save_model/save_fsdp_model -> get_model_state_dict"),
    ("optim_gather", "accelerate"): _ACC_DCP.format("save_fsdp_optimizer -> get_optimizer_state_dict"),
    ("optim_load", "accelerate"): _ACC_DCP.format("load_fsdp_optimizer -> set_optimizer_state_dict"),
    ("ttfs", "dcp"): "time-to-first-step is fsdptk's own example (examples/train_llama.py); no peer script",
    ("ttfs", "torchtune"): "time-to-first-step is fsdptk's own example (examples/train_llama.py); no peer script",
    ("ttfs", "accelerate"): "time-to-first-step is fsdptk's own example (examples/train_llama.py); no peer script",
}

SCENARIOS = ["load_mem", "load_st", "gather", "save", "optim_gather", "optim_load", "ttfs"]
PEERS = ["dcp", "torchtune", "accelerate"]
SCENARIO_TITLES = {
    "load_mem": "model load from an in-memory full state dict",
    "load_st": "model load from a safetensors file",
    "gather": "model gather to a full CPU state dict on rank 0",
    "save": "save the sharded model to a safetensors file",
    "optim_gather": "AdamW state gather (full, rank 0)",
    "optim_load": "AdamW state load (full -> sharded)",
    "ttfs": "time to first step of examples/train_llama.py (launch -> step 1 logged)",
}


def method_needs(scenario: str, method: str) -> str:
    if scenario == "ttfs":
        return "fsdptk"
    return METHODS[scenario][method].needs

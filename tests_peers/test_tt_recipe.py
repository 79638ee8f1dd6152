"""torchtune 0.6.1's own LoRA recipe (``lora_finetune_distributed.py``) with fsdptk swapped in.

At 2 ranks over gloo, on a tiny Llama-2 LoRA model from torchtune's component builder and a base
checkpoint written at test time (no downloads), ``LoRAFinetuneRecipeDistributed`` is driven through
its own methods, configured by a minimal OmegaConf config:

1. first run: ``load_checkpoint`` -> ``_setup_model`` (``shard_model``, adapters initialised, base
   loaded, ``validate_no_params_on_meta_device``) -> ``_setup_optimizer``; two AdamW steps; then
   the recipe's own ``save_checkpoint`` (``gather_cpu_state_dict``,
   ``get_full_optimizer_state_dict``, torchtune's checkpointer writing adapter and recipe state);
2. resume: a new recipe with ``resume_from_checkpoint=True`` loads that checkpoint
   (``load_from_full_model_state_dict`` for the adapters, then the base, then
   ``load_from_full_optimizer_state_dict``).

The resumed adapters and optimizer state must be bit-identical to the checkpointed ones, and the
next step bit-identical to the first run's next step. This is the case that silently
re-initialised the adapters while fsdptk's ``release_sd`` emptied the caller's dict (the recipe
tests ``not lora_weights_state_dict`` after loading them). The same flow with torchtune's own
functions gives the same bytes.

Not driven: ``setup()``'s tokenizer, dataset, loss and LR scheduler (they need tokenizer files and
datasets, and call none of the shared functions) and ``train()`` (its steps are done here with the
recipe's model and optimizer).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ttparity import (
    LORA_KWARGS,
    diff_keys,
    fsdptk_in_torchtune,
    random_full_state_dict,
    same,
    split,
)


def _cfg(root: str, resume: bool):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "device": "cpu",
        "dtype": "fp32",
        "seed": 7,
        "epochs": 2,
        "max_steps_per_epoch": None,
        "gradient_accumulation_steps": 1,
        "resume_from_checkpoint": resume,
        "output_dir": f"{root}/out",
        "model": {"_component_": "torchtune.models.llama2.lora_llama2", **LORA_KWARGS},
        "checkpointer": {
            "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
            "checkpoint_dir": f"{root}/base",
            "checkpoint_files": ["model.pt"],
            "model_type": "LLAMA2",
            "output_dir": f"{root}/out",
        },
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2, "weight_decay": 0.01},
    })


def _setup(recipe, cfg) -> dict:
    """``LoRAFinetuneRecipeDistributed.setup``'s checkpoint, model and optimizer part, line for
    line with the same arguments; returns the loaded checkpoint dict."""
    from torchtune import training

    resume = recipe._resume_from_checkpoint
    checkpoint_dict = recipe.load_checkpoint(cfg_checkpointer=cfg.checkpointer)
    recipe._compile = cfg.get("compile", False)
    recipe._model = recipe._setup_model(
        cfg_model=cfg.model,
        enable_activation_checkpointing=recipe._enable_activation_checkpointing,
        enable_activation_offloading=recipe._enable_activation_offloading,
        custom_sharded_layers=cfg.get("custom_sharded_layers", None),
        fsdp_cpu_offload=cfg.get("fsdp_cpu_offload", False),
        reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
        base_model_state_dict=checkpoint_dict[training.MODEL_KEY],
        lora_weights_state_dict=checkpoint_dict[training.ADAPTER_KEY] if resume else None,
    )
    recipe._optimizer = recipe._setup_optimizer(
        cfg_optimizer=cfg.optimizer,
        opt_state_dict=checkpoint_dict[training.OPT_KEY] if resume else None,
    )
    return checkpoint_dict


def _step(recipe, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    tokens = torch.randint(0, LORA_KWARGS["vocab_size"], (2, 8), generator=gen)
    loss = recipe._model(tokens).pow(2).mean()
    loss.backward()
    recipe._optimizer.step()
    recipe._optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _state(recipe) -> tuple[dict, dict]:
    import fsdptk

    rank0 = dist.get_rank() == 0
    return (fsdptk.gather_cpu_state_dict(recipe._model, rank0),
            fsdptk.get_full_optimizer_state_dict(recipe._model, recipe._optimizer, rank0))


def _recipe_class():
    """The recipe class, loaded from the file ``tune run`` executes: the wheel installs it as
    ``<site-packages>/recipes/lora_finetune_distributed.py``, in a folder that refuses imports."""
    import importlib.util
    import sys

    import torchtune

    name = "_torchtune_lora_finetune_distributed"
    if name not in sys.modules:
        path = Path(torchtune.__file__).parents[1] / "recipes" / "lora_finetune_distributed.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].LoRAFinetuneRecipeDistributed


@contextlib.contextmanager
def _no_cuda_memory_log():
    """``_setup_model`` logs CUDA memory stats on rank 0 unconditionally, and torchtune's
    ``get_memory_stats`` raises on a CPU device: silence those two logging helpers (nothing else
    of torchtune is replaced besides the shared names)."""
    from torchtune import training

    saved = training.get_memory_stats, training.log_memory_stats
    training.get_memory_stats = lambda device, reset_stats=True: {}
    training.log_memory_stats = lambda stats, message="": None
    try:
        yield
    finally:
        training.get_memory_stats, training.log_memory_stats = saved


def _first_run_then_resume(root: str, swapped: bool):
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtune import training

    LoRAFinetuneRecipeDistributed = _recipe_class()  # noqa: N806
    with fsdptk_in_torchtune() if swapped else contextlib.nullcontext(), _no_cuda_memory_log():
        cfg = _cfg(root, resume=False)
        first = LoRAFinetuneRecipeDistributed(cfg)
        _setup(first, cfg)
        for i in range(2):
            _step(first, i)
        first._dataloader = StatefulDataLoader(list(range(8)), batch_size=2)  # its state is saved
        first.epochs_run = 1
        first.save_checkpoint(epoch=0)  # intermediate: epochs=2
        saved_model, saved_opt = _state(first)

        cfg = _cfg(root, resume=True)
        resumed = LoRAFinetuneRecipeDistributed(cfg)
        ckpt = _setup(resumed, cfg)
        adapters_on_disk = torch.load(Path(root) / "out" / "epoch_0" / "adapter_model.pt")
        resumed_model, resumed_opt = _state(resumed)
        out = {
            "epochs_run": resumed.epochs_run == 1,
            "adapter keys kept": list(ckpt[training.ADAPTER_KEY]) == list(adapters_on_disk),
            "model": diff_keys(resumed_model, saved_model),
            "adapters = file": diff_keys(split(resumed_model)[1], adapters_on_disk)
            if dist.get_rank() == 0 else [],
            "optimizer": same(resumed_opt, saved_opt),
            "next step": same(_step(resumed, 5), _step(first, 5)),
            "shards after next step": diff_keys(resumed._model.state_dict(),
                                                first._model.state_dict()),
        }
        # the adapters must have been trained (not the zero LoRA B of a fresh init) for the check
        # to mean something
        trained = [k for k, v in split(saved_model)[1].items() if k.endswith("lora_b.weight")]
        out["lora_b trained"] = dist.get_rank() != 0 or (
            len(trained) > 0 and all(saved_model[k].abs().sum() > 0 for k in trained))
        return out, saved_model


@pytest.mark.parametrize("n", [2, 4])
def test_lora_recipe_resume_with_fsdptk_swapped_in(world, n: int, tmp_path: Path):
    base, _ = split(random_full_state_dict(seed=11))
    (tmp_path / "base").mkdir()
    torch.save(base, tmp_path / "base" / "model.pt")
    results = {}
    for swapped in (True, False):
        root = tmp_path / ("fsdptk" if swapped else "torchtune")
        root.mkdir()
        (root / "base").symlink_to(tmp_path / "base")
        per_rank = world(n).run(_first_run_then_resume, str(root), swapped)
        for rank, (out, _) in enumerate(per_rank):
            bad = {k: v for k, v in out.items() if v not in (True, [])}
            assert not bad, f"swapped={swapped} rank {rank}: {bad}"
        results[swapped] = per_rank[0][1]
    # torchtune's own functions and fsdptk's give the same checkpointed model
    assert diff_keys(results[True], results[False]) == []

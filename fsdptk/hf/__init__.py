"""Hugging Face transformers integration: build a model on ``meta`` from a checkpoint's config, pick
its ``_no_split_modules`` as FSDP units, and save its config beside the weights.

A package (every name below is importable from ``fsdptk.hf``, the contract): :mod:`fsdptk.hf.build`
(meta build, configs, the TP plan), :mod:`fsdptk.hf.pretrained` (the one call) and
:mod:`fsdptk.hf.adapters` (PEFT adapters). Checkpoints in the Hub layout (per-expert MoE tensors)
are read and written through transformers' own conversion rules (:mod:`fsdptk.conversions`).

transformers is imported only inside the functions that need it, so ``import fsdptk.hf`` is cheap
and works without transformers installed. Nothing here downloads: configs are read from local
directories only (a ``save_pretrained`` directory, or a snapshot directory of the HF cache, whose
files are symlinks into ``blobs/``).

- :func:`hf_meta_model`: ``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` from a
  checkpoint directory (what ``fsdptk plan DIR`` uses).
- :func:`no_split_modules` (from :mod:`fsdptk.predicates`): the shard condition transformers and
  accelerate use for FSDP auto-wrapping.
- :func:`save_hf_config`: ``config.json`` (and ``generation_config.json``) as ``save_pretrained``
  writes them; :func:`fsdptk.save_safetensors` does this itself for a model with an HF config.
- :func:`save_adapter` / :func:`load_adapter`: a PEFT adapter (LoRA, DoRA, ...) of a sharded model in
  PEFT's own format (``adapter_model.safetensors``, ``adapter_config.json``), see docs/hf.md;
  :func:`init_adapters`: fresh LoRA adapters with PEFT's own init from one seed, alike on every rank.
- :func:`hf_tp_plan`: the model's own tensor-parallel plan as
  DTensor ``ParallelStyle`` objects for :func:`fsdptk.apply_tp` (see docs/hf_2d.md).
- :func:`hf_ep_plan`: the experts modules of the model's own expert-parallel plan, for
  :func:`fsdptk.apply_ep` (see docs/expert_parallel.md).
- :func:`weight_source`: the model's weights for an inference engine (vLLM's ``WeightSource``
  protocol) in the Hub checkpoint's names and shapes, each tensor gathered to its owner only;
  with ``track_changes=True`` its ``iter_patches()`` yields only the changed elements
  (:class:`SparseWeightPatch`, vLLM's class where vLLM imports).
- :func:`from_pretrained`: the one call for the common case, the composition of the above with
  :class:`fsdptk.ParallelDims`, :func:`fsdptk.apply_tp`, :func:`fsdptk.apply_activation_checkpointing`,
  :func:`fsdptk.shard_model` and :func:`fsdptk.load_safetensors`.

Examples:
    >>> from transformers import LlamaConfig
    >>> from fsdptk.hf import hf_meta_model, no_split_modules
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    >>> model = hf_meta_model(cfg)
    >>> type(model).__name__, model.lm_head.weight.device.type, no_split_modules(model)
    ('LlamaForCausalLM', 'meta', no_split_modules(LlamaDecoderLayer))
"""

from __future__ import annotations

from fsdptk._files.hf_config import hf_config
from fsdptk.hf.adapters import init_adapters, load_adapter, save_adapter
from fsdptk.hf.build import hf_ep_plan, hf_meta_model, hf_tp_plan, save_hf_config
from fsdptk.hf.pretrained import from_pretrained
from fsdptk.hf.weight_source import SparseWeightPatch, weight_source
from fsdptk.predicates import no_split_modules

__all__ = ["from_pretrained", "hf_meta_model", "no_split_modules", "save_hf_config", "hf_config",
           "hf_tp_plan", "hf_ep_plan", "save_adapter", "load_adapter", "init_adapters",
           "weight_source", "SparseWeightPatch"]

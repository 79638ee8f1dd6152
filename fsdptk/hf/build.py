"""Build a transformers model on ``meta`` from a checkpoint's config, save its config, and
translate its own tensor-parallel plan (the parts of :mod:`fsdptk.hf` that build; the one call is
:mod:`fsdptk.hf.pretrained`, the PEFT adapters :mod:`fsdptk.hf.adapters`)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdptk._files.hf_config import stage_hf_config

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["save_hf_config", "hf_meta_model", "hf_tp_plan", "hf_ep_plan"]

PathLike = str | os.PathLike[str]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("fsdptk.hf needs transformers: pip install transformers") from e
    return transformers


def save_hf_config(model: nn.Module, path: PathLike, *, dtype: torch.dtype | None = None
                   ) -> list[Path]:
    """Write ``config.json`` (and ``generation_config.json``) of an HF model into ``path``.

    Not collective: call it on one process (rank 0). :func:`fsdptk.save_safetensors` already does
    this for a model with an HF config; use this one after ``dcp_to_safetensors`` or another
    writer. Each file is written in full under a hidden name first, then renamed into place.

    Args:
        model: a transformers model (sharded or not).
        path: the checkpoint directory (created if needed).
        dtype: the dtype recorded in ``config.json`` (default: the model's floating dtype).

    Returns:
        list[Path]: the files written.

    Raises:
        TypeError: when the model carries no HF config (``model.config``).
        ValueError: transformers' own save-time validation of the config fails.
        OSError: the directory cannot be written.

    Examples:
        >>> import tempfile
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = hf_meta_model(LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=1, num_attention_heads=4, vocab_size=256))
        >>> [p.name for p in save_hf_config(model, tempfile.mkdtemp())]
        ['config.json', 'generation_config.json']
    """
    staged = stage_hf_config(model, path, dtype=dtype)
    if staged is None:
        raise TypeError(f"{type(model).__name__} carries no Hugging Face config (model.config with "
                        "save_pretrained / to_json_file)")
    return staged.commit()


def _load_config(source: PathLike, trust_remote_code: bool, overrides: dict[str, Any]) -> Any:
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json: not a Hugging Face "
                                    "checkpoint directory")
    elif not path.is_file():
        raise FileNotFoundError(f"no such file or directory: {str(path)!r}")
    config = _transformers().AutoConfig.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    if not overrides:
        return config
    values = {**config.to_dict(), **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        values.pop("layer_types", None)  # per-layer list of the old depth: recomputed
    return type(config).from_dict(values)


def hf_meta_model(
    source: Any,
    *,
    dtype: torch.dtype | None = None,
    auto_class: Any = None,
    trust_remote_code: bool = False,
    **config_overrides: Any,
) -> nn.Module:
    """Build a transformers model on the ``meta`` device: no memory, no weights, no download.

    Args:
        source: a transformers config, a checkpoint directory holding ``config.json`` (a
            ``save_pretrained`` directory or an HF-cache snapshot directory), or a config file.
        dtype: the parameters' dtype (default: the config's ``dtype``, else float32).
        auto_class: the transformers auto class (default ``AutoModelForCausalLM``, falling back to
            ``AutoModel`` for configs it does not know, e.g. encoders).
        trust_remote_code: allow configs / models defined by code in the checkpoint directory.
        **config_overrides: config values to override (``num_hidden_layers=2``); path sources only.

    Returns:
        nn.Module: the model, every parameter and buffer on ``meta``.

    Raises:
        FileNotFoundError: no such path, or a directory without ``config.json``.
        ValueError: transformers does not know the config (e.g. an unknown ``model_type``), or
            overrides given with a config object.
        ImportError: transformers is not installed.

    Examples:
        >>> from transformers import Qwen2Config
        >>> model = hf_meta_model(Qwen2Config(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
        >>> {p.device.type for p in model.parameters()}
        {'meta'}
    """
    transformers = _transformers()
    if isinstance(source, (str, os.PathLike)):
        config = _load_config(source, trust_remote_code, config_overrides)
    elif config_overrides:
        raise ValueError(f"config overrides {sorted(config_overrides)} need a path source; set "
                         "them on the config object instead")
    else:
        config = copy.deepcopy(source)  # from_config records its dtype on the config
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    classes = [auto_class] if auto_class is not None else [
        transformers.AutoModelForCausalLM, transformers.AutoModel]
    for i, cls in enumerate(classes):
        try:
            with torch.device("meta"):
                return cls.from_config(config, **kwargs)
        except ValueError as e:
            if i + 1 == len(classes) or "Unrecognized configuration class" not in str(e):
                raise
    raise AssertionError  # unreachable


def hf_tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Translate a transformers model's own tensor-parallel plan into DTensor ``ParallelStyle``\\ s.

    Reads ``model.tp_plan`` (the config's ``base_model_tp_plan`` merged with the class's entries:
    ``model.embed_tokens`` -> ``embedding_rowwise``, ``lm_head`` -> ``colwise_gather_output``, ...),
    matches its wildcard rules against the concrete module FQNs the way transformers does (layer
    numbers become ``*``), and translates every style string into torch's styles with the same
    layouts (see the table in ``docs/hf_2d.md``). Attention modules whose k/v projections are
    colwise get an :class:`~fsdptk._plans.tp_styles.HFAttentionHeads` entry: the head counts are validated by
    :func:`fsdptk.apply_tp` before anything changes, and GQA with fewer KV heads than TP ranks uses
    :class:`~fsdptk.tp_plan.ReplicatedKVColwise`. A tied input embedding / ``lm_head`` (both
    placed ``Shard(0)`` over the vocabulary) stays one Parameter when the plan is applied.

    With ``sequence_parallel`` the activations between the attention / MLP blocks stay sharded on
    the sequence dim (its length must divide by the TP size): the embedding reduce-scatters, the
    norms between blocks are ``SequenceParallel``, each block gathers its input and its rowwise
    projection reduce-scatters, ``lm_head`` gathers. transformers' plans do not do this themselves.

    On a PEFT model (LoRA), the base model's plan goes to each LoRA layer's ``base_layer`` and the
    adapters get the styles that keep ``W x + s B (A x)`` exact: ``lora_B`` the colwise style of a
    colwise base (``lora_A`` whole on every TP rank), ``lora_A`` the rowwise style of a rowwise
    base (``lora_B`` whole). LoRA on fused MoE experts (PEFT's ``ParamWrapper``,
    ``target_parameters``) whose experts are ``moe_tp_experts``: the outermost wrapper gets
    :class:`~fsdptk._plans.tp_experts_lora.MoEExpertsLoraTP`, which splits each factor with its
    experts (a ``rowwise`` weight's A ``Shard(1)``, a ``colwise`` one's B ``Shard(0)``, the others
    whole; a ``packed_colwise`` one's B rows taken per rank for the call) and runs PEFT's forward on
    each rank's slice. DoRA / other LoRA variants, other tuners and ``sequence_parallel`` are
    refused (docs/hf_2d.md, "LoRA adapters").

    The model is only read. Call it on the unsharded model (``meta`` is fine), then
    ``apply_tp(model, mesh["tp"], plan)`` before activation checkpointing and ``shard_model``.

    Args:
        model: a transformers ``PreTrainedModel`` (any device, including meta).
        sequence_parallel: shard activations on the sequence dim between blocks.

    Returns:
        dict[str, ParallelStyle]: exact module FQN -> style, in ``named_modules`` order, for
        :func:`fsdptk.apply_tp`.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
        ValueError: if the model declares no plan; if a style string has no translation (the
            message names the string and the module FQN) or targets the wrong module type; if a
            rule names a parameter rather than a module; if a tied parameter would be placed two
            ways; if ``sequence_parallel`` is asked of a plan without an embedding / output pair
            around its blocks; on a PEFT model, if a planned layer's tuner is neither plain LoRA on
            ``nn.Linear`` (DoRA refused) nor a ``ParamWrapper`` on ``moe_tp_experts`` experts (the
            wrapper named), or ``sequence_parallel`` is asked.

    Examples:
        >>> dims = ParallelDims(dp_shard=2, tp=2)  # needs a 2x2 mesh; tests/test_hf_tp.py runs it  # doctest: +SKIP
        >>> mesh = dims.build_mesh("cuda")  # needs a 2x2 mesh; tests/test_hf_tp.py runs it  # doctest: +SKIP
        >>> plan = hf_tp_plan(model)  # needs a 2x2 mesh; tests/test_hf_tp.py runs it  # doctest: +SKIP
        >>> plan["model.layers.0.self_attn.q_proj"]  # needs a 2x2 mesh; tests/test_hf_tp.py runs it  # doctest: +SKIP
        ColwiseKeepTied(input_layouts=(Replicate(),), output_layouts=(Shard(dim=-1),), ...)
        >>> apply_tp(model, mesh["tp"], plan)  # needs a 2x2 mesh; tests/test_hf_tp.py runs it  # doctest: +SKIP
        >>> shard_model(model, no_split_modules(model), cpu_offload=False, dp_mesh=dims.fsdp_mesh)  # needs a 2x2 mesh; tests/test_hf_tp.py runs it  # doctest: +SKIP
    """
    from fsdptk._plans.hf_tp import translate_plan

    return translate_plan(model, sequence_parallel=sequence_parallel)


def hf_ep_plan(model: nn.Module) -> list[str]:
    """The experts modules of a transformers model's own expert-parallel plan, for
    :func:`fsdptk.apply_ep`.

    Reads ``model.ep_plan`` (the config's ``base_model_ep_plan``: ``"ep_dispatch_experts"`` on each
    experts module, ``"grouped_gemm"`` (``Shard(0)`` on the experts dim) on each of its
    parameters), matches its wildcard rules against the model's module FQNs the way transformers
    does, and checks that every parameter of each experts module has its ``grouped_gemm`` rule.
    The model is only read.

    With tensor parallelism too, leave the experts out of the TP plan: drop the entries of
    :func:`hf_tp_plan` at or under these FQNs (transformers' EP rules take precedence over its TP
    rules for the same modules the same way); :func:`fsdptk.hf.from_pretrained` does this.

    Args:
        model: a transformers ``PreTrainedModel`` (any device, including meta), or a PEFT model
            wrapping one (the plan is read through PEFT's prefixes).

    Returns:
        list[str]: the experts modules' FQNs in ``model`` (a PEFT model's own FQNs; with LoRA on
        the experts, the module inside its ``ParamWrapper`` s, which ``apply_ep`` shards with it),
        in ``named_modules`` order.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
        ValueError: if the model declares no EP plan, a style string has no translation, no module
            matches, or a parameter of an experts module has no ``grouped_gemm`` rule.

    Examples:
        >>> from transformers import Qwen3MoeConfig
        >>> model = hf_meta_model(Qwen3MoeConfig(hidden_size=64, intermediate_size=64,
        ...     moe_intermediate_size=16, num_experts=4, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
        >>> hf_ep_plan(model)
        ['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']
    """
    from fsdptk._plans.hf_ep import experts_from_plan

    return experts_from_plan(model)

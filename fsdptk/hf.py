"""Hugging Face transformers integration: build a model on ``meta`` from a checkpoint's config, pick
its ``_no_split_modules`` as FSDP units, and save its config beside the weights.

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
- :func:`hf_tp_plan`: the model's own tensor-parallel plan as
  DTensor ``ParallelStyle`` objects for :func:`fsdptk.apply_tp` (see docs/hf_2d.md).

Example:
    >>> from transformers import LlamaConfig
    >>> from fsdptk.hf import hf_meta_model, no_split_modules
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    >>> model = hf_meta_model(cfg)
    >>> type(model).__name__, model.lm_head.weight.device.type, no_split_modules(model)
    ('LlamaForCausalLM', 'meta', no_split_modules(LlamaDecoderLayer))
"""

from __future__ import annotations

import copy
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdptk.predicates import no_split_modules

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["hf_meta_model", "no_split_modules", "save_hf_config", "hf_config", "hf_tp_plan"]

PathLike = str | os.PathLike[str]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("fsdptk.hf needs transformers: pip install transformers") from e
    return transformers


def hf_config(model: nn.Module) -> Any | None:
    """The Hugging Face config a model carries, or ``None``.

    Args:
        model: any module (sharded or not).

    Returns:
        The object at ``model.config`` when it can be saved as an HF config (it has
        ``save_pretrained`` or ``to_json_file``), else ``None``.

    Example:
        >>> import torch
        >>> hf_config(torch.nn.Linear(2, 2)) is None
        True
    """
    config = getattr(model, "config", None)
    if not (hasattr(config, "save_pretrained") or hasattr(config, "to_json_file")):
        return None
    return config


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return None


def _architecture(model: nn.Module) -> str | None:
    """The model's class name as ``save_pretrained`` records it (FSDP2's ``FSDP<Class>`` unwrapped);
    ``None`` when the model is not a transformers ``PreTrainedModel``."""
    from torch.distributed.fsdp import FSDPModule

    mro = type(model).__mro__
    if not any(c.__name__ == "PreTrainedModel" for c in mro):
        return None
    return next(c.__name__ for c in mro if not issubclass(c, FSDPModule))


class _StagedConfig:
    """Config files written under a hidden directory inside the target, renamed into place by
    :meth:`commit` (or deleted by :meth:`abort`), so a failed save leaves no new config behind.

    Args:
        directory: the checkpoint directory the files are for.
        stage: the hidden directory holding them.
    """

    def __init__(self, directory: Path, stage: Path) -> None:
        self.directory, self.stage = directory, stage

    def commit(self) -> list[Path]:
        """Move every staged file into the directory (each rename atomic); returns their paths."""
        files = sorted(self.stage.iterdir())
        for f in files:  # on disk before they become visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        out = []
        for f in files:
            os.replace(f, self.directory / f.name)
            out.append(self.directory / f.name)
        self.abort()
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return out

    def abort(self) -> None:
        """Delete the staged files (the directory's own files are untouched)."""
        shutil.rmtree(self.stage, ignore_errors=True)


def _stage_hf_config(model: nn.Module, directory: PathLike, *, dtype: torch.dtype | None = None
                     ) -> _StagedConfig | None:
    """Write the model's HF config files to a hidden directory inside ``directory``.

    The files are what ``save_pretrained`` writes, from a copy of the config (the model's own is not
    modified): ``config.json`` with ``dtype`` (``dtype`` or the model's) and ``architectures`` set,
    and ``generation_config.json`` when the model can generate and has a generation config.

    Args:
        model: the model (sharded or not).
        directory: the checkpoint directory (created if needed).
        dtype: the floating dtype of the saved weights (default: the model's).

    Returns:
        _StagedConfig | None: the staged files, ``None`` when the model carries no HF config.

    Raises:
        ValueError: transformers refuses the config (e.g. its own save-time validation).
        OSError: the directory cannot be created or written.
    """
    config = hf_config(model)
    if config is None:
        return None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stage = directory / f".hf-config.{uuid.uuid4().hex[:8]}.tmp"
    stage.mkdir()
    try:
        config = copy.deepcopy(config)
        dtype = dtype or _model_dtype(model)
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")
        arch = _architecture(model)
        if arch is not None:
            config.architectures = [arch]
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(stage)
        else:
            config.to_json_file(str(stage / "config.json"))
        gen = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", None)
        if gen is not None and hasattr(gen, "save_pretrained") and (can_generate is None or can_generate()):
            gen.save_pretrained(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return _StagedConfig(directory, stage)


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

    Example:
        >>> import tempfile
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = hf_meta_model(LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=1, num_attention_heads=4, vocab_size=256))
        >>> [p.name for p in save_hf_config(model, tempfile.mkdtemp())]
        ['config.json', 'generation_config.json']
    """
    staged = _stage_hf_config(model, path, dtype=dtype)
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

    Example:
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
            around its blocks.

    Example:
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

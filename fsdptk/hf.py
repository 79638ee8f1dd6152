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
- :func:`save_adapter` / :func:`load_adapter`: a PEFT adapter (LoRA, DoRA, ...) of a sharded model in
  PEFT's own format (``adapter_model.safetensors``, ``adapter_config.json``), see docs/hf.md.
- :func:`hf_tp_plan` (defined in ``fsdptk._hf_tp``): the model's own tensor-parallel plan as
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
from typing import Any

import torch
from torch import nn

from fsdptk.predicates import no_split_modules

__all__ = ["hf_meta_model", "no_split_modules", "save_hf_config", "hf_config", "hf_tp_plan",
           "save_adapter", "load_adapter"]

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

    def write(stage: Path) -> None:
        _write_hf_config(model, config, stage, dtype)

    return _stage_files(directory, write)


def _stage_files(directory: PathLike, write: Any) -> _StagedConfig:
    """Run ``write(stage)`` into a new hidden directory inside ``directory`` (created if needed);
    the files it writes are renamed into ``directory`` by :meth:`_StagedConfig.commit`. A failing
    ``write`` leaves nothing behind."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stage = directory / f".hf-config.{uuid.uuid4().hex[:8]}.tmp"
    stage.mkdir()
    try:
        write(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return _StagedConfig(directory, stage)


def _write_hf_config(model: nn.Module, config: Any, stage: Path, dtype: torch.dtype | None) -> None:
    """Write ``config.json`` (and ``generation_config.json``) of ``model`` into ``stage``."""
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
    if hasattr(gen, "save_pretrained") and (can_generate is None or can_generate()):
        gen.save_pretrained(stage)


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


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def save_adapter(
    model: nn.Module,
    path: PathLike,
    *,
    adapter_name: str = "default",
    bucket_bytes: int | None = None,
    progress: bool | None = None,
) -> Path:
    """Save one PEFT adapter of a (sharded) model as ``PeftModel.save_pretrained`` writes it.

    Call on every rank. Which tensors are written, and under which keys, is what PEFT's own
    ``get_peft_model_state_dict`` returns for ``adapter_name`` (the adapter name stripped from the
    keys); only those tensors are gathered, to rank 0, bucket by bucket (the frozen base never
    leaves its shards). Rank 0 writes ``adapter_model.safetensors`` with the writer of
    :func:`fsdptk.save_safetensors` (temporary file, fsync, rename; the directory's lock; a failed
    save leaves the previous adapter as it was) and ``adapter_config.json`` as ``save_pretrained``
    writes it (``inference_mode: true``, ``base_model_name_or_path`` from the base model), staged
    before any tensor moves and renamed in after the weights commit. ``PeftModel.from_pretrained(base,
    path)`` loads the directory in one process. Unlike ``save_pretrained``, an adapter other than
    ``"default"`` is written into ``path`` itself (not ``path/adapter_name``), and no README.md.

    Args:
        model: a ``peft.PeftModel`` or a model with PEFT tuners injected; FSDP2-sharded, tensor
            parallel or plain.
        path: the adapter directory (created if needed; may hold a previous adapter).
        adapter_name: the adapter to save.
        bucket_bytes: full-tensor bytes gathered per step (default: the engine's, 16 MiB).
        progress: a tqdm bar of bytes written on rank 0 (``None``: only on a terminal).

    Returns:
        Path: ``path / "adapter_model.safetensors"`` (on every rank).

    Raises:
        TypeError: ``model`` has no PEFT adapter; on every rank, nothing written.
        KeyError: the model has no adapter ``adapter_name`` (names the ones it has); on every rank,
            nothing written.
        NotImplementedError: the tuner saves tensors that are not the model's own (prompt learning).
        OSError: the directory cannot be written (on every rank, nothing of the new adapter left).
        CheckpointLockedError: another writer is saving to ``path``, on every rank.

    Example:
        On every rank, after ``shard_model`` and training (the whole loop runs in docs/hf.md)::

            save_adapter(model, "out/adapter")   # adapter_model.safetensors, adapter_config.json

        A model without a PEFT adapter is refused before anything is written:

        >>> import tempfile, torch
        >>> save_adapter(torch.nn.Linear(2, 2), tempfile.mkdtemp())
        Traceback (most recent call last):
        TypeError: Linear has no PEFT adapter (no peft_config of PeftConfig objects): wrap it with peft.get_peft_model(model, config) before sharding
    """
    import sys

    from fsdptk import _peft
    from fsdptk._dist import is_rank0, run_agreed
    from fsdptk.checkpoint import _bucket, _write_streamed

    path = Path(path)
    bucket = _bucket(bucket_bytes)
    names = run_agreed(lambda: _peft.adapter_file_names(model, adapter_name))  # every rank alike
    sd = model.state_dict(keep_vars=True)
    items = [(key, sd[fqn]) for key, fqn in names.items()]
    out_name = {key: key for key, _ in items}
    dtypes = {key: t.dtype for key, t in items}

    def stage_config() -> _StagedConfig | None:
        return _stage_files(path, _peft.staged_adapter_config(model, adapter_name)) if is_rank0() else None

    return _write_streamed(path, items, out_name, dtypes, limit=sys.maxsize, bucket=bucket,
                           metadata=None, progress=progress, stage=stage_config,
                           prefix=ADAPTER_WEIGHTS.removesuffix(".safetensors"))


def load_adapter(
    model: nn.Module,
    path: PathLike,
    *,
    adapter_name: str = "default",
    strict: bool = True,
    shard_on_read: bool | None = None,
    bucket_bytes: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Load a PEFT adapter directory into the adapter ``adapter_name`` of a (sharded) PEFT model.

    The directory is one ``PeftModel.save_pretrained`` or :func:`save_adapter` wrote. Its keys are
    matched to the model's tensors by PEFT's own naming (``get_peft_model_state_dict``); each rank
    receives only the bytes of its own shards, read as :func:`fsdptk.load_safetensors` reads
    (every rank its own slices when it can see the file, else rank 0 reads and sends). Everything
    is checked on rank 0 from the file's header and ``adapter_config.json`` and agreed before any
    tensor moves: a failure is raised on every rank and the model is unchanged. The frozen base is
    not touched. Create the optimizer after this call (the adapter Parameters are replaced), then
    restore its state by FQN with :func:`fsdptk.load_from_full_optimizer_state_dict`.

    Args:
        model: a ``peft.PeftModel`` or a model with PEFT tuners injected (sharded or not; its
            adapters may still be on ``meta``).
        path: the adapter directory (``adapter_model.safetensors`` and ``adapter_config.json``).
        adapter_name: the model's adapter to load into.
        strict: raise when the file lacks one of the adapter's tensors or holds a key the adapter
            does not have, or when ``adapter_config.json`` disagrees with the adapter's config on
            ``peft_type``, ``r``, ``lora_alpha``, ``use_dora``, ``use_rslora``, ``bias`` or
            ``target_modules``.
        shard_on_read: as :func:`fsdptk.load_safetensors`.
        bucket_bytes: full-tensor bytes per scatter bucket (rank-0-read).
        progress: a tqdm bar of bytes read on rank 0 (``None``: only on a terminal).

    Returns:
        ``_IncompatibleKeys``: ``missing_keys`` (the adapter's model fqns the file lacks) and
        ``unexpected_keys`` (file keys the adapter does not have); empty with ``strict=True``.

    Raises:
        TypeError: ``model`` has no PEFT adapter; on every rank.
        KeyError: the model has no adapter ``adapter_name``; on every rank.
        FileNotFoundError: no ``adapter_model.safetensors`` (or ``adapter_config.json``) in
            ``path``; on every rank.
        ValueError: a tensor whose shape differs from the adapter's (key and both shapes, and the
            two ranks ``r``), or with ``strict`` a config that disagrees; on every rank, before the
            model changes.
        StateDictMismatchError: ``strict=True`` and keys missing or unexpected; on every rank,
            before the model changes.

    Example:
        Resuming, on every rank (the whole loop runs in docs/hf.md)::

            model = get_peft_model(meta_base, lora_config)
            shard_model(model, no_split_modules(model), cpu_offload=False)
            load_safetensors(model, base_dir, strict=True)   # the plain base checkpoint
            load_adapter(model, "out/adapter")
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            load_from_full_optimizer_state_dict(model, opt, osd, "cpu")

        >>> import tempfile, torch
        >>> load_adapter(torch.nn.Linear(2, 2), tempfile.mkdtemp())
        Traceback (most recent call last):
        TypeError: Linear has no PEFT adapter (no peft_config of PeftConfig objects): wrap it with peft.get_peft_model(model, config) before sharding
    """
    from fsdptk import _peft
    from fsdptk._compat import IncompatibleKeys
    from fsdptk._dist import all_gather_object, is_rank0, run_agreed
    from fsdptk.checkpoint import load_safetensors

    path = Path(path)
    names = run_agreed(lambda: _peft.adapter_file_names(model, adapter_name))
    config = _peft.require_adapter(model, adapter_name)
    shapes = {key: tuple(t.shape) for key, t in model.state_dict(keep_vars=True).items()}
    report = run_agreed(lambda: _peft.check_adapter_dir(
        path / ADAPTER_WEIGHTS, path / ADAPTER_CONFIG, names, shapes, config, adapter_name,
        strict=strict), on=is_rank0())
    missing, unexpected = all_gather_object(report)[0]  # rank 0's verdict, on every rank
    load_safetensors(model, path / ADAPTER_WEIGHTS, shard_on_read=shard_on_read,
                     rename=lambda key: names.get(key), strict=False, bucket_bytes=bucket_bytes,
                     progress=progress)
    return IncompatibleKeys(missing, unexpected)


from fsdptk._hf_tp import hf_tp_plan  # noqa: E402,F401  (the HF plan translation, re-exported)

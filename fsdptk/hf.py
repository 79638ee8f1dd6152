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
- :func:`hf_tp_plan` (defined in ``fsdptk._hf_tp``): the model's own tensor-parallel plan as
  DTensor ``ParallelStyle`` objects for :func:`fsdptk.apply_tp` (see docs/hf_2d.md).
- :func:`from_pretrained`: the one call for the common case, the composition of the above with
  :class:`fsdptk.ParallelDims`, :func:`fsdptk.apply_tp`, :func:`fsdptk.apply_activation_checkpointing`,
  :func:`fsdptk.shard_model` and :func:`fsdptk.load_safetensors`.

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
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdptk.mesh import ParallelDims

__all__ = ["from_pretrained", "hf_meta_model", "no_split_modules", "save_hf_config", "hf_config",
           "hf_tp_plan"]

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
        if hasattr(gen, "save_pretrained") and (can_generate is None or can_generate()):
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


# ----------------------------------------------------------------------------------------------
# from_pretrained: the composition of the public functions, for the common case
def _check_from_pretrained_args(dims: Any, dtype: Any, mp_policy: Any, activation_checkpointing: Any,
                                shard_on_read: Any, trust_remote_code: Any) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdptk.mesh import ParallelDims

    for name, value, kind, what in (
            ("dims", dims, ParallelDims, "a ParallelDims or None"),
            ("dtype", dtype, torch.dtype, "a torch.dtype or None"),
            ("mp_policy", mp_policy, MixedPrecisionPolicy, "a MixedPrecisionPolicy or None"),
            ("shard_on_read", shard_on_read, bool, "a bool or None")):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name} must be {what}, got {type(value).__name__} ({value!r})")
    for name, value in (("activation_checkpointing", activation_checkpointing),
                        ("trust_remote_code", trust_remote_code)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")


def _dims_for_world(dims: ParallelDims | None, world_size: int,
                    mp_policy: MixedPrecisionPolicy | None) -> ParallelDims:
    """``dims`` (default: FSDP over every rank), checked against the real world size."""
    from fsdptk._dist import has_process_group
    from fsdptk.mesh import ParallelDims

    dims = ParallelDims(world_size=world_size) if dims is None else dims
    if dims.world_size != world_size:
        raise ValueError(
            f"the process group has {world_size} ranks but dims are for world size "
            f"{dims.world_size} (dp_replicate={dims.dp_replicate}, dp_shard={dims.dp_shard}, "
            f"tp={dims.tp}): build ParallelDims with world_size=None (read from the process "
            "group) or degrees whose product is the world size")
    if not has_process_group() and mp_policy is not None:
        raise ValueError("mp_policy is FSDP's mixed precision and needs a process group "
                         "(torch.distributed.init_process_group): without one nothing is sharded")
    return dims


def _meta_model_on_every_rank(directory: Path, dims: ParallelDims | None, dtype: torch.dtype | None,
                              mp_policy: MixedPrecisionPolicy | None, check_args: Any,
                              trust_remote_code: bool) -> tuple[nn.Module, ParallelDims]:
    """The model on ``meta`` and the checked dims on every rank, or one error on every rank.

    ``check_args()`` validates the arguments first. Rank 0 reads the directory's config (so it must see the directory); so does every other rank
    that sees ``config.json``. Their outcomes are agreed in one exchange; when some rank does not
    see the directory (files on rank 0's host only), rank 0's config is sent to it.
    """
    from fsdptk._dist import all_gather_object, error_payload, raise_lowest, world

    world_size, rank = world()
    model, error = None, None
    try:
        check_args()
        dims = _dims_for_world(dims, world_size, mp_policy)
        if rank == 0 or (directory / "config.json").is_file():
            if not directory.is_dir():
                raise FileNotFoundError(f"{str(directory)!r} is not a directory: from_pretrained "
                                        "takes a checkpoint directory (config.json + safetensors)")
            model = hf_meta_model(directory, dtype=dtype, trust_remote_code=trust_remote_code)
            _read_generation_config(model, directory)
            no_split_modules(model)  # a model without units fails here, before any mesh
    except Exception as e:  # noqa: BLE001 - agreed just below
        error = e
    views = all_gather_object((error_payload(error), model is not None))
    raise_lowest([payload for payload, _ in views], error)
    blind = [r for r, (_, seen) in enumerate(views) if not seen]
    if blind:
        if trust_remote_code:  # the model's code is in the directory: every rank needs it
            raise FileNotFoundError(
                f"trust_remote_code=True needs the checkpoint directory on every rank; ranks "
                f"{blind} do not see {str(directory / 'config.json')!r}")
        sent = all_gather_object((model.config, model.generation_config) if rank == 0 else None)[0]
        if model is None:
            model = hf_meta_model(sent[0], dtype=dtype)
            model.generation_config = sent[1]
    return model, dims


def _read_generation_config(model: nn.Module, directory: Path) -> None:
    """``generation_config.json`` onto the model, as transformers' ``from_pretrained`` does."""
    if not (directory / "generation_config.json").is_file():
        return
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate():
        model.generation_config = _transformers().GenerationConfig.from_pretrained(
            str(directory), local_files_only=True)


def from_pretrained(
    path: PathLike,
    *,
    dims: ParallelDims | None = None,
    dtype: torch.dtype | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_checkpointing: bool = False,
    device: torch.device | str | None = None,
    shard_on_read: bool | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a Hugging Face checkpoint directory straight into an FSDP2 (and TP) model.

    The one call for the common case. It is exactly this composition of fsdptk's public
    functions, in this order (write it out yourself to change any step)::

        dims = dims or ParallelDims()                          # FSDP over the whole world
        model = hf_meta_model(path, dtype=dtype)               # config.json -> model on meta
        mesh = dims.build_mesh(device.type)
        if dims.tp > 1:                                        # TP first: FSDP shards TP's DTensors
            apply_tp(model, dims.tp_mesh, hf_tp_plan(model))   # the model's own plan
        if activation_checkpointing:                           # AC before FSDP
            apply_activation_checkpointing(model, no_split_modules(model))
        shard_model(model, no_split_modules(model), cpu_offload=False,
                    dp_mesh=dims.fsdp_mesh, mp_policy=mp_policy)   # HSDP when dp_replicate > 1
        load_safetensors(model, path, device=device, shard_on_read=shard_on_read, strict=True)
        model.eval()                                           # as transformers returns it

    ``load_safetensors`` also recomputes the non-persistent buffers (rotary tables) that the meta
    build left on ``meta``. Collective: call it on every rank with the same arguments.

    Failures are agreed: a directory without ``config.json`` (rank 0 must see it), dims whose
    product is not the world size, a TP size the attention heads do not divide, a model without a
    TP plan or without ``_no_split_modules`` raise the same error on every rank (the failing
    rank's exception, ``(on rank N)`` elsewhere) before any mesh is built (the config checks) or
    before any weight is read (the TP and sharding checks). Reading the weights then has
    ``load_safetensors``' own failure model (every rank raises a read error of any rank).

    Without a process group (one process) nothing is sharded: the model is built on ``meta`` and
    loaded whole, so the same script runs unchanged under ``python`` and ``torchrun``.

    Args:
        path: a checkpoint directory: ``config.json`` and ``model.safetensors`` (or shards and
            ``model.safetensors.index.json``), e.g. a ``save_pretrained`` or ``save_safetensors``
            directory or an HF-cache snapshot. Rank 0 must see it; a rank that does not (files on
            rank 0's host only) gets rank 0's config and its weights from rank 0.
        dims: the parallel degrees (``ParallelDims(dp_replicate=..., dp_shard=..., tp=...)``);
            ``None``: FSDP over every rank. Keep your own to read ``dims.dp_rank`` for the batch.
        dtype: the parameters' dtype (default: the config's ``dtype``, else float32); the file's
            values are cast to it.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for every unit (``None``: full precision).
        activation_checkpointing: recompute each ``_no_split_modules`` block (decoder layer) in
            backward.
        device: where the shards live (default: the current accelerator, else CPU); the mesh is
            built for its type. On GPUs set the current device of each rank first.
        shard_on_read: ``True``: every rank reads only its own slices of the files; ``False``:
            rank 0 reads and sends each rank its bytes; ``None`` (default): ``True`` when every
            rank can open the files, else rank 0 reads (see :func:`fsdptk.load_safetensors`).
        trust_remote_code: allow a model defined by code in the directory (every rank must then
            see the directory).

    Returns:
        nn.Module: the sharded model in eval mode (call ``model.train()`` to train), every
        parameter a DTensor over ``dims``' mesh, ``model.config`` and ``model.generation_config``
        as the directory has them; :func:`fsdptk.save_safetensors` saves it back as a directory
        this function (and transformers' ``from_pretrained``) loads.

    Raises:
        FileNotFoundError: no directory or no ``config.json`` on rank 0, or a missing weight file.
        ValueError: dims that do not match the world size, heads the TP size does not divide, a
            model without a TP plan (``tp > 1``) or without ``_no_split_modules``, an unknown
            ``model_type``; ``mp_policy`` without a process group.
        StateDictMismatchError: the files' keys are not the model's (strict load).
        TypeError: an argument of the wrong type.

    Example:
        >>> import tempfile, torch
        >>> from transformers import AutoModelForCausalLM, LlamaConfig
        >>> from fsdptk.hf import from_pretrained
        >>> ckpt = tempfile.mkdtemp()
        >>> AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        ...     vocab_size=256)).save_pretrained(ckpt)
        >>> model = from_pretrained(ckpt)  # under torchrun: sharded over every rank
        >>> type(model).__name__, model.training
        ('LlamaForCausalLM', False)
        >>> model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape
        torch.Size([1, 3, 256])
    """
    from fsdptk._checkpoint_common import infer_device
    from fsdptk._dist import agreed, has_process_group
    from fsdptk.activation import apply_activation_checkpointing
    from fsdptk.checkpoint import load_safetensors
    from fsdptk.sharding import shard_model
    from fsdptk.tp import apply_tp

    directory = Path(path)
    model, dims = _meta_model_on_every_rank(
        directory, dims, dtype, mp_policy,
        lambda: _check_from_pretrained_args(dims, dtype, mp_policy, activation_checkpointing,
                                            shard_on_read, trust_remote_code),
        trust_remote_code)
    device = infer_device(model) if device is None else torch.device(device)
    units = no_split_modules(model)
    if has_process_group():
        dims.build_mesh(device.type)
    with agreed():  # every check of TP, AC and FSDP runs before any weight is read
        if dims.tp_enabled:
            apply_tp(model, dims.tp_mesh, hf_tp_plan(model))
        if activation_checkpointing:
            apply_activation_checkpointing(model, units)
        if has_process_group():
            shard_model(model, units, cpu_offload=False, dp_mesh=dims.fsdp_mesh,
                        mp_policy=mp_policy)
    load_safetensors(model, directory, device=device, shard_on_read=shard_on_read, strict=True)
    model.eval()
    return model


from fsdptk._hf_tp import hf_tp_plan  # noqa: E402,F401  (the HF plan translation, re-exported)

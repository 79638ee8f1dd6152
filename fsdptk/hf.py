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
- :func:`hf_tp_plan`: the model's own tensor-parallel plan as
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

import contextlib
import copy
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from fsdptk._core.compat import IncompatibleKeys
from fsdptk._files.hf_config import StagedConfig, hf_config, stage_files, stage_hf_config
from fsdptk.predicates import no_split_modules

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import ParallelStyle

    from fsdptk.mesh import ParallelDims

__all__ = ["from_pretrained", "hf_meta_model", "no_split_modules", "save_hf_config", "hf_config",
           "hf_tp_plan", "save_adapter", "load_adapter"]

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

    Example:
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

    On a PEFT model (LoRA), the base model's plan goes to each LoRA layer's ``base_layer`` and the
    adapters get the styles that keep ``W x + s B (A x)`` exact: ``lora_B`` the colwise style of a
    colwise base (``lora_A`` whole on every TP rank), ``lora_A`` the rowwise style of a rowwise
    base (``lora_B`` whole). DoRA / other LoRA variants, other tuners and ``sequence_parallel``
    are refused (docs/hf_2d.md, "LoRA adapters").

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
            around its blocks; on a PEFT model, if a planned layer's tuner is not plain LoRA on
            ``nn.Linear`` (DoRA included) or ``sequence_parallel`` is asked.

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


# ----------------------------------------------------------------------------------------------
# from_pretrained: the composition of the public functions, for the common case
class _DirectoryView(NamedTuple):
    """What each rank tells the others about the checkpoint directory (one object exchange)."""

    error: Any  # error_payload(...) of this rank's argument or config failure, or None
    sees_config: bool  # this rank read config.json itself


class _SentConfig(NamedTuple):
    """Rank 0's configs, sent to the ranks that do not see the directory."""

    config: Any  # transformers.PretrainedConfig
    generation_config: Any  # transformers.GenerationConfig | None


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
    from fsdptk._core.dist import has_process_group
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
    from fsdptk._core.dist import all_gather_object, error_payload, raise_lowest, world

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
    views = all_gather_object(_DirectoryView(error=error_payload(error), sees_config=model is not None))
    raise_lowest([v.error for v in views], error)
    blind = [r for r, v in enumerate(views) if not v.sees_config]
    if blind:
        if trust_remote_code:  # the model's code is in the directory: every rank needs it
            raise FileNotFoundError(
                f"trust_remote_code=True needs the checkpoint directory on every rank; ranks "
                f"{blind} do not see {str(directory / 'config.json')!r}")
        mine = (_SentConfig(config=model.config, generation_config=model.generation_config)
                if rank == 0 and model is not None else None)
        sent = all_gather_object(mine)[0]
        assert sent is not None, "rank 0 read the config (agreed above)"
        if model is None:
            model = hf_meta_model(sent.config, dtype=dtype)
            model.generation_config = sent.generation_config
    assert model is not None and dims is not None, "agreed above: every rank has a model and dims"
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

    Python's cyclic garbage collector is paused for the call and restored as it was (on errors
    too): building the model creates hundreds of thousands of objects, none of them garbage, and
    the collector's passes over them took about 1 s of a 4 GB load on 4 ranks.

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
    with _gc_paused():
        return _from_pretrained(Path(path), dims, dtype, mp_policy, activation_checkpointing, device,
                                shard_on_read, trust_remote_code)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block (restored as it was, on errors too).

    Building a transformers model imports its modules and creates hundreds of thousands of
    objects; the collector then runs hundreds of times over them while nothing they hold is
    garbage (measured: 2.5 s of collections in one 4 GB load on 4 ranks). Reference counting still
    frees everything; cycles made during the call are collected by the next collection after it.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _from_pretrained(directory: Path, dims: ParallelDims | None, dtype: torch.dtype | None,
                     mp_policy: MixedPrecisionPolicy | None, activation_checkpointing: bool,
                     device: torch.device | str | None, shard_on_read: bool | None,
                     trust_remote_code: bool) -> nn.Module:
    """:func:`from_pretrained`'s composition (the collector already paused)."""
    from fsdptk._core.dist import agreed, has_process_group
    from fsdptk._files.common import infer_device
    from fsdptk.activation import apply_activation_checkpointing
    from fsdptk.checkpoint import load_safetensors
    from fsdptk.sharding import shard_model
    from fsdptk.tp import apply_tp

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

    from fsdptk._core.dist import is_rank0, run_agreed
    from fsdptk._files.save import write_streamed
    from fsdptk._plans import peft as _peft

    path = Path(path)
    names = run_agreed(lambda: _peft.adapter_file_names(model, adapter_name))  # every rank alike
    sd = model.state_dict(keep_vars=True)
    items = [(key, sd[fqn]) for key, fqn in names.items()]
    out_name = {key: key for key, _ in items}
    dtypes = {key: t.dtype for key, t in items}

    def stage_config() -> StagedConfig | None:
        return stage_files(path, _peft.staged_adapter_config(model, adapter_name)) if is_rank0() else None

    return write_streamed(path, items, out_name, dtypes, limit=sys.maxsize, bucket_bytes=bucket_bytes,
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
) -> IncompatibleKeys:
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
    from fsdptk._core.dist import all_gather_object, is_rank0, run_agreed
    from fsdptk._plans import peft as _peft
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


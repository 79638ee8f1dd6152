"""PEFT adapters (LoRA, DoRA, ...) of a sharded model, in PEFT's own format:
``fsdptk.hf.save_adapter`` and ``fsdptk.hf.load_adapter`` (docs/hf.md)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from fsdptk._core.compat import IncompatibleKeys
from fsdptk._files.hf_config import StagedConfig, stage_files

__all__ = ["save_adapter", "load_adapter", "init_adapters", "ADAPTER_WEIGHTS", "ADAPTER_CONFIG"]

PathLike = str | os.PathLike[str]


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
        ValueError: the ranks passed different ``adapter_name`` or ``bucket_bytes`` (names each
            and every rank's value); on every rank, nothing written.
        TypeError: ``model`` has no PEFT adapter; on every rank, nothing written.
        KeyError: the model has no adapter ``adapter_name`` (names the ones it has); on every rank,
            nothing written.
        NotImplementedError: the tuner saves tensors that are not the model's own (prompt learning).
        OSError: the directory cannot be written (on every rank, nothing of the new adapter left).
        CheckpointLockedError: another writer is saving to ``path``, on every rank.

    Examples:
        On every rank, after ``shard_model`` and training (the whole loop runs in docs/hf.md)::

            save_adapter(model, "out/adapter")   # adapter_model.safetensors, adapter_config.json

        A model without a PEFT adapter is refused before anything is written:

        >>> import tempfile, torch
        >>> save_adapter(torch.nn.Linear(2, 2), tempfile.mkdtemp())
        Traceback (most recent call last):
        TypeError: Linear has no PEFT adapter (no peft_config of PeftConfig objects): wrap it with peft.get_peft_model(model, config) before sharding
    """
    import sys

    from fsdptk._core.arguments import agree_arguments
    from fsdptk._core.dist import is_rank0, run_agreed
    from fsdptk._files.save import write_streamed
    from fsdptk._plans import peft as _peft
    from fsdptk._plans.hub_items import adapter_items

    agree_arguments("save_adapter", adapter_name=adapter_name, bucket_bytes=bucket_bytes)
    path = Path(path)
    items, out_name, dtypes = run_agreed(lambda: adapter_items(model, adapter_name))  # every rank alike

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
        ValueError: the ranks passed different ``adapter_name``, ``strict``, ``shard_on_read`` or
            ``bucket_bytes`` (names each and every rank's value, before anything is read); a
            tensor whose shape differs from the adapter's (key and both shapes, and the two ranks
            ``r``), or with ``strict`` a config that disagrees; on every rank, before the model
            changes.
        StateDictMismatchError: ``strict=True`` and keys missing or unexpected; on every rank,
            before the model changes.

    Examples:
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
    from fsdptk._core.arguments import agree_arguments
    from fsdptk._core.dist import all_gather_object, is_rank0, run_agreed
    from fsdptk._plans import peft as _peft
    from fsdptk.checkpoint import load_safetensors

    agree_arguments("load_adapter", adapter_name=adapter_name, strict=strict, shard_on_read=shard_on_read,
                    bucket_bytes=bucket_bytes)
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


def init_adapters(
    model: nn.Module,
    *,
    seed: int = 0,
    adapter_name: str | None = None,
    device: torch.device | str | None = None,
    bucket_bytes: int | None = None,
) -> list[str]:
    """Initialise fresh PEFT LoRA adapters of a (sharded) model: PEFT's own init, the same on every rank.

    The usual start of a fine-tune, with no adapter file: build the base on ``meta``, wrap it with
    ``peft.get_peft_model``, ``shard_model``, load the base checkpoint, then call this on every
    rank. Rank 0 builds each adapter tensor on CPU at its full shape with PEFT's own
    initialisation (the layer's ``nn.Linear`` constructors and ``reset_lora_parameters``, in the
    order ``get_peft_model`` creates them) from the CPU generator seeded with ``seed`` (as
    ``torch.manual_seed(seed)`` seeds it) inside ``torch.random.fork_rng``, so the values are those
    ``get_peft_model`` gives in one process after ``torch.manual_seed(seed)``, and neither any rank's
    RNG state nor its seed matters. No rank's RNG state changes: the CPU generator's is put back
    after, and no CUDA (or other device) generator is seeded or drawn from. One load
    (:func:`fsdptk.load_from_full_model_state_dict` with ``broadcast_from_rank0=True``, restricted
    to the adapter keys) then gives each rank the bytes of its shards. Each adapter tensor is
    sharded like the other parameters of its FSDP unit (``Shard(0)`` over the unit's mesh,
    replicated over ``dp_replicate`` under HSDP) and FSDP reduces its gradient with the unit's; the
    frozen base is not touched. Create the optimizer after this call (the adapter Parameters are
    replaced).

    The other order, ``shard_model``, base load, then ``get_peft_model`` (PEFT attached to the
    sharded model), works before the model's first forward. PEFT alone leaves plain per-rank
    Parameters there that no FSDP unit manages (and, on a mesh whose dims are not named ``fsdp``,
    sized from the local shard). The rule for such a LoRA layer on an ``nn.Linear``: its
    ``lora_A`` / ``lora_B`` are replaced by ``nn.Linear`` at the full shapes (``(r, in_features)``,
    ``(out_features, r)`` of the base layer's full weight) and each is ``fully_shard``-ed as an FSDP
    unit of its own with the mesh, mixed-precision and offload policies of the unit holding the
    base layer (``Shard(0)``, ``Replicate()`` over ``dp_replicate`` under HSDP; gradients reduced as
    that unit's), then initialised and loaded as above. Refused there: a model that already ran a
    forward (FSDP2 collected its units at the root's first forward), LoRA on parameters
    (``target_parameters``), a non-``nn.Linear`` or tensor-parallel base layer.

    Args:
        model: a ``peft.PeftModel`` (or a model with PEFT tuners injected), its adapters on
            ``meta`` or holding values (they are overwritten).
        seed: the seed PEFT's initialisation is replayed from.
        adapter_name: the one adapter to initialise (``None``: every adapter, in ``peft_config``
            order, as consecutive ``get_peft_model`` / ``add_adapter`` calls draw them).
        device: where the shards go (``None``: the device of the model's first parameter not on
            ``meta``, else CPU).
        bucket_bytes: full-tensor bytes per scatter bucket.

    Returns:
        list[str]: the model FQNs of the tensors initialised, in PEFT's creation order.

    Raises:
        ValueError: the ranks passed different ``seed``, ``adapter_name`` or ``bucket_bytes``;
            adapters attached after ``shard_model`` to a model that already ran a forward, or whose
            base layer no FSDP unit manages (names the key and its shape). On every rank, before
            the model changes.
        TypeError: ``model`` has no PEFT adapter; on every rank.
        KeyError: no adapter ``adapter_name``; on every rank.
        NotImplementedError: an adapter PEFT initialises from the base weights (DoRA, PiSSA,
            OLoRA, LoftQ, ...) or that is not a LoRA factor of ``nn.Linear`` form (embedding LoRA,
            other tuners); adapters attached after ``shard_model`` on parameters
            (``target_parameters``), on a non-``nn.Linear`` or a tensor-parallel base layer; named,
            on every rank, before the model changes.

    Examples:
        On every rank (the whole loop runs in docs/hf.md, "Fresh adapters")::

            with torch.device("meta"):
                base = AutoModelForCausalLM.from_config(config)
            model = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
            shard_model(model, no_split_modules(model), cpu_offload=False)
            load_safetensors(model, base_dir, strict=True)
            init_adapters(model, seed=0)     # the adapters get_peft_model gives after manual_seed(0)

        Or PEFT after sharding, before the first forward (the same values)::

            shard_model(base, no_split_modules(base), cpu_offload=False)
            load_safetensors(base, base_dir, strict=True)
            model = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
            init_adapters(model, seed=0)     # each factor an FSDP unit at its full shape

        >>> import torch
        >>> init_adapters(torch.nn.Linear(2, 2))
        Traceback (most recent call last):
        TypeError: Linear has no PEFT adapter (no peft_config of PeftConfig objects): wrap it with peft.get_peft_model(model, config) before sharding
    """
    from fsdptk._core.arguments import agree_arguments
    from fsdptk._core.dist import is_rank0, run_agreed, world
    from fsdptk._plans import peft as _peft
    from fsdptk._plans.peft_fresh import (
        attach_plan,
        attach_units,
        fresh_adapter_plan,
        fresh_adapter_state,
        fresh_keys,
    )
    from fsdptk.state_dict import load_from_full_model_state_dict

    agree_arguments("init_adapters", seed=seed, adapter_name=adapter_name, bucket_bytes=bucket_bytes)

    def plan_it() -> tuple[list, list]:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        configs = _peft.peft_configs(model) if isinstance(model, nn.Module) else None
        names = [adapter_name] if adapter_name is not None else list(configs) if configs else ["default"]
        plan = fresh_adapter_plan(model, names)
        return plan, attach_plan(model, plan)

    plan, attach = run_agreed(plan_it)  # every rank checks the same model alike
    attach_units(attach)  # adapters attached after shard_model: FSDP units at their full shapes
    distributed = world()[0] > 1
    full_sd = fresh_adapter_state(plan, seed) if is_rank0() or not distributed else {}
    load_from_full_model_state_dict(model, full_sd, _device(model) if device is None else device,
                                    strict=False, broadcast_from_rank0=distributed,
                                    bucket_bytes=bucket_bytes)
    return fresh_keys(plan)


def _device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter not on ``meta`` (its local shard's), else CPU."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not local.is_meta:
            return local.device
    return torch.device("cpu")

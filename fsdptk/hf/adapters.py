"""PEFT adapters (LoRA, DoRA, ...) of a sharded model, in PEFT's own format:
``fsdptk.hf.save_adapter`` and ``fsdptk.hf.load_adapter`` (docs/hf.md)."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from fsdptk._core.compat import IncompatibleKeys
from fsdptk._files.hf_config import StagedConfig, stage_files

__all__ = ["save_adapter", "load_adapter", "ADAPTER_WEIGHTS", "ADAPTER_CONFIG"]

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

    agree_arguments("save_adapter", adapter_name=adapter_name, bucket_bytes=bucket_bytes)
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

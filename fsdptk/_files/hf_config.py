"""A Hugging Face model's config files, staged beside a checkpoint and renamed in after its weights.

``save_safetensors`` and :func:`fsdptk.hf.save_hf_config` write ``config.json`` (and
``generation_config.json``) as ``save_pretrained`` does, from a copy of the model's config, under a
hidden directory inside the target that is renamed into place once the weights are committed. Only
the config objects are touched here (their own ``save_pretrained``); transformers is not imported.
"""

from __future__ import annotations

import copy
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["StagedConfig", "hf_config", "stage_files", "stage_hf_config"]

PathLike = str | os.PathLike[str]


def hf_config(model: nn.Module) -> Any | None:
    """The Hugging Face config a model carries, or ``None``.

    Args:
        model: any module (sharded or not).

    Returns:
        The object at ``model.config`` when it can be saved as an HF config (it has
        ``save_pretrained`` or ``to_json_file``), else ``None``.

    Examples:
        >>> import torch
        >>> from fsdptk.hf import hf_config
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


class StagedConfig:
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


def stage_files(directory: PathLike, write: Callable[[Path], None]) -> StagedConfig:
    """Run ``write(stage)`` into a new hidden directory inside ``directory`` (created if needed);
    the files it writes are renamed into ``directory`` by :meth:`StagedConfig.commit`. A failing
    ``write`` leaves nothing behind.

    Examples:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> staged = stage_files(d, lambda stage: (stage / "a.json").write_text("{}"))
        >>> [p.name for p in staged.commit()], sorted(p.name for p in d.iterdir())
        (['a.json'], ['a.json'])
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stage = directory / f".hf-config.{uuid.uuid4().hex[:8]}.tmp"
    stage.mkdir()
    try:
        write(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return StagedConfig(directory, stage)


def _write_hf_config(model: nn.Module, config: Any, stage: Path, dtype: torch.dtype | None,
                     quantization_config: Mapping[str, Any] | None = None) -> None:
    """Write ``config.json`` (and ``generation_config.json``) of ``model`` into ``stage``."""
    config = copy.deepcopy(config)
    dtype = dtype or _model_dtype(model)
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    arch = _architecture(model)
    if arch is not None:
        config.architectures = [arch]
    if getattr(config, "quantization_config", None) is not None and getattr(model, "hf_quantizer", None) is None:
        # a quantized release loaded dequantized (fsdptk reads FP8 / MXFP4 into the model's
        # dtype): the weights written are unquantized, so the config must not say otherwise
        del config.quantization_config
    if quantization_config is not None:  # a quantized save: the release's own config
        config.quantization_config = dict(quantization_config)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(stage)
    else:
        config.to_json_file(str(stage / "config.json"))
    gen: Any = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if gen is not None and hasattr(gen, "save_pretrained") and (can_generate is None or can_generate()):
        gen.save_pretrained(stage)


def stage_hf_config(model: nn.Module, directory: PathLike, *, dtype: torch.dtype | None = None,
                    quantization_config: Mapping[str, Any] | None = None) -> StagedConfig | None:
    """Write the model's HF config files to a hidden directory inside ``directory``.

    The files are what ``save_pretrained`` writes, from a copy of the config (the model's own is not
    modified): ``config.json`` with ``dtype`` (``dtype`` or the model's) and ``architectures`` set,
    and ``generation_config.json`` when the model can generate and has a generation config. A
    ``quantization_config`` is dropped when the model holds unquantized weights (a quantized
    release read dequantized): the files saved beside it are unquantized.

    Args:
        model: the model (sharded or not).
        directory: the checkpoint directory (created if needed).
        dtype: the floating dtype of the saved weights (default: the model's).
        quantization_config: the ``quantization_config`` of a quantized save (written into
            ``config.json`` in place of any the model's config carries), or ``None``.

    Returns:
        StagedConfig | None: the staged files, ``None`` when the model carries no HF config.

    Raises:
        ValueError: transformers refuses the config (e.g. its own save-time validation).
        OSError: the directory cannot be created or written.
    """
    config = hf_config(model)
    if config is None:
        return None
    return stage_files(directory, lambda stage: _write_hf_config(model, config, stage, dtype, quantization_config))

"""Checkpoint files: Hugging Face safetensors in and out of a sharded (or plain) model, and DCP.

- :func:`load_safetensors`: a checkpoint directory (``model.safetensors``, or shards plus
  ``model.safetensors.index.json``) into a model. Shard-on-read when every rank can see the files
  (each rank reads only the slices of its own shards; no collective moves tensor data), rank-0-read
  otherwise (rank 0 reads, the engine scatters each rank its bytes in buckets).
- :func:`save_safetensors`: gathers the model bucket by bucket to rank 0, which writes every tensor
  straight to its place in its shard file, so rank 0 holds at most one bucket beyond its own shards.
  Atomic (see :mod:`fsdptk._files.safetensors_writer`); tied weights stored once by default (HF).
- :class:`SafetensorsCheckpoint`: the lazy read-only Mapping underneath (``full_sd`` for
  ``load_from_full_model_state_dict``).
- DCP for resuming and offline converters: :mod:`fsdptk.dcp` (re-exported here).

Every check that can fail on one rank (a file it cannot see, a directory rank 0 cannot write, a
rename collision) is agreed before any tensor moves, so all ranks raise the same error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from fsdptk._core.arguments import ArgumentsView, agree_arguments, arguments_view, check_arguments
from fsdptk._core.compat import IncompatibleKeys as _IncompatibleKeys
from fsdptk._core.dist import all_gather_object, error_payload, is_rank0, raise_if_any, raise_lowest, run_agreed
from fsdptk._files.common import Rename, infer_device, progress_bar
from fsdptk._files.hf_config import stage_hf_config
from fsdptk._files.pending import wait_for_pending
from fsdptk._files.safetensors_io import (
    SafetensorsCheckpoint,
    parse_size,
)
from fsdptk._files.save import plan_save, write_save
from fsdptk._plans.hub_items import quantized_layout, save_items
from fsdptk.conversions import ConversionArg
from fsdptk.dcp import (
    dcp_to_safetensors,
    load_dcp,
    safetensors_to_dcp,
    save_dcp,
)

__all__ = [
    "SafetensorsCheckpoint",
    "load_safetensors",
    "save_safetensors",
    "save_dcp",
    "load_dcp",
    "dcp_to_safetensors",
    "safetensors_to_dcp",
    "parse_size",
]

PathLike = str | os.PathLike[str]


# ----------------------------------------------------------------------------------------------
# loading
class _OpenView(NamedTuple):
    """What each rank tells the others as a load opens its checkpoint (the call's first exchange)."""

    arguments: ArgumentsView  # the call's arguments that change the exchange, agreed first
    error: Any  # error_payload of this rank's bad argument, or None
    readable: bool  # this rank opened the checkpoint


def _open_agreed(path: Path, shard_on_read: bool | None, arguments: ArgumentsView
                 ) -> tuple[SafetensorsCheckpoint | None, bool]:
    """Open the checkpoint where it will be read; agree on the arguments, the mode and errors.

    One object exchange: every rank's ``arguments`` (ranks that differ raise one ValueError on
    every rank, naming them), a bad ``shard_on_read``, and whether it could open the files.
    ``None`` (auto) means shard-on-read when every rank can open the files (headers checked), else
    rank-0-read when rank 0 can; an error is raised on every rank only when rank 0 cannot read it
    or an explicit ``shard_on_read=True`` rank cannot. Waits first for a background save to
    ``path`` still in flight in this process.
    """
    wait_for_pending(path)
    rank0 = is_rank0()
    ckpt, error, bad = None, None, None
    if shard_on_read is not None and not isinstance(shard_on_read, bool):
        bad = TypeError(f"shard_on_read must be a bool or None, got {shard_on_read!r}")
    elif shard_on_read is not False or rank0:
        try:
            ckpt = SafetensorsCheckpoint(path)
        except Exception as e:  # noqa: BLE001 - agreed below
            error = e
    views = all_gather_object(_OpenView(arguments=arguments, error=error_payload(bad), readable=ckpt is not None))
    try:
        check_arguments([v.arguments for v in views])
        raise_lowest([v.error for v in views], bad)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    if shard_on_read is None:
        shard_on_read = all(v.readable for v in views)
        if not shard_on_read and views[0].readable:  # rank 0 reads and scatters; the others need nothing
            if not rank0 and ckpt is not None:
                ckpt.close()
            return (ckpt if rank0 else None), False
    raise_if_any(error)
    return ckpt, shard_on_read


def load_safetensors(
    model: nn.Module,
    path: PathLike,
    *,
    device: torch.device | str | None = None,
    shard_on_read: bool | None = None,
    rename: Rename = None,
    strict: bool = True,
    cpu_offload: bool = False,
    bucket_bytes: int | None = None,
    progress: bool | None = None,
    init_buffers: Callable[[nn.Module], None] | None = None,
    conversion: ConversionArg = "auto",
) -> _IncompatibleKeys:
    """Load a safetensors checkpoint (HF layout) into a sharded or plain model.

    Call it on every rank after ``shard_model`` (the model may still be on ``meta``). Keys,
    shapes and dtypes are agreed on every rank before any data moves; values are cast to the
    model's dtypes; tied parameters stored once (HF convention, under any of their names) are
    loaded from that key and stay one Parameter.

    Args:
        model: the model (FSDP2-sharded, tensor-parallel, or plain).
        path: a ``.safetensors`` file, an index file, or a directory (see
            :class:`SafetensorsCheckpoint`).
        device: where the shards go (default: the model's device, or the current accelerator / CPU
            for a meta model).
        shard_on_read: ``True``: every rank opens the files and reads only its own slices (no
            collective for tensor data; a shard that is a contiguous range of its file in the
            model's dtype stays a copy-on-write view of the privately mapped file, read when
            first used, as transformers keeps its weights: docs/checkpoint.md names what a later
            in-place rewrite of the file does); ``False``: rank 0 reads and scatters each rank
            its bytes into fresh memory;
            ``None`` (default): ``True`` when every rank can open the files (their headers are
            checked on every rank), else rank-0-read; agreed across ranks.
        rename: checkpoint name -> model name: a callable (returning ``None`` skips the key) or a
            Mapping (unmentioned keys keep their name). Two keys renamed to one name is an error.
        strict: raise when keys are missing or unexpected (as ``load_state_dict``; the default,
            as for every fsdptk function that loads files). ``False``: load the keys both sides
            have and return the others.
        cpu_offload: keep the loaded shards on CPU (FSDP2 CPU offload).
        bucket_bytes: full-tensor bytes per scatter bucket for rank-0-read (default: the engine's,
            16 MiB); bounds rank 0's memory beyond its shards.
        progress: a tqdm bar of checkpoint bytes on rank 0 (``None``: only on a terminal).
        init_buffers: ``fn(module)`` computing the non-persistent buffers (in no checkpoint) of a
            module that has some on ``meta``, overriding the automatic rules (Hugging Face's init
            path, torchtune's ``rope_init``, ``reset_parameters``, :func:`fsdptk.register_buffer_init`);
            as in :func:`fsdptk.load_from_full_model_state_dict`.
        conversion: how the checkpoint's tensors become the model's (docs/layouts.md):
            ``"auto"`` (default) reads a transformers model's checkpoint in the layout the Hub
            ships (per-expert MoE tensors into fused experts, renamed keys) through transformers'
            own conversion rules for that model, planned per shard (each rank reads only the
            per-expert tensors and slices its shards cover); other models read keys as they are.
            A :class:`fsdptk.conversions.Conversion` declares the rules for any model; ``None``
            reads keys as they are. Ignored when ``rename`` is given.

    Returns:
        torch.nn.modules.module._IncompatibleKeys: ``missing_keys`` and ``unexpected_keys`` in
        model names (as ``load_from_full_model_state_dict``; both empty with ``strict=True``).

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (or a shard missing), on every rank.
        CheckpointError: a corrupt/truncated file, an index naming a key its file lacks, on every
            rank.
        ConversionError: (a ``ValueError``) checkpoint tensors the conversion cannot combine: a
            missing per-expert tensor (named), tensors that do not stack (both shapes), two keys
            for one model key; a transformers operation without a per-shard plan (named, with the
            keys); a ``Transform`` whose output breaks its declaration (the model key and both
            shapes); a bad quantized layout (``weight_block_size``, scale rank, grid or dtype,
            MXFP4 pairs); on every rank, before the model changes.
        ValueError: the ranks passed different ``shard_on_read``, ``conversion``, ``rename``,
            ``strict`` or ``bucket_bytes`` (names each and every rank's value; in the call's first
            exchange, before anything is read); a rename collision, a shape mismatch,
            ``bucket_bytes`` not a positive int; non-persistent buffers on ``meta`` that no rule can
            compute (names them and the remedies), on every rank.
        StateDictMismatchError: ``strict=True`` (the default) with missing or unexpected keys (a
            ``RuntimeError`` with torch's message, carrying ``missing_keys`` and
            ``unexpected_keys``), on every rank before the model changes.
        TypeError: ``shard_on_read`` is not a bool or None, on every rank.

    Examples:
        >>> import tempfile, torch
        >>> from fsdptk import save_safetensors, load_safetensors
        >>> d = tempfile.mkdtemp()
        >>> src = torch.nn.Linear(4, 2)
        >>> _ = save_safetensors(src, d)
        >>> dst = torch.nn.Linear(4, 2)
        >>> load_safetensors(dst, d)
        <All keys matched successfully>
        >>> torch.equal(dst.weight, src.weight)
        True
    """
    from fsdptk.state_dict import FileView, load_state

    path = Path(path)
    arguments = arguments_view("load_safetensors", shard_on_read=shard_on_read, conversion=conversion,
                               rename=rename, strict=strict, bucket_bytes=bucket_bytes)
    ckpt, shard_on_read = _open_agreed(path, shard_on_read, arguments)
    try:
        # the file's view (rename or conversion) is composed with the load's others in one place
        # (fsdptk._plans.load_view), inside the load's pre-flight: its errors travel with the
        # engine's one metadata exchange
        with progress_bar(0, f"load {path.name}", progress) as bar:
            return load_state(
                model, ckpt if ckpt is not None else {}, infer_device(model) if device is None else torch.device(device),
                strict=strict, cpu_offload=cpu_offload, release_sd=False, broadcast_from_rank0=not shard_on_read,
                bucket_bytes=bucket_bytes, init_buffers=init_buffers, call="load_safetensors",
                file=FileView(rename=rename, conversion=None if rename is not None else conversion, progress=bar))
    finally:
        if ckpt is not None:
            ckpt.close()


# ----------------------------------------------------------------------------------------------
# saving
def save_safetensors(
    model: nn.Module,
    path: PathLike,
    *,
    max_shard_size: int | str = "5GB",
    tied: Literal["omit", "both"] = "omit",
    dtype: torch.dtype | None = None,
    rename: Rename = None,
    metadata: Mapping[str, str] | None = None,
    bucket_bytes: int | None = None,
    progress: bool | None = None,
    write_config: bool = True,
    conversion: ConversionArg = "auto",
    writers: int | Literal["host"] = 1,
    quantize: Literal["fp8", "fp8-ue8m0", "mxfp4"] | None = None,
    block_size: tuple[int, int] | None = (128, 128),
    quantize_if: Callable[[str, torch.Tensor], bool] | None = None,
) -> Path:
    """Save a (sharded) model as a Hugging Face safetensors checkpoint directory, streaming.

    Call on every rank. Shards are gathered to the writer of their file in buckets (the engine's
    ``collect``; one writer, rank 0, by default) and each full tensor is written straight to its
    offset in its file and dropped, so a writer holds at most one bucket beyond its own shards,
    whatever the model size. With ``writers`` above 1 the files are shared between several ranks,
    each gathering and writing only its own files (see ``writers``). The layout is planned from metadata
    first: ``model.safetensors`` when everything fits in ``max_shard_size``, else
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
    (``metadata.total_size``, ``weight_map``). Files are written under temporary names, fsync-ed and
    renamed, the index last; a failed save leaves an existing checkpoint in ``path`` as it was, and
    other files in ``path`` are kept (``config.json`` is replaced by the model's own, see
    ``write_config``). NF4 weights are written dequantised.

    Args:
        model: the model (FSDP2-sharded, tensor-parallel, or plain). Non-persistent buffers are
            not saved.
        path: the output directory (created if needed; may hold a previous checkpoint).
        max_shard_size: bytes per file (int, or ``"5GB"``, ``"500MiB"``, ...). A tensor larger
            than this gets a file of its own.
        tied: ``"omit"`` (default, HF convention): a tensor shared by several keys is stored once,
            under its first key; ``"both"``: under every key.
        dtype: cast floating tensors to this dtype in the file (integer tensors are kept).
        rename: model name -> file name: a callable (``None`` skips the key) or a Mapping.
        metadata: extra string metadata for every file's header (``format: pt`` is always set).
        bucket_bytes: full-tensor bytes gathered per step (default: the engine's, 16 MiB): rank
            0's memory beyond its own shards is about one bucket.
        progress: a tqdm bar of bytes written on rank 0 (``None``: only on a terminal).
        write_config: when the model carries a Hugging Face config (``model.config``), also write
            ``config.json`` (and ``generation_config.json`` when the model can generate) as
            ``save_pretrained`` does, so ``from_pretrained(path)`` loads the directory as is. They
            are staged on rank 0 before any tensor moves and renamed into place right after the
            weights are committed: a failed save leaves no new config. ``False``: weights only.
        conversion: ``"auto"`` (default) writes a transformers model in the layout its
            ``save_pretrained`` writes (the Hub layout: per-expert MoE tensors, the checkpoint's
            names), through the inverse of transformers' conversion rules for that model, tensor
            by tensor as they are gathered; other models, and ``None``, write the model's own
            keys (``model.state_dict()``). ``rename`` then applies to the written keys.
        writers: how many ranks write files: ``1`` (default): rank 0 writes every file; ``W``
            (up to the world size): ranks ``0, N/W, 2N/W, ...`` each write about 1/W of the bytes
            (with ``torchrun``'s host-by-host rank numbering, ``W`` = the number of hosts is one
            writer per host); ``"host"``: the lowest rank of every host (host name and network
            namespace) writes. Files go to writers whole (all the Hub pieces of one model tensor in
            one writer's files), largest first, each to a writer whose host holds the most of its
            bytes among those within 1.25x the even share; each tensor is gathered from the
            replica on its writer's own host when there is one (HSDP across hosts: no byte crosses
            between hosts). The result is the same checkpoint (same keys and tensors, one index);
            only the split into files may differ: with ``W`` > 1, files are cut at about
            ``1 / (4 W)`` of the model when ``max_shard_size`` would give fewer than ``4 W``. Every
            writer needs the directory (a file system all writers share). Rank 0 coordinates:
            the lock, the free-space check, and the commit, which renames nothing until every
            writer has fsync-ed its files; a failing writer makes every rank raise its error.
        quantize: write a quantized release (docs/layouts.md, "Writing quantized releases"):
            ``"fp8"``: e4m3 weights with a float32 ``weight_scale_inv`` per ``block_size`` block
            (the grid rounded up where a dim is not a multiple), bit for bit what vLLM's
            ``per_block_cast_to_fp8`` makes of the tensor in the file's dtype; ``"fp8-ue8m0"``:
            the same with scales rounded up to powers of two (DeepSeek-V3.1's, stored as float32);
            ``"mxfp4"``: gpt-oss's experts as ``_blocks`` / ``_scales``. By default the linear
            weights of the decoder layers are quantized (the 2-D ``weight`` of every ``nn.Linear``
            under ``layers.<i>`` and the experts' weights there); embeddings, the head, norms,
            biases and MoE routers stay in the model's (or ``dtype``'s) dtype. Each tensor is
            quantized on its writer as it is gathered (memory as an unquantized save, plus one
            tensor's float32 copy). ``config.json`` gets the release's ``quantization_config``
            (``quant_method``, ``fmt``, ``activation_scheme: "dynamic"``, ``weight_block_size``,
            ``modules_to_not_convert``, ``scale_fmt: "ue8m0"``; for ``"mxfp4"``: ``quant_method``
            and ``modules_to_not_convert``). ``None`` (default): unquantized.
        block_size: FP8's block, ``(rows, columns)`` of the last two dims per scale (default
            ``(128, 128)``, the releases'); ignored by ``"mxfp4"`` (groups of 32); ``None`` is
            accepted unless ``quantize`` is ``"fp8"`` / ``"fp8-ue8m0"``.
        quantize_if: ``(name, tensor) -> bool`` choosing the tensors to quantize instead of the
            default rule: called on every rank, before any tensor moves, for each floating tensor
            of the checkpoint layout, with its checkpoint name (the Hub's, before ``rename``) and a
            ``meta`` tensor of its shape and written dtype; it must give every rank the same answer.

    Returns:
        Path: the index file, or the single ``model.safetensors`` (on every rank).

    Raises:
        ValueError: the ranks passed different ``writers``, ``conversion``, ``max_shard_size``,
            ``tied``, ``dtype``, ``rename``, ``metadata``, ``bucket_bytes``, ``quantize``,
            ``block_size`` or ``quantize_if`` (names each and every rank's value, before any file is
            opened); ``quantize`` not one of the formats, ``block_size`` not two positive ints,
            ``quantize_if`` choosing a tensor the format cannot take, ``"mxfp4"`` of a model without
            gpt-oss experts (each names the argument and value); bad ``tied`` / ``max_shard_size`` /
            ``bucket_bytes``, ``writers`` below 1 or above the world size, a rename collision, or
            (``write_config``) transformers' save-time validation refuses the model's config; every
            rank, before any tensor moves.
        TypeError: ``dtype`` is not a floating ``torch.dtype``; ``writers`` is neither an int nor
            ``"host"``; ``quantize_if`` is not callable or returns something other than a bool.
        OSError: the directory cannot be created or written, or has too little free space, or a
            writer's write or fsync fails (a full disk, the file-size limit); raised on every rank
            (naming the failing writer's rank), with no file of the new checkpoint left behind.
        CheckpointLockedError: another writer is saving to ``path`` (a ``BlockingIOError`` naming
            its pid, host and start time), on every rank.

    Examples:
        >>> import tempfile, torch
        >>> from safetensors.torch import load_file
        >>> from fsdptk import save_safetensors
        >>> d = tempfile.mkdtemp()
        >>> save_safetensors(torch.nn.Linear(4, 2), d).name
        'model.safetensors'
        >>> sorted(load_file(f"{d}/model.safetensors"))
        ['bias', 'weight']
        >>> save_safetensors(torch.nn.Linear(4, 2), d, writers="host").name  # one writer per host
        'model.safetensors'
        >>> layers = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Linear(64, 32)])})
        >>> _ = save_safetensors(layers, d, quantize="fp8", block_size=(16, 16))  # an FP8 release
        >>> {k: v.dtype for k, v in sorted(load_file(f"{d}/model.safetensors").items())}
        {'layers.0.bias': torch.float32, 'layers.0.weight': torch.float8_e4m3fn, 'layers.0.weight_scale_inv': torch.float32}
    """
    wait_for_pending()
    agree_arguments("save_safetensors", writers=writers, conversion=conversion, max_shard_size=max_shard_size,
                    tied=tied, dtype=dtype, rename=rename, metadata=metadata, bucket_bytes=bucket_bytes,
                    quantize=quantize, block_size=block_size, quantize_if=quantize_if)
    layout = run_agreed(lambda: quantized_layout(model, conversion, quantize=quantize, block_size=block_size,
                                                 quantize_if=quantize_if, dtype=dtype))
    items, dtypes = save_items(model, tied, dtype)
    plan = plan_save(items, dtypes, path, max_shard_size=max_shard_size, rename=rename, metadata=metadata,
                      bucket_bytes=bucket_bytes, progress=progress, conversion=layout.nodes, writers=writers,
                      written=layout.written)

    def stage_config() -> Any:
        return stage_hf_config(model, plan.path, dtype=dtype,
                               quantization_config=layout.quantization_config) if write_config else None

    return write_save(plan, stage_config)

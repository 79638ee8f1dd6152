"""Model state: full state dict -> sharded model (load), sharded model -> full CPU state (gather).

Both are thin callers of :mod:`fsdptk._engine`: metadata is agreed on every rank first (so every
error is raised on every rank, and a failed validation leaves the model untouched), each rank then
receives only its own shard bytes (scatter from rank 0, or local slicing of a source it can read),
and gathering streams full tensors to rank 0 bucket by bucket. See ``docs/state_dict.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from fsdptk import _engine
from fsdptk._core.arguments import arguments_view
from fsdptk._core.compat import IncompatibleKeys as _IncompatibleKeys
from fsdptk._core.dist import (
    check_comm_device,
    check_rank_zero,
    check_type,
    is_rank0,
)
from fsdptk._core.names import tensor_groups
from fsdptk._engine import bucket_size
from fsdptk._engine.sources import RenamedSource
from fsdptk._files.common import Rename
from fsdptk._plans import peft as _peft
from fsdptk._plans.buffers import (
    BufferView,
    assign_buffers,
    assign_recomputed,
    buffer_local,
    buffer_plan,
    move_real_nonpersistent,
    receive_buffers,
)
from fsdptk._plans.load_view import compose
from fsdptk.buffers import BUFFER_INIT_HOOKS, BufferInit
from fsdptk.errors import StateDictMismatchError

__all__ = [
    "load_from_full_model_state_dict",
    "gather_cpu_state_dict",
    "iter_full_state_dict",
    "BUFFER_INIT_HOOKS",
]


def _tensor_groups(model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Persistent state in state_dict order, one entry per tensor object, and alias -> canonical."""
    groups = tensor_groups(model)
    targets = [(keys[0], t) for t, keys in groups]
    aliases = {alias: keys[0] for _, keys in groups for alias in keys[1:]}
    return targets, aliases


def _check_strict(model: nn.Module, missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise StateDictMismatchError.for_keys(missing, unexpected, type(model).__name__)


def load_from_full_model_state_dict(
    model: nn.Module,
    full_sd: Mapping[str, Any],
    device: torch.device | str,
    strict: bool = False,
    cpu_offload: bool = False,
    *,
    release_sd: bool = True,
    broadcast_from_rank0: bool = False,
    bucket_bytes: int | None = None,
    init_buffers: BufferInit | None = None,
) -> _IncompatibleKeys:
    """Load a full (unsharded) state dict into a model, each rank keeping only its shards.

    Works for models built on ``meta`` or materialised, sharded with FSDP2 on any mesh (1-D, HSDP,
    FSDP + TP, ``_StridedShard``), with unsharded submodules, buffers and NF4 parameters. Every
    tensor is cast to the model's dtype for its key (NF4: the full tensor is re-quantised with the
    parameter's own block sizes, then this rank's chunk is kept). Tied parameters stay one
    Parameter object. Non-persistent buffers (in no state dict) still on ``meta`` are recomputed
    on CPU, for their module only, by the first rule of :mod:`fsdptk.buffers` that applies
    (``init_buffers``, :func:`fsdptk.register_buffer_init`, the module's own hook such as
    torchtune's ``rope_init``, Hugging Face's ``_init_weights``, ``reset_parameters`` of a
    parameter-less module), or, when no rule applies, sent from rank 0 when
    ``broadcast_from_rank0`` and rank 0 holds real values. Real non-persistent buffers (a model
    built under :func:`fsdptk.params_on_meta`) keep their values and move to ``device``.

    Args:
        model: the (usually sharded) model.
        full_sd: full tensors by fqn; any Mapping, e.g. a lazy view over safetensors files (one
            with ``get_slice`` is read shard-on-read). With ``broadcast_from_rank0`` only rank 0's
            is read and the other ranks may pass ``{}``.
        device: where the shards go (e.g. ``torch.device("cuda", local_rank)``).
        strict: raise (on every rank, before the model changes) when keys are missing or unexpected.
        cpu_offload: keep the loaded parameter shards on CPU (buffers go to ``device``).
        release_sd: free each entry of ``full_sd`` as soon as it has been used, so peak memory
            stays at one tensor (or bucket) beyond the shards, as torchtune does: ``full_sd``
            KEEPS ALL ITS KEYS, and the value of every key that was loaded into the model (tied
            aliases included; on every rank that holds it) is replaced by a ``meta`` tensor of the
            same shape and dtype (no storage); unexpected keys keep their values. A mapping that
            does not support item assignment (a lazy checkpoint view) is left as it is. Entries are
            released as they are used, so after a failed load the ones used before the failure are
            already ``meta``: retry from the checkpoint, not from that dict. ``False`` leaves the
            caller's mapping untouched.
        broadcast_from_rank0: only rank 0 reads ``full_sd``; each rank receives only its own shard
            bytes, scattered from rank 0 bucket by bucket.
        bucket_bytes: bounds the memory one scatter bucket adds beyond ``full_sd`` and the new
            shards (``None``: the engine's default, 16 MiB): full tensors read from a lazy
            source (a checkpoint file) or converted to another dtype, and packed small pieces.
            Large dim-0 shards of tensors a ``dict`` already holds are sent from views of them
            and received in place, adding nothing, so they move in one bucket.
        init_buffers: ``init_buffers(module)`` sets the non-persistent buffers of each module
            that has some on ``meta``, overriding every other rule; it receives a stand-in of the
            module (parameters on ``meta``) and runs under ``torch.device("cpu")`` (see
            :func:`fsdptk.register_buffer_init`).

    Returns:
        torch.nn.modules.module._IncompatibleKeys: ``missing_keys`` and ``unexpected_keys``.

    Raises:
        ValueError: on every rank, before the model changes: a shape mismatch (key and both
            shapes), a floating tensor for an integer entry (key and both dtypes), ``bucket_bytes``
            not a positive int, sources that
            differ between ranks, meta non-persistent buffers that no rule can compute (the
            message names them, why each rule did not apply, and the remedies).
        TypeError: on every rank, when the only problems are non-tensor values (key and type),
            or ``model`` is not an ``nn.Module`` or ``full_sd`` not a Mapping (names the argument
            and its type).
        StateDictMismatchError: with ``strict=True``, on every rank before the model changes:
            missing or unexpected keys (a ``RuntimeError`` with torch's strict message, carrying
            ``missing_keys`` and ``unexpected_keys``).
        Exception: a read failing on any rank (a lazy ``full_sd`` raising, a file gone), on every
            rank, named after the lowest failing rank and the key; the model is untouched (values
            are assigned only once every rank has all of its values). Without
            ``broadcast_from_rank0``, a replicated (non-DTensor) entry that differs between ranks
            is a ValueError naming the key (a checksum in the engine's per-bucket agreement).

    Examples:
        >>> import torch
        >>> from fsdptk import load_from_full_model_state_dict
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 3)
        >>> sd = {"weight": torch.ones(3, 2), "bias": torch.zeros(3)}
        >>> load_from_full_model_state_dict(model, sd, "cpu", strict=True, release_sd=False)
        <All keys matched successfully>
        >>> model.weight.device.type, len(sd)
        ('cpu', 2)
    """
    return load_state(model, full_sd, device, strict=strict, cpu_offload=cpu_offload, release_sd=release_sd,
                      broadcast_from_rank0=broadcast_from_rank0, bucket_bytes=bucket_bytes,
                      init_buffers=init_buffers, call="load_from_full_model_state_dict")


class FileView(NamedTuple):
    """How :func:`fsdptk.load_safetensors` sees its file: composed with the load's other views in
    :func:`fsdptk._plans.load_view.compose`."""

    rename: Rename = None  # checkpoint key -> model key; wins over the conversion
    conversion: Any = None  # "auto", a Conversion, or None
    progress: Any = None  # a tqdm bar: its total is set once the views know it, reads update it


def load_state(model: nn.Module, full_sd: Mapping[str, Any] | None, device: torch.device | str, *, strict: bool,
               cpu_offload: bool, release_sd: bool, broadcast_from_rank0: bool, bucket_bytes: int | None,
               init_buffers: BufferInit | None, call: str, file: FileView | None = None) -> _IncompatibleKeys:
    """:func:`load_from_full_model_state_dict`, and :func:`fsdptk.load_safetensors` with its
    ``file`` view (rename or conversion, progress); ``call``: the public call, named when the ranks
    disagree on an argument. The load's views are composed in one place
    (:func:`fsdptk._plans.load_view.compose`) inside the pre-flight, so a conversion's error is
    raised on every rank by the engine's one metadata exchange, before the model changes."""
    file = file or FileView()
    reads = not broadcast_from_rank0 or is_rank0()
    error: Exception | None = None
    try:  # a bad argument on any rank is raised on every rank by the one metadata exchange below
        check_type(model, nn.Module, "model", "a torch.nn.Module")
        if reads or full_sd is not None:
            check_type(full_sd, Mapping, "full_sd", "a Mapping of fqn -> full tensor (a dict, or a "
                       "lazy view such as SafetensorsCheckpoint)" + ("" if reads else "; ranks other "
                       "than 0 may pass {} or None with broadcast_from_rank0=True"))
        dev = torch.device(device)
        nbytes = bucket_size(bucket_bytes)
        targets, aliases = _tensor_groups(model)
        # file -> conversion or rename -> PEFT base keys -> aliases (fsdptk._plans.load_view)
        bar = file.progress
        view = compose(model, full_sd, aliases, rename=file.rename,
                       conversion=file.conversion, on_read=None if bar is None else bar.update)
        source, viewed = view.source, view.viewed
        if bar is not None:
            bar.total = view.total
            bar.refresh()
        buffers_local = buffer_local(model, init_buffers)
    except Exception as e:  # noqa: BLE001 - agreed by the exchange just below
        error, targets, source, buffers_local = e, [], RenamedSource({}, {}), ({}, BufferView({}, {}, {}))
        viewed = {}
        dev, nbytes = torch.device("cpu"), 1
    # ONE object exchange before data moves: this rank's argument error (if any) and the buffers'
    # views travel with the metadata
    plan = _engine.agree(targets, source, src_rank0=broadcast_from_rank0, extra=buffers_local[1],
                         arguments=arguments_view(call, broadcast_from_rank0=broadcast_from_rank0, strict=strict,
                                                  bucket_bytes=bucket_bytes),
                         failed=error)
    missing = [k for k in model.state_dict(keep_vars=True) if aliases.get(k, k) in plan.missing]
    missing = _peft.without_left_adapters(viewed, missing)
    if strict:
        _check_strict(model, missing, plan.unexpected)
    recomputed, send = buffer_plan(model, broadcast_from_rank0, init_buffers, buffers_local, plan.extras)
    # rank 0's buffers first, kept aside: a failure here (agreed on every rank) changes nothing
    sent = receive_buffers(model, send, dev, plan.extras or [])
    # validation is over on every rank: from here on the model changes
    params = {id(p) for p in model.parameters()}
    by_fqn = dict(targets)
    new_sd: dict[str, Any] = {}
    load_device = torch.device("cpu") if cpu_offload else dev
    values = cast(Generator[tuple[str, torch.Tensor], None, None],  # collect/distribute are generators (annotated Iterator in the engine)
                  _engine.distribute(plan, source, device=load_device, release=release_sd, bucket_bytes=nbytes))
    for fqn, value in values:  # ends only once every rank has every value (agreed status)
        try:
            old = by_fqn[fqn]
            if id(old) in params:
                value = nn.Parameter(value, requires_grad=old.requires_grad)
            elif cpu_offload:
                value = value.to(dev)
            new_sd[fqn] = value
        except Exception as e:  # noqa: BLE001 - the engine agrees it: every rank raises it
            values.throw(e)
    for alias, canon in aliases.items():
        if canon in new_sd:
            new_sd[alias] = new_sd[canon]
    model.load_state_dict(new_sd, strict=False, assign=True)
    if release_sd and broadcast_from_rank0 and not is_rank0():
        for fqn in plan.keys:  # never read here, but released like rank 0's (same contract)
            if fqn in source:
                source.release(fqn)
    assign_buffers(model, sent)
    assign_recomputed(model, recomputed, dev)
    move_real_nonpersistent(model, dev)
    return _IncompatibleKeys(missing, list(plan.unexpected))


def _gather_items(model: nn.Module, adapter_weights_only: bool,
                  is_adapter: Callable[[str, torch.Tensor], bool] | None,
                  ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, list[str]]]:
    """Items to gather (one per tensor object) and canonical fqn -> alias fqns."""
    targets, aliases = _tensor_groups(model)
    if adapter_weights_only:  # a PEFT model: what PEFT saves; any other: torchtune's rule
        keep = is_adapter or _peft.adapter_predicate(model) or (
            lambda _fqn, t: isinstance(t, nn.Parameter) and t.requires_grad)
        targets = [(fqn, t) for fqn, t in targets if keep(fqn, t)]
    groups: dict[str, list[str]] = {}
    for alias, canon in aliases.items():
        groups.setdefault(canon, []).append(alias)
    return targets, groups


def iter_full_state_dict(
    model: nn.Module,
    *,
    bucket_bytes: int | None = None,
    adapter_weights_only: bool = False,
    is_adapter: Callable[[str, torch.Tensor], bool] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream the model's full state to rank 0 as buckets of ``(fqn, cpu_tensor)``.

    The streaming form of :func:`gather_cpu_state_dict` for checkpoint writers: write each bucket
    and drop it, so rank 0 never holds the whole model. Persistent entries only, in
    ``state_dict()`` order; a tied parameter is moved once and yielded under each of its fqns (the
    same CPU tensor). Tensors keep their dtype (NF4 is dequantised to its original dtype).

    Args:
        model: the (sharded) model; the same structure on every rank.
        bucket_bytes: full-tensor bytes per bucket, bounding memory on every rank (``None``: the
            engine's default, 16 MiB).
        adapter_weights_only: gather only adapter weights, never moving the frozen base. On a PEFT
            model an adapter weight is a tensor PEFT's ``get_peft_model_state_dict`` returns for one
            of its adapters (under the model's fqns); on any other model a trainable parameter
            (``requires_grad=True``), torchtune's rule; ``is_adapter`` overrides both.
        is_adapter: ``(fqn, tensor) -> bool`` deciding what an adapter weight is, e.g. by name:
            ``lambda fqn, _: "lora_" in fqn or "magnitude" in fqn``.

    Returns:
        Iterator[list[tuple[str, torch.Tensor]]]: non-empty buckets on rank 0, ``[]`` elsewhere.
        Every rank must exhaust the iterator (it runs collectives). When the code consuming it
        fails on one rank (a write), pass the error in with ``iterator.throw(exc)``: every rank
        then raises it (see ``docs/failure_model.md``). A consumer that leaves the stream early
        on one rank (its code raises, it breaks out of its loop, or it calls ``close()``: the
        iterator is closed, at the latest when it is dropped) still takes part in the stream's
        next agreement, so every other rank raises a RuntimeError naming that rank within a
        bucket, never at a process-group timeout; the leaving rank goes on with its own error, or
        none.

    Raises:
        TypeError: on every rank, when ``model`` is not an ``nn.Module``.
        ValueError: on every rank, when a tensor is still on ``meta``, ranks disagree, or
            ``bucket_bytes`` is not a positive int.
        Exception: any rank's failure while gathering, on every rank, naming that rank.

    Examples:
        >>> import torch
        >>> from fsdptk import iter_full_state_dict
        >>> [k for bucket in iter_full_state_dict(torch.nn.Linear(2, 3)) for k, _ in bucket]
        ['weight', 'bias']
    """
    return _stream_state(model, bucket_bytes, adapter_weights_only, is_adapter, retained=False,
                         call="iter_full_state_dict")


def _stream_state(model: nn.Module, bucket_bytes: int | None, adapter_weights_only: bool,
                  is_adapter: Callable[[str, torch.Tensor], bool] | None, *, retained: bool, call: str,
                  ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """:func:`iter_full_state_dict`; ``retained``: the caller keeps every bucket (see ``collect``);
    ``call``: the public call, named when the ranks disagree on an argument."""
    # the arguments that change the exchange travel in the engine's one metadata exchange
    arguments = arguments_view(call, bucket_bytes=bucket_bytes, adapter_weights_only=adapter_weights_only,
                               is_adapter=is_adapter)
    error: Exception | None = None
    try:  # a bad argument or a failing is_adapter on any rank: raised on every rank by the engine's
        # one metadata exchange
        check_type(model, nn.Module, "model", "a torch.nn.Module")
        bucket_bytes = bucket_size(bucket_bytes)
        items, groups = _gather_items(model, adapter_weights_only, is_adapter)
    except Exception as e:  # noqa: BLE001 - agreed by collect
        error, items, groups, bucket_bytes = e, [], {}, 1
    buckets = cast(Generator[list[tuple[str, torch.Tensor]], None, None],  # collect/distribute are generators (annotated Iterator in the engine)
                   _engine.collect(items, bucket_bytes=bucket_bytes, retained=retained, failed=error,
                                                  arguments=arguments))
    try:
        for bucket in buckets:
            try:
                yield [(k, t) for fqn, t in bucket for k in (fqn, *groups.get(fqn, ()))]
            except Exception as e:  # noqa: BLE001 - the caller's .throw(e): agreed by the engine
                buckets.throw(e)
    except GeneratorExit:  # the consumer left (close(), or a break or an error dropped the iterator)
        buckets.close()  # the engine's next agreement, now: every other rank raises, naming this rank
        raise


def gather_cpu_state_dict(
    model: nn.Module,
    is_rank_zero: bool,
    device: torch.device | None = None,
    adapter_weights_only: bool = False,
    *,
    bucket_bytes: int | None = None,
    is_adapter: Callable[[str, torch.Tensor], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Gather the full model state as CPU tensors on rank 0 (``{}`` on the other ranks).

    Shards travel to rank 0 only (a gather, not an all-gather), bucket by bucket, with no barrier
    per parameter; other ranks hold at most one bucket beyond their shards. See
    :func:`iter_full_state_dict` for the streaming form and what "adapter" means.

    Args:
        model: the (sharded) model.
        is_rank_zero: whether this is global rank 0 (the gathered dict is returned where this is
            True and the rank is 0; a value that disagrees with the real rank warns once).
        device: the device the gather communicates on (torchtune's meaning), ``None`` for the
            process group's: fsdptk always communicates on the backend's device (CPU for gloo, the
            current accelerator otherwise), so a ``device`` of another type warns that it is not
            used. The results are always CPU tensors.
        adapter_weights_only: gather only adapter weights: PEFT's adapter tensors on a PEFT model,
            else trainable parameters (torchtune's rule), or what ``is_adapter`` selects.
        bucket_bytes: bounds the memory one bucket adds on every rank beyond the result
            (``None``: the engine's default, 16 MiB): packed small pieces. The full tensors are
            the result (kept anyway), so large dim-0 shards received in place move in one bucket.
        is_adapter: ``(fqn, tensor) -> bool`` overriding the adapter definition.

    Returns:
        dict[str, torch.Tensor]: fqn -> full CPU tensor (original dtype; NF4 dequantised).

    Raises:
        ValueError: on every rank, when a tensor is still on ``meta``, ranks disagree, or
            ``bucket_bytes`` is not a positive int.
        TypeError: on every rank, when ``model`` is not an ``nn.Module``.
        Exception: any rank's failure while gathering, on every rank, naming that rank.

    Warns:
        UserWarning: ``is_rank_zero`` disagrees with the global rank, or ``device`` is not the
            type the process group communicates on (once per call site).

    Examples:
        >>> import torch
        >>> from fsdptk import gather_cpu_state_dict
        >>> sorted(gather_cpu_state_dict(torch.nn.Linear(2, 3), is_rank_zero=True))
        ['bias', 'weight']
    """
    check_comm_device("gather_cpu_state_dict", device)
    keep = check_rank_zero("gather_cpu_state_dict", is_rank_zero)
    out: dict[str, torch.Tensor] = {}
    for bucket in _stream_state(model, bucket_bytes, adapter_weights_only, is_adapter, retained=True,
                                call="gather_cpu_state_dict"):
        out.update(bucket)
    return out if keep else {}

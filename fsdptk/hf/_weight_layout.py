"""The one exchange of :func:`fsdptk.hf.weight_source`: every argument checked on this rank
(:func:`check`), the message each rank sends (:class:`SourceView`: its arguments, its error, what it
holds) and the disagreements it reveals (:func:`raise_disagreement`). What the ranks agree is then
planned in :mod:`fsdptk._plans.source_plan` (the owners of each Hub tensor). Nothing here
communicates.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from fsdptk import _engine
from fsdptk._core.arguments import ArgumentsView, check_arguments
from fsdptk._engine.layouts import Box

__all__ = ["SourceView", "check", "raise_disagreement"]


class SourceView(NamedTuple):
    """What each rank sends in the one exchange of :func:`fsdptk.hf.weight_source`."""

    arguments: ArgumentsView  # the arguments every rank must pass alike
    error: Any  # error_payload of its local failure (a bad argument, a meta tensor), or None
    fingerprint: str | None  # of its items and Hub tensors (names, shapes, dtypes)
    boxes: list[Box | None]  # per item, the box of the full tensor it holds (None: none)
    plain: list[bool]  # per item, its local tensor is exactly that box, unquantized
    meshes: list[tuple[int, ...] | None]  # per item, the shape of its mesh when it spans the ranks in order
    host: str
    records: str | None  # the record types it can import (RecordTypes.kind: vLLM's, with its version,
    # or fsdptk's own, and why); None when it failed before finding out


def check(model: Any, conversion: Any, dtype: Any, owners: Any, bucket_bytes: Any, adapters: Any,
          quantize: Any, block_size: Any, quantize_if: Any, world: int) -> int:
    """Every argument checked on this rank (no communication); ``bucket_bytes`` resolved."""
    from fsdptk._plans.quant_save import quant_format

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    quant_format(quantize, block_size, quantize_if)  # save_safetensors' own checks and messages
    if quantize is not None and adapters is not None:
        raise ValueError(f"quantize={quantize!r} quantizes a model's own Hub tensors (adapters=None); "
                         f"quantizing adapters, alone or merged, is not supported: got adapters={adapters!r}")
    if conversion not in ("auto", None):
        raise TypeError(f"conversion must be 'auto' or None, got {conversion!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if owners not in ("host", "all"):
        if isinstance(owners, bool) or not isinstance(owners, int):
            raise TypeError(f"owners must be an int (1 to the world size, {world}), 'host' or 'all', "
                            f"got {owners!r}")
        if not 1 <= owners <= world:
            raise ValueError(f"owners must be between 1 and the world size ({world}), 'host' or 'all'; "
                             f"got {owners}")
    if adapters not in (None, "merged", "only"):
        raise ValueError(f"adapters must be None, 'merged' or 'only', got {adapters!r}")
    return _engine.bucket_size(bucket_bytes)


def raise_disagreement(views: list[SourceView]) -> None:
    """One ValueError naming every argument the ranks passed differently (with each rank's value),
    ranks that would make the source of different record types (what each can import of vLLM), or
    a model that differs between ranks."""
    check_arguments([v.arguments for v in views])
    kinds: dict[str | None, list[int]] = {}
    for r, v in enumerate(views):
        kinds.setdefault(v.records, []).append(r)
    if len(kinds) > 1:
        shown = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {kind}"
                          for kind, ranks in kinds.items())
        raise ValueError("weight_source: the ranks can import different record types for the source (vLLM's "
                         "from vllm.distributed.weight_transfer.base where it imports, fsdptk's own otherwise), "
                         f"and every rank must make the same; install the same vLLM (or none) on every rank: "
                         f"{shown}")
    diff = [r for r, v in enumerate(views) if v.fingerprint != views[0].fingerprint]
    if diff:
        raise ValueError(f"weight_source: the model's tensors (names, shapes, dtypes) differ between rank 0 "
                         f"and ranks {diff}")

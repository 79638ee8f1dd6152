"""Tensor-parallel helpers: scale attention modules to their per-rank share, apply TP plans.

The usual order of a TP (+ FSDP) set-up, and why (see ``docs/tensor_parallel.md``)::

    model = build_on_meta()                      # meta init: nobody materialises the full model
    prepare_mha_for_tp(model, tp_mesh)           # per-rank head counts (plain attributes only)
    apply_tp(model, tp_mesh, llama_tp_plan(model))   # TP before FSDP: FSDP2 shards TP's DTensors
    shard_model(model, ..., dp_mesh=dp_mesh)     # FSDP over the data-parallel dims
    load_from_full_model_state_dict(model, ...)  # load after sharding: each rank gets its shards

Plans are built from rules by :mod:`fsdptk.tp_plan`; this module holds the parts that touch the
model: :func:`prepare_mha_for_tp` and :func:`apply_tp`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from fsdptk._core.dist import log_rank0

__all__ = ["prepare_mha_for_tp", "apply_tp"]

_log = logging.getLogger(__name__)

_MISSING = object()
_PREPARED = "_fsdptk_mha_tp"  # set on each attention module prepare_mha_for_tp changed


@dataclass(frozen=True)
class _Change:
    """One attribute to rewrite: ``setattr(holder, attr, new)``."""

    module_fqn: str
    holder: Any
    attr: str
    old: int
    new: int


def _tp_size(tp_mesh: Any) -> int:
    """Size of a 1-D TP mesh; a ValueError for anything else (on every rank: purely local)."""
    if not isinstance(tp_mesh, DeviceMesh):
        raise TypeError(f"tp_mesh must be a torch DeviceMesh, got {type(tp_mesh).__name__}")
    if tp_mesh.ndim != 1:
        names = tp_mesh.mesh_dim_names
        hint = " (slice it first, e.g. mesh['tp'])" if names and "tp" in names else ""
        raise ValueError(
            f"tp_mesh must be a 1-D DeviceMesh, got a {tp_mesh.ndim}-D mesh with shape "
            f"{tuple(tp_mesh.shape)} and dims {names}{hint}"
        )
    return tp_mesh.size()


def _resolve(obj: Any, path: str) -> tuple[Any, str, Any]:
    """Follow a dotted path: ``(holder, last_attr, value)``, value ``_MISSING`` when absent."""
    *parents, last = path.split(".")
    holder = obj
    for part in parents:
        holder = getattr(holder, part, _MISSING)
        if holder is _MISSING:
            return _MISSING, last, _MISSING
    return holder, last, getattr(holder, last, _MISSING)


def _has(module: nn.Module, path: str | None) -> bool:
    return path is not None and _resolve(module, path)[2] is not _MISSING


def _default_is_attention(num_heads_attr: str, num_kv_heads_attr: str | None) -> Callable:
    """Default attention finder: carries the KV-head attribute, or is named ``*Attention*`` and
    carries the head-count attribute (so a decoder that merely records ``num_heads`` is skipped)."""

    def pred(name: str, module: nn.Module) -> bool:
        if _has(module, num_kv_heads_attr):
            return True
        return "attention" in type(module).__name__.lower() and _has(module, num_heads_attr)

    return pred


def _scope(model: nn.Module, decoder_attr: str | None) -> tuple[nn.Module, str]:
    """The sub-tree to scan: ``model.<decoder_attr>`` for fusion wrappers, else the model."""
    if decoder_attr:
        inner = getattr(model, decoder_attr, None)
        if isinstance(inner, nn.Module) and inner is not model:
            return inner, decoder_attr
    return model, ""


def _plan_changes(
    fqn: str,
    module: nn.Module,
    attrs: list[tuple[str, str, str]],
    tp_size: int,
    replicate_kv_heads: bool,
) -> list[_Change]:
    """Validate one attention module and return its attribute rewrites (nothing is changed)."""
    where = f"attention module '{fqn or '<root>'}' ({type(module).__name__})"
    changes = []
    for role, label, path in attrs:
        holder, attr, value = _resolve(module, path)
        if value is _MISSING:
            raise ValueError(
                f"{where} has no attribute '{path}' ({label}); pass {role}=<name> (a dotted path "
                f"such as 'config.num_key_value_heads' works), {role}=None if this model family "
                "has no such attribute, or attn_predicate= to select attention modules explicitly."
            )
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}: '{path}' ({label}) must be a positive int, got {value!r}")
        if role == "num_kv_heads_attr" and replicate_kv_heads and value < tp_size:
            if tp_size % value:
                raise ValueError(
                    f"{where}: tensor parallel size ({tp_size}) must be a multiple of the number "
                    f"of KV heads ({value}) to replicate KV heads."
                )
            new = 1  # each rank keeps one replica of the KV head its query heads use
        elif value % tp_size:
            hint = ""
            if role == "num_kv_heads_attr" and value < tp_size and tp_size % value == 0:
                hint = " Pass replicate_kv_heads=True to replicate KV heads across TP ranks."
            raise ValueError(
                f"{where}: {label} ({value}) must be divisible by tensor parallel size "
                f"({tp_size}).{hint}"
            )
        else:
            new = value // tp_size
        changes.append(_Change(fqn, holder, attr, value, new))
    return changes


def prepare_mha_for_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    attn_predicate: Callable[[str, nn.Module], bool] | None = None,
    num_heads_attr: str = "num_heads",
    num_kv_heads_attr: str | None = "num_kv_heads",
    embed_dim_attr: str | None = "embed_dim",
    decoder_attr: str | None = "decoder",
    replicate_kv_heads: bool = False,
) -> nn.Module:
    """Divide the head count, KV head count and embedding dim of every attention module by TP size.

    After tensor parallelism each rank computes only its share of the heads, so a module that
    reshapes with ``self.num_heads`` must see the per-rank count. Unlike torchtune (its own
    ``MultiHeadAttention`` class only), attention modules are found by attribute or by a
    predicate, and the attribute names are configurable: dotted paths reach a config object,
    e.g. Hugging Face's ``"config.num_attention_heads"``. An attribute object shared by several
    modules (a config) is divided once. Every module is validated before any is changed: on
    error the model is untouched.

    By default a module is an attention module when it has ``num_kv_heads_attr``, or when its
    class name contains ``"Attention"`` and it has ``num_heads_attr``. If the root has a
    ``decoder_attr`` sub-module (fusion wrappers such as torchtune's ``DeepFusionModel``), only
    that decoder is scanned: the encoder is not tensor-parallel.

    Calling it twice on one model is a ValueError, not a second division (torchtune's version
    divides again, silently leaving every count too small): each attention module it changes
    records what was done (a plain attribute, not in the state dict), and a second call names the
    module and the earlier change before changing anything.

    GQA with fewer KV heads than TP ranks: by default a ValueError. With
    ``replicate_kv_heads=True`` and a TP size that is a multiple of the KV head count, each rank
    keeps one KV head (``num_kv_heads`` becomes 1), the one its query heads attend with; the K/V
    projections must then use :class:`fsdptk.tp_plan.ReplicatedKVColwise` (``llama_tp_plan(...,
    num_kv_heads=N)`` does this).

    Args:
        model: the model (any device, including meta); modified in place.
        tp_mesh: the 1-D tensor-parallel mesh (``mesh["tp"]``).
        attn_predicate: ``(fqn, module) -> bool`` selecting attention modules (FQNs relative to
            ``model``); ``None`` uses the default rule above.
        num_heads_attr: attribute (dotted path) holding the number of query heads.
        num_kv_heads_attr: attribute holding the number of KV heads, or ``None`` (plain MHA).
        embed_dim_attr: attribute holding the attention output width, or ``None`` to leave it.
        decoder_attr: name of a fusion wrapper's decoder; ``None`` scans the whole model.
        replicate_kv_heads: allow KV heads < TP size by replicating KV heads (see above).

    Returns:
        nn.Module: ``model`` itself, with per-rank attribute values.

    Raises:
        TypeError: if ``tp_mesh`` is not a DeviceMesh.
        ValueError: if ``tp_mesh`` is not 1-D; if a selected module lacks an attribute or a count
            is not divisible by the TP size (the message names the module FQN, the count and the
            TP size, e.g. ``"Number of KV heads (6) must be divisible by tensor parallel size
            (4)."``); if no attention module is found; if a selected module was already
            prepared by an earlier call (names the module, the TP size and the counts).

    Examples:
        >>> mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp_shard", "tp"))  # needs a TP process group; tests/test_tp.py runs it  # doctest: +SKIP
        >>> prepare_mha_for_tp(model, mesh["tp"])  # heads 32 -> 8, kv heads 8 -> 2; a TP group (tests/test_tp.py)  # doctest: +SKIP
        >>> prepare_mha_for_tp(hf_model, mesh["tp"],  # needs a TP process group; tests/test_tp.py runs it  # doctest: +SKIP
        ...     attn_predicate=lambda n, m: type(m).__name__ == "LlamaAttention",
        ...     num_heads_attr="config.num_attention_heads",
        ...     num_kv_heads_attr="config.num_key_value_heads", embed_dim_attr=None)
    """
    tp_size = _tp_size(tp_mesh)
    attrs = [("num_heads_attr", "Number of attention heads", num_heads_attr)]
    if num_kv_heads_attr is not None:
        attrs.append(("num_kv_heads_attr", "Number of KV heads", num_kv_heads_attr))
    if embed_dim_attr is not None:
        attrs.append(("embed_dim_attr", "Embedding dimension", embed_dim_attr))
    is_attention = attn_predicate or _default_is_attention(num_heads_attr, num_kv_heads_attr)
    scope, prefix = _scope(model, decoder_attr)

    changes: dict[tuple[int, str], _Change] = {}
    selected: list[tuple[nn.Module, str]] = []
    found = 0
    for fqn, module in scope.named_modules(prefix=prefix):
        if not is_attention(fqn, module):
            continue
        found += 1
        done = getattr(module, _PREPARED, None)
        if done is not None:
            raise ValueError(
                f"attention module '{fqn or '<root>'}' ({type(module).__name__}) was already "
                f"prepared by prepare_mha_for_tp for tensor parallel size {done[0]} ({done[1]}); "
                "call it once per model: a second call would divide the head counts again."
            )
        mine = _plan_changes(fqn, module, attrs, tp_size, replicate_kv_heads)
        selected.append((module, ", ".join(f"{c.attr} {c.old} -> {c.new}" for c in mine)))
        for ch in mine:
            changes.setdefault((id(ch.holder), ch.attr), ch)  # a shared config is divided once
    if not found:
        raise ValueError(
            f"prepare_mha_for_tp found no attention module in {type(scope).__name__}"
            f"{f' (model.{prefix})' if prefix else ''}: none has '{num_kv_heads_attr}', and none "
            f"named '*Attention*' has '{num_heads_attr}'. Pass attn_predicate= and the attribute "
            "names of this model family."
        )
    for ch in changes.values():
        setattr(ch.holder, ch.attr, ch.new)
    for module, summary in selected:
        setattr(module, _PREPARED, (tp_size, summary))
    log_rank0(_log, "prepare_mha_for_tp: scaled %d attention modules for TP size %s", found, tp_size)
    return model


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]
) -> nn.Module:
    """Apply a tensor-parallel plan (``{fqn: ParallelStyle}``) with ``parallelize_module``.

    Checks first, on every rank and before anything changes, that the mesh is 1-D, that every
    key names an existing sub-module (``parallelize_module`` itself only warns and skips), and
    that every value is a ``ParallelStyle``. Call it before FSDP's ``fully_shard`` (FSDP2
    shards the DTensors TP creates, not the reverse) and, for large models, on a meta model.

    Args:
        model: the model to parallelise in place.
        tp_mesh: the 1-D tensor-parallel mesh.
        plan: FQN -> style, e.g. from :func:`fsdptk.tp_plan.llama_tp_plan` or
            :func:`fsdptk.tp_plan.build_tp_plan`. Exact FQNs; ``""`` is the root.

    Returns:
        nn.Module: ``model``.

    Raises:
        TypeError: if a plan value is not a ParallelStyle or the mesh is not a DeviceMesh.
        ValueError: if the mesh is not 1-D, the plan is empty, a key names no sub-module, a
            module already holds DTensor parameters, ``ColwiseParallel``/``RowwiseParallel``
            targets a module other than ``nn.Linear``/``nn.Embedding``, or a style's own
            ``_check(module, tp_size, fqn)`` refuses its module (e.g. a
            :class:`~fsdptk.tp_plan.ReplicatedKVColwise` that cannot split it). All checked
            before any module changes: on error the model is untouched.

    Examples:
        >>> apply_tp(model, mesh["tp"], llama_tp_plan(model, sequence_parallel=True))  # needs a TP process group; tests/test_tp.py runs it  # doctest: +SKIP
    """
    tp_size = _tp_size(tp_mesh)
    _check_plan(model, plan, tp_size)
    for fqn, style in plan.items():  # exact FQNs: no pattern walk over every child per key
        parallelize_module(model.get_submodule(fqn), tp_mesh, style)
    log_rank0(_log, "apply_tp: parallelised %d modules over TP size %s", len(plan), tp_size)
    return model


def _check_plan(model: nn.Module, plan: Mapping[str, ParallelStyle], tp_size: int) -> None:
    """Everything ``parallelize_module`` would only find half-way through, checked up front."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not plan:
        raise ValueError("apply_tp got an empty plan")
    for fqn, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"plan['{fqn}'] must be a ParallelStyle, got {type(style).__name__}"
            )
        try:
            module = model.get_submodule(fqn)
        except AttributeError as e:
            raise ValueError(f"plan key '{fqn}' names no sub-module of the model ({e})") from e
        done = [n for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
        if done:
            raise ValueError(
                f"plan key '{fqn}' ({type(module).__name__}): parameters {done} are already "
                "DTensors; apply tensor parallel once, before fully_shard"
            )
        # torch's own Colwise/Rowwise styles only know Linear and Embedding (subclasses that
        # override _apply may know more)
        for base in (ColwiseParallel, RowwiseParallel):
            if (isinstance(style, base) and type(style)._apply is base._apply
                    and not isinstance(module, (nn.Linear, nn.Embedding))):
                raise ValueError(
                    f"plan['{fqn}'] is {type(style).__name__}, which only shards nn.Linear and "
                    f"nn.Embedding, but '{fqn}' is a {type(module).__name__}"
                )
        check = getattr(style, "_check", None)  # ReplicatedKVColwise, HFAttentionHeads, ...
        if callable(check):
            check(module, tp_size, fqn)


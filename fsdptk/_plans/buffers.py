"""Buffer planning: how the non-persistent buffers of a model built on ``meta`` get their values.

The rules (``init_buffers=``, a registration, the module's own hook, Hugging Face's init path,
``reset_parameters()``) run on throw-away shadows of the owning modules (:func:`recompute`), and a
load plans, identically on every rank, which buffers are recomputed and which are sent from rank 0
(:func:`buffer_local`, :func:`buffer_plan`, :func:`receive_buffers`); nothing is assigned until the
caller has every value (:func:`assign_buffers`, :func:`assign_recomputed`). The public face, with
the documentation of each rule, is :mod:`fsdptk.buffers`; the loaders of :mod:`fsdptk.state_dict`
and :func:`fsdptk.buffers.materialize` use what is here.
"""

from __future__ import annotations

import functools
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from fsdptk import _engine
from fsdptk._core.dist import all_gather_object, is_rank0, raise_problems
from fsdptk._core.dist import world as _world
from fsdptk._engine import TensorMeta

#: Method names tried, in order, on a module whose non-persistent buffers are on ``meta``
#: (fsdptk.testing's ``reset_buffers``, torchtune's RoPE ``rope_init``, ...).
BUFFER_INIT_HOOKS = ("reset_buffers", "rope_init", "reset_rope", "init_buffers")

#: ``fn(module) -> None``: sets the module's non-persistent buffers (in place or by assignment).
BufferInit = Callable[[nn.Module], None]
Match = type | tuple[type, ...] | Callable[[nn.Module], bool]

REGISTRY: OrderedDict[int, tuple[Match, BufferInit]] = OrderedDict()  # weakref-able for handles

# module attributes that are torch's bookkeeping, never copied back from a shadow
_TORCH_DICTS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                          "_is_hf_initialized"})


def matches(match: Match, module: nn.Module) -> bool:
    if isinstance(match, (type, tuple)):
        return isinstance(module, match)
    return bool(match(module))


@dataclass
class Recomputed:
    """The values a rule computed for one module (CPU tensors) and the plain attributes it set."""

    rule: str
    buffers: dict[str, torch.Tensor]
    attrs: dict[str, Any] = field(default_factory=dict)


def _meta_stand_in(t: torch.Tensor, param: bool) -> torch.Tensor:
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    if param:
        meta = nn.Parameter(meta, requires_grad=t.requires_grad and t.dtype.is_floating_point)
    meta._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' "loaded" flag
    return meta


def _placeholder(ref: torch.Tensor) -> torch.Tensor:
    """A CPU tensor to be written by a rule: NaN where the dtype has it (never uninitialised)."""
    if ref.dtype.is_floating_point or ref.dtype.is_complex:
        return torch.full(tuple(ref.shape), math.nan, dtype=ref.dtype, device="cpu")
    return torch.zeros(tuple(ref.shape), dtype=ref.dtype, device="cpu")


def _shadow(module: nn.Module, wanted: Mapping[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of ``module``'s subtree whose writes cannot reach the real model.

    Parameters and persistent buffers become ``meta`` stand-ins (flagged ``_is_hf_initialized``);
    non-persistent buffers are ``wanted[name]`` placeholders or CPU copies; plain attributes are
    shared (a rule that sets one is seen in the shadow's ``__dict__``).
    """
    # object.__new__: FSDPModule.__new__ would re-run the original class's __init__ without args
    s = object.__new__(type(module))
    s.__dict__.update(module.__dict__)
    s._parameters = {n: None if p is None else cast(nn.Parameter, _meta_stand_in(p, True))
                     for n, p in module._parameters.items()}
    nonpersistent = module._non_persistent_buffers_set
    bufs: dict[str, torch.Tensor | None] = {}
    for n, b in module._buffers.items():
        if n in wanted:
            bufs[n] = wanted[n]
        elif b is None or b.is_meta or n not in nonpersistent:
            bufs[n] = None if b is None else _meta_stand_in(b, False)
        else:
            bufs[n] = b.detach().to("cpu", copy=True)
    s._buffers = bufs
    s._non_persistent_buffers_set = set(nonpersistent)
    s._modules = {n: None if c is None else _shadow(c, {}) for n, c in module._modules.items()}
    return s


def _written(shadow: nn.Module, name: str, holder: torch.Tensor, version: int) -> torch.Tensor | None:
    value = shadow._buffers.get(name)
    if value is None or not isinstance(value, torch.Tensor) or value.is_meta:
        return None
    if value is not holder or holder._version != version:
        return value
    # written through ``.data`` (no version bump): the NaN fill is gone
    if holder.dtype.is_floating_point and holder.numel() and not bool(holder.isnan().any()):
        return value
    return None


def _run_rule(module: nn.Module, names: list[str], fn: BufferInit, rule: str) -> Recomputed | str:
    """Run ``fn`` on a shadow of ``module``; the values of ``names``, or why the rule did not apply."""
    holders = {n: _placeholder(module._buffers[n]) for n in names}  # type: ignore[arg-type]  # names are registered (non-None) buffers
    versions = {n: h._version for n, h in holders.items()}
    shadow = _shadow(module, holders)
    try:
        with torch.no_grad(), torch.device("cpu"):
            fn(shadow)
    except Exception as e:  # noqa: BLE001 - reported (agreed on every rank by the caller)
        return f"{rule} raised {type(e).__name__}: {e}"
    values, unset = {}, []
    for n in names:
        value = _written(shadow, n, holders[n], versions[n])
        if value is None:
            unset.append(n)
            continue
        ref = module._buffers[n]
        values[n] = value.detach().to(dtype=ref.dtype)  # type: ignore[union-attr]  # a registered (non-None) buffer
    if unset:
        return f"{rule} left {unset} unset"
    for n in shadow._non_persistent_buffers_set - set(module._buffers):  # registered by the rule
        value = shadow._buffers.get(n)
        if isinstance(value, torch.Tensor) and not value.is_meta:
            values[n] = value.detach()
    attrs = {k: v for k, v in shadow.__dict__.items()
             if k not in _TORCH_DICTS and not isinstance(v, (torch.Tensor, nn.Module, dict, set))
             and (k not in module.__dict__ or module.__dict__[k] is not v)}
    if not names and not values:
        return f"{rule} registered no buffer"
    return Recomputed(rule, values, attrs)


def _hf_owner(model: nn.Module, mod_name: str) -> nn.Module | None:
    """The deepest transformers ``PreTrainedModel`` containing ``mod_name`` (itself included)."""
    mu = sys.modules.get("transformers.modeling_utils")  # never imported here: no HF model exists
    if mu is None:
        return None
    parts = mod_name.split(".") if mod_name else []
    for i in range(len(parts), -1, -1):
        try:
            candidate = model.get_submodule(".".join(parts[:i]))
        except AttributeError:
            continue
        if isinstance(candidate, mu.PreTrainedModel) and callable(getattr(candidate, "_init_weights", None)):
            return candidate
    return None


def _hf_rule(owner: nn.Module) -> BufferInit:
    init = sys.modules.get("transformers.initialization")
    guard = getattr(init, "guard_torch_init_functions", None)

    def run(shadow: nn.Module) -> None:
        with guard() if callable(guard) else nullcontext():
            owner._init_weights(shadow)  # type: ignore[operator]  # an HF PreTrainedModel method nn.Module does not declare

    return run


def _call_hook(module: nn.Module, name: str) -> None:
    getattr(module, name)()


def _rules(model: nn.Module, mod_name: str, module: nn.Module,
           init_buffers: BufferInit | None) -> list[tuple[str, BufferInit, bool]]:
    """(description, fn, explicit) in order of preference; an explicit rule that fails is final."""
    kind = type(module).__name__
    if init_buffers is not None:
        return [("init_buffers", init_buffers, True)]
    rules: list[tuple[str, BufferInit, bool]] = []
    for match, fn in reversed(list(REGISTRY.values())):
        if matches(match, module):
            rules.append((f"register_buffer_init's {getattr(fn, '__qualname__', fn)!s}", fn, True))
            break
    hook = next((h for h in BUFFER_INIT_HOOKS if callable(getattr(module, h, None))), None)
    if hook is not None:
        rules.append((f"{kind}.{hook}()", functools.partial(_call_hook, name=hook), False))
    owner = _hf_owner(model, mod_name)
    if owner is not None:
        rules.append((f"{type(owner).__name__}._init_weights", _hf_rule(owner), False))
    owns_params = any(p is not None for p in module._parameters.values())
    if not owns_params and callable(getattr(module, "reset_parameters", None)):
        rules.append((f"{kind}.reset_parameters()", functools.partial(_call_hook, name="reset_parameters"), False))
    return rules


def buffer_fqn(mod_name: str, name: str) -> str:
    return f"{mod_name}.{name}" if mod_name else name


def remedies(*, broadcast: bool) -> str:
    """The remedies that exist, for error messages (``broadcast``: mention rank 0's values)."""
    out = ("register one with fsdptk.register_buffer_init(<module class or predicate>, fn), "
           "pass init_buffers=fn to this call, or build the model under fsdptk.params_on_meta() "
           "so its buffers stay real")
    if broadcast:
        out += (", or give rank 0 real values and load with broadcast_from_rank0=True "
                "(they are then sent to the other ranks)")
    return out


def recompute(model: nn.Module, todo: Mapping[str, list[str]], init_buffers: BufferInit | None,
               ) -> tuple[dict[str, Recomputed], dict[str, str]]:
    """Values for every (module fqn -> meta buffer names) of ``todo``; nothing in ``model`` changes.

    Returns (module fqn -> values, module fqn -> why no rule applied). Local: no communication.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    done: dict[str, Recomputed] = {}
    failed: dict[str, str] = {}
    for mod_name, names in todo.items():
        module = modules[mod_name]
        tried: list[str] = []
        for rule, fn, explicit in _rules(model, mod_name, module, init_buffers):
            out = _run_rule(module, list(names), fn, rule)
            if isinstance(out, Recomputed):
                done[mod_name] = out
                break
            tried.append(out)
            if explicit:
                break
        else:
            tried = tried or [f"{type(module).__name__} has no rule ({', '.join(BUFFER_INIT_HOOKS)}, "
                              "reset_parameters, a transformers PreTrainedModel owner, a registration)"]
        if mod_name not in done:
            what = (f"non-persistent buffer(s) {[buffer_fqn(mod_name, n) for n in names]} are on meta"
                    if names else f"{mod_name or 'the root'} has is_cache_built=False")
            failed[mod_name] = f"{what}: {'; '.join(tried)}"
    return done, failed


def assign_recomputed(model: nn.Module, values: Mapping[str, Recomputed], device: torch.device) -> None:
    """Put recomputed values (and the attributes their rule set) into the real modules."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for mod_name, rec in values.items():
        module = modules[mod_name]
        for name, value in rec.buffers.items():
            if name in module._buffers:
                module._buffers[name] = value.to(device)
            else:  # a buffer the rule registered (torchtune's rope_init after a meta build)
                module.register_buffer(name, value.to(device), persistent=False)
        for key, value in rec.attrs.items():
            setattr(module, key, value)


def move_real_nonpersistent(model: nn.Module, device: torch.device) -> None:
    """Move real (not ``meta``) non-persistent buffers that live elsewhere to ``device``."""
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)


def meta_nonpersistent(model: nn.Module) -> dict[str, list[str]]:
    """module fqn -> names of its non-persistent buffers that are still on ``meta``.

    A module flagged ``is_cache_built = False`` that has one of :data:`BUFFER_INIT_HOOKS` is listed
    with no names: torchtune's ``Llama3ScaledRoPE.rope_init`` registers nothing on ``meta``.
    """
    out: dict[str, list[str]] = {}
    for mod_name, mod in model.named_modules():
        for name in sorted(getattr(mod, "_non_persistent_buffers_set", ())):
            buf = mod._buffers.get(name)
            if buf is not None and buf.is_meta:
                out.setdefault(mod_name, []).append(name)
        if mod.__dict__.get("is_cache_built") is False and any(
                callable(getattr(mod, h, None)) for h in BUFFER_INIT_HOOKS):
            out.setdefault(mod_name, [])
    return out


class BufferShape(NamedTuple):
    """A non-persistent buffer's shape and dtype on one rank (what rank 0 would send it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class BufferView(NamedTuple):
    """One rank's non-persistent buffers, exchanged with the load's metadata (``agree(extra=)``)."""

    meta: dict[str, list[str]]  # module fqn -> its buffers still on meta
    failed: dict[str, str]  # module fqn -> why no rule recomputed them
    shapes: dict[str, BufferShape]  # buffer fqn -> shape and dtype, every non-persistent buffer


def buffer_local(model: nn.Module, init_buffers: BufferInit | None) -> tuple[dict[str, Any], BufferView]:
    """This rank's recomputed meta non-persistent buffers, and its view to agree. Local only (on
    shadows: the model does not change); the view travels in the engine's metadata agreement
    (``agree(extra=...)``)."""
    mine = meta_nonpersistent(model)
    try:
        values, failed = recompute(model, mine, init_buffers)
    except Exception as e:  # noqa: BLE001 - agreed with the metadata, never left to one rank
        values, failed = {}, {m: f"recomputing raised {type(e).__name__}: {e}" for m in mine}
    # every non-persistent buffer's (shape, dtype): what rank 0 would send and each rank receive
    shapes = {buffer_fqn(mod_name, name): BufferShape(tuple(buf.shape), buf.dtype)
              for mod_name, mod in model.named_modules()
              for name in getattr(mod, "_non_persistent_buffers_set", ())
              if (buf := mod._buffers.get(name)) is not None}
    return values, BufferView(mine, failed, shapes)


def buffer_plan(model: nn.Module, broadcast_from_rank0: bool, init_buffers: BufferInit | None,
                 local: tuple[dict[str, Any], BufferView] | None = None, views: list[BufferView] | None = None,
                 ) -> tuple[dict[str, Any], list[str]]:
    """Decide, identically on every rank, how meta non-persistent buffers get their values.

    Each rank recomputes the values of its own meta buffers through the rules of
    :mod:`fsdptk.buffers` (:func:`buffer_local`); every rank's view (``views``: already agreed
    with the load's metadata, else one object all-gather here) then decides: a module no rule
    covers on some rank is sent from rank 0 when ``broadcast_from_rank0`` and rank 0 holds real
    values, else it is a ValueError raised on every rank, naming the buffers, why each rule did
    not apply and the remedies.

    Returns (module fqn -> recomputed values for this rank, fqns of buffers to send from rank 0).
    """
    world, _ = _world()
    values, view = local if local is not None else buffer_local(model, init_buffers)
    if views is None:
        views = all_gather_object(view) if world > 1 else [view]
    failures: dict[str, str] = {}
    for v in views:
        for mod_name, msg in v.failed.items():
            failures.setdefault(mod_name, msg)
    send, problems = [], []
    rank0_meta = views[0].meta
    for mod_name in sorted(failures):
        names = sorted({b for v in views for b in v.meta.get(mod_name, [])})
        rank0_real = not set(names) & set(rank0_meta.get(mod_name, []))
        if names and broadcast_from_rank0 and rank0_real and world > 1 and init_buffers is None:
            send += [buffer_fqn(mod_name, n) for n in names]
            values.pop(mod_name, None)  # every rank takes rank 0's values
        else:
            problems.append(("ValueError", f"{failures[mod_name]}. Remedies: "
                             f"{remedies(broadcast=True)}"))
    raise_problems(problems, "cannot initialise the non-persistent buffers")
    return values, send


def receive_buffers(model: nn.Module, fqns: list[str], device: torch.device, views: list[BufferView],
                     ) -> dict[str, torch.Tensor]:
    """Rank 0's real values of meta non-persistent buffers -> every rank (scattered by the engine).

    No second object exchange: every rank's buffer shapes and dtypes came with the load's one
    metadata exchange (``views``), so every rank checks them alike and builds the same plan.
    Returns fqn -> value; nothing is assigned here (the caller assigns once every transfer of the
    load has succeeded). The engine's generator is exhausted: its last steps wait for rank 0's
    sends (stopping early left them pending and hung the next collective).

    Raises:
        ValueError: on every rank, when a buffer's shape differs between ranks, a rank lacks it, or
            rank 0's floating values would go into an integer buffer (names the buffer and ranks).
    """
    if not fqns:
        return {}
    problems = []
    for fqn in fqns:
        found = [v.shapes.get(fqn) for v in views]
        absent = [r for r, s in enumerate(found) if s is None]
        if absent:
            problems.append(("ValueError", f"non-persistent buffer {fqn!r} is not registered on ranks {absent}"))
            continue
        seen = [s for s in found if s is not None]
        rank0 = seen[0]
        differ = [r for r, s in enumerate(seen) if s.shape != rank0.shape]
        if differ:
            problems.append(("ValueError", f"non-persistent buffer {fqn!r}: shape {list(rank0.shape)} on rank 0, "
                             f"{[list(seen[r].shape) for r in differ]} on ranks {differ}"))
        ints = [r for r, s in enumerate(seen) if rank0.dtype.is_floating_point and not s.dtype.is_floating_point]
        if ints:
            problems.append(("ValueError", f"non-persistent buffer {fqn!r}: cannot load rank 0's {rank0.dtype} into "
                             f"the {seen[ints[0]].dtype} buffer of ranks {ints}"))
    raise_problems(problems, "cannot send the non-persistent buffers from rank 0")
    modules = dict(model.named_modules())
    owners = [(modules[f.rpartition(".")[0]], f.rpartition(".")[2]) for f in fqns]
    targets = [(f, mod._buffers[n]) for f, (mod, n) in zip(fqns, owners)]
    source = dict(targets) if is_rank0() else {}
    metas = {f: TensorMeta(*views[0].shapes[f]) for f in fqns}
    plan = _engine.LoadPlan.replicated(targets, metas)
    return dict(_engine.distribute(plan, source, device=device))


def assign_buffers(model: nn.Module, received: Mapping[str, torch.Tensor]) -> None:
    modules = dict(model.named_modules())
    for fqn, value in received.items():
        mod_name, _, name = fqn.rpartition(".")
        modules[mod_name]._buffers[name] = value

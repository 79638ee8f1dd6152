"""Non-persistent buffers of models built on ``meta``: recompute them, or never lose them.

A non-persistent buffer (``register_buffer(..., persistent=False)``: RoPE tables, Gemma's embedding
scale, causal masks) is in no state dict, so no checkpoint restores it. A model built under
``torch.device("meta")`` has no values for them, and ``Module.to_empty`` fills them with
uninitialised memory. This module gives three ways out, all used by fsdptk's loaders:

- recompute them (:func:`materialize`, and every loader when they are still on ``meta``), for the
  owning module only, through the first rule that applies:

  1. the ``init_buffers=`` argument of the call;
  2. a function registered with :func:`register_buffer_init` (the most recent match);
  3. the module's own hook: the first of :data:`BUFFER_INIT_HOOKS` it has (torchtune's
     ``rope_init``, fsdptk.testing's ``reset_buffers``, ...);
  4. Hugging Face transformers' own path: the ``_init_weights`` of the ``PreTrainedModel`` that
     owns the module, which is how transformers initialises non-persistent buffers when it loads on
     ``meta`` (rotary ``inv_freq`` / ``original_inv_freq``, Gemma's ``embed_scale``);
  5. ``reset_parameters()`` of a module that owns no parameters of its own (the PyTorch convention).

  Every rule runs on a throw-away shallow copy of the module whose parameters and persistent buffers
  are parameter-less ``meta`` stand-ins, flagged as initialised for transformers: a rule can never
  redraw a parameter or touch a loaded value. It runs on CPU (under ``torch.device("cpu")``), as in
  a CPU-built model, so the values are bit-identical to the ones the constructor computes; they are
  cast to the buffer's dtype and moved to the target device afterwards. A rule "applies" when it
  writes every wanted buffer. An automatic rule (3 to 5) that raises or leaves one unset hands over
  to the next; an explicit one (1 or 2) is final: its failure is the error, naming its cause;
- keep them real: build under :func:`params_on_meta` (parameters on ``meta``, buffers computed as
  usual); the loaders then keep those values and move them to the target device;
- replace ``to_empty``: :func:`materialize` allocates a ``meta`` model on a device with zeros (never
  uninitialised memory) and recomputes its non-persistent buffers.
"""

from __future__ import annotations

import functools
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "BUFFER_INIT_HOOKS",
    "BufferInit",
    "register_buffer_init",
    "params_on_meta",
    "materialize",
]

#: Method names tried, in order, on a module whose non-persistent buffers are on ``meta``
#: (fsdptk.testing's ``reset_buffers``, torchtune's RoPE ``rope_init``, ...).
BUFFER_INIT_HOOKS = ("reset_buffers", "rope_init", "reset_rope", "init_buffers")

#: ``fn(module) -> None``: sets the module's non-persistent buffers (in place or by assignment).
BufferInit = Callable[[nn.Module], None]
_Match = type | tuple[type, ...] | Callable[[nn.Module], bool]

_REGISTRY: OrderedDict[int, tuple[_Match, BufferInit]] = OrderedDict()  # weakref-able for handles

# module attributes that are torch's bookkeeping, never copied back from a shadow
_TORCH_DICTS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                          "_is_hf_initialized"})


def register_buffer_init(match: _Match, fn: BufferInit) -> RemovableHandle:
    """Register how to compute the non-persistent buffers of a kind of module.

    Used by :func:`materialize` and every fsdptk loader when a module's non-persistent buffers are
    on ``meta`` (a registration wins over the module's own hooks and Hugging Face's init path; the
    ``init_buffers=`` argument of a call wins over a registration). The most recent matching
    registration is used. ``fn`` receives a stand-in of the module whose parameters are on
    ``meta``; it must set every non-persistent buffer that is on ``meta`` (assign
    ``module.name = tensor``, ``register_buffer(name, tensor, persistent=False)`` or write in place).

    Args:
        match: a module class (``isinstance`` match, so subclasses and FSDP-wrapped instances count),
            a tuple of classes, or a predicate ``(module) -> bool``.
        fn: ``fn(module) -> None``, run under ``torch.no_grad()`` and ``torch.device("cpu")``.

    Returns:
        torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters it.

    Raises:
        TypeError: ``fn`` is not callable, or ``match`` is neither a class, a tuple of classes nor
            a callable.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from fsdptk import register_buffer_init, materialize
        >>> class Mask(nn.Module):
        ...     def __init__(self, n):
        ...         super().__init__()
        ...         self.n = n
        ...         self.register_buffer("mask", torch.ones(n, n).tril().bool(), persistent=False)
        >>> handle = register_buffer_init(
        ...     Mask, lambda m: setattr(m, "mask", torch.ones(m.n, m.n).tril().bool()))
        >>> with torch.device("meta"):
        ...     m = Mask(3)
        >>> bool(materialize(m, "cpu").mask[2, 0]), bool(m.mask[0, 2])
        (True, False)
        >>> handle.remove()
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    ok_tuple = isinstance(match, tuple) and match and all(isinstance(t, type) for t in match)
    if not (isinstance(match, type) or ok_tuple or callable(match)):
        raise TypeError(f"match must be a module class, a tuple of classes or a predicate, got {match!r}")
    handle = RemovableHandle(_REGISTRY)
    _REGISTRY[handle.id] = (match, fn)
    return handle


def _matches(match: _Match, module: nn.Module) -> bool:
    if isinstance(match, (type, tuple)):
        return isinstance(module, match)
    return bool(match(module))


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Build models with parameters on ``meta`` and buffers real (the no-guesswork construction).

    In the spirit of accelerate's ``init_empty_weights(include_buffers=False)``: every parameter
    registered inside the block is replaced by a ``meta`` parameter of the same shape, dtype and
    ``requires_grad``, while buffers are computed by the constructor as usual (they are small), so
    no rule has to recompute them later. fsdptk's loaders keep those buffers and move them to the
    target device. A parameter is created where the constructor creates it (``torch.empty`` costs
    no memory until touched) and moved to ``meta`` at registration, so an initialiser that runs
    after registration (``reset_parameters`` of ``nn.Linear``, Hugging Face's ``post_init``) works on
    ``meta`` and costs nothing. Uses PyTorch's global parameter-registration hook (no patching);
    not thread-safe with models built concurrently in other threads.

    Returns:
        A context manager; nothing is bound by ``with ... as``.

    Example:
        >>> import torch
        >>> from fsdptk import params_on_meta
        >>> class Rotary(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("inv_freq", 1.0 / 10000 ** torch.arange(0, 1, 0.25),
        ...                              persistent=False)
        >>> with params_on_meta():
        ...     model = torch.nn.Sequential(torch.nn.Linear(4, 4), Rotary())
        >>> model[0].weight.is_meta, model[1].inv_freq.is_meta
        (True, False)
    """
    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None
        meta = torch.empty_like(param, device="meta")
        if type(param) is nn.Parameter:
            return nn.Parameter(meta, requires_grad=param.requires_grad)
        new = type(param)(meta, **param.__dict__)  # a Parameter subclass with extra state
        new.requires_grad_(param.requires_grad)
        return new

    # torch types the hook as returning None; a returned Parameter replaces the registered one
    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]  # returns a Parameter
    try:
        yield
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------------
# recomputation


@dataclass
class _Recomputed:
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


def _run_rule(module: nn.Module, names: list[str], fn: BufferInit, rule: str) -> _Recomputed | str:
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
    return _Recomputed(rule, values, attrs)


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
    for match, fn in reversed(list(_REGISTRY.values())):
        if _matches(match, module):
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


def _fqn(mod_name: str, name: str) -> str:
    return f"{mod_name}.{name}" if mod_name else name


def _remedies(*, broadcast: bool) -> str:
    """The remedies that exist, for error messages (``broadcast``: mention rank 0's values)."""
    out = ("register one with fsdptk.register_buffer_init(<module class or predicate>, fn), "
           "pass init_buffers=fn to this call, or build the model under fsdptk.params_on_meta() "
           "so its buffers stay real")
    if broadcast:
        out += (", or give rank 0 real values and load with broadcast_from_rank0=True "
                "(they are then sent to the other ranks)")
    return out


def _recompute(model: nn.Module, todo: Mapping[str, list[str]], init_buffers: BufferInit | None,
               ) -> tuple[dict[str, _Recomputed], dict[str, str]]:
    """Values for every (module fqn -> meta buffer names) of ``todo``; nothing in ``model`` changes.

    Returns (module fqn -> values, module fqn -> why no rule applied). Local: no communication.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    done: dict[str, _Recomputed] = {}
    failed: dict[str, str] = {}
    for mod_name, names in todo.items():
        module = modules[mod_name]
        tried: list[str] = []
        for rule, fn, explicit in _rules(model, mod_name, module, init_buffers):
            out = _run_rule(module, list(names), fn, rule)
            if isinstance(out, _Recomputed):
                done[mod_name] = out
                break
            tried.append(out)
            if explicit:
                break
        else:
            tried = tried or [f"{type(module).__name__} has no rule ({', '.join(BUFFER_INIT_HOOKS)}, "
                              "reset_parameters, a transformers PreTrainedModel owner, a registration)"]
        if mod_name not in done:
            what = (f"non-persistent buffer(s) {[_fqn(mod_name, n) for n in names]} are on meta"
                    if names else f"{mod_name or 'the root'} has is_cache_built=False")
            failed[mod_name] = f"{what}: {'; '.join(tried)}"
    return done, failed


def _assign(model: nn.Module, values: Mapping[str, _Recomputed], device: torch.device) -> None:
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


def _move_real_nonpersistent(model: nn.Module, device: torch.device) -> None:
    """Move real (not ``meta``) non-persistent buffers that live elsewhere to ``device``."""
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)


def _meta_nonpersistent(model: nn.Module) -> dict[str, list[str]]:
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


def materialize(
    model: nn.Module,
    device: torch.device | str,
    *,
    init_buffers: BufferInit | None = None,
) -> nn.Module:
    """Allocate a ``meta`` (or partly ``meta``, or FSDP2-sharded) model on ``device``, safely.

    The replacement for ``model.to_empty(device=...)``, which leaves uninitialised memory in every
    tensor, including the non-persistent buffers no checkpoint restores (silent garbage RoPE
    tables). Here every ``meta`` parameter and persistent buffer becomes zeros on ``device`` (to be
    overwritten by a load or your own initialisation), every real tensor is moved to ``device`` with
    its values, and every non-persistent buffer on ``meta`` is recomputed through the rules of
    :mod:`fsdptk.buffers` (``init_buffers``, :func:`register_buffer_init`, the module's own hook,
    Hugging Face's init path, ``reset_parameters`` of a parameter-less module). The buffers are
    computed before anything changes: on error the model is untouched. No communication: call it
    on every rank (every rank computes the same values). FSDP2-sharded parameters stay sharded
    (their local shards are allocated, through ``nn.Module._apply`` as ``to_empty`` does).

    You rarely need it before a load: fsdptk's loaders accept a ``meta`` model and allocate only
    the shards they fill. Use it before your own initialisation (training from scratch) or before
    a loader that needs a materialised model (``load_dcp``).

    Args:
        model: the model (built under ``torch.device("meta")``, sharded or not).
        device: where to allocate (e.g. ``torch.device("cuda", local_rank)``).
        init_buffers: ``fn(module)`` computing a module's non-persistent buffers, overriding every
            other rule (see :func:`register_buffer_init` for what ``fn`` receives).

    Returns:
        nn.Module: ``model`` itself, materialised in place.

    Raises:
        ValueError: a non-persistent buffer on ``meta`` that no rule can compute; names every such
            buffer, why each rule did not apply, and the remedies; nothing is changed.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from fsdptk import materialize
        >>> class Rotary(nn.Module):  # FSDP2-article style: no parameters, tables in buffers
        ...     def __init__(self, dim):
        ...         super().__init__()
        ...         self.dim = dim
        ...         self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        ...         self.reset_parameters()
        ...     def reset_parameters(self):
        ...         self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, self.dim, 2) / self.dim))
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(nn.Linear(4, 4), Rotary(4))
        >>> _ = materialize(model, "cpu")
        >>> torch.equal(model[1].inv_freq, Rotary(4).inv_freq), model[0].weight.abs().sum().item()
        (True, 0.0)
    """
    device = torch.device(device)
    from fsdptk._core.dist import raise_problems as _raise

    todo = _meta_nonpersistent(model)
    values, failed = _recompute(model, todo, init_buffers)
    problems = [("ValueError", f"{msg}. Remedies: {_remedies(broadcast=False)}")
                for msg in failed.values()]
    _raise(problems, "cannot initialise the non-persistent buffers")

    def alloc(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t, device=device) if t.is_meta else t.to(device)

    with torch.no_grad():
        model._apply(alloc)
    _assign(model, values, device)
    return model

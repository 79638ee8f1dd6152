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

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdptk._plans.buffers import (
    BUFFER_INIT_HOOKS,
    REGISTRY,
    BufferInit,
    Match,
    assign_recomputed,
    meta_nonpersistent,
    recompute,
    remedies,
)

__all__ = [
    "BUFFER_INIT_HOOKS",
    "BufferInit",
    "register_buffer_init",
    "params_on_meta",
    "materialize",
]

def register_buffer_init(match: Match, fn: BufferInit) -> RemovableHandle:
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

    Examples:
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
    handle = RemovableHandle(REGISTRY)
    REGISTRY[handle.id] = (match, fn)
    return handle


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

    Examples:
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

    Examples:
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

    todo = meta_nonpersistent(model)
    values, failed = recompute(model, todo, init_buffers)
    problems = [("ValueError", f"{msg}. Remedies: {remedies(broadcast=False)}")
                for msg in failed.values()]
    _raise(problems, "cannot initialise the non-persistent buffers")

    def alloc(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t, device=device) if t.is_meta else t.to(device)

    with torch.no_grad():
        model._apply(alloc)
    assign_recomputed(model, values, device)
    return model

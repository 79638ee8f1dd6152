"""Shard conditions: small ``(name, module) -> bool`` callables that pick FSDP units (or AC regions).

``name`` is the module's fully qualified name in the model (``""`` for the root), ``module`` the
module itself. :func:`get_shard_conditions` is torchtune's rule, with its signature. The factories
return :class:`Predicate` objects: callables with a readable ``repr`` (a sharding plan prints which
rule matched a unit) that compose with ``|``, ``&`` and ``~`` as well as :func:`any_of`,
:func:`all_of` and :func:`not_`. Any plain function ``(name, module) -> bool`` is accepted wherever a
predicate is.

Names are "clean": :func:`fsdptk.shard_model`, :func:`fsdptk.describe_sharding` and
:func:`fsdptk.apply_activation_checkpointing` strip wrapper prefixes (``_checkpoint_wrapped_module.``,
``_orig_mod.``, ``_fsdp_wrapped_module.``) before asking a predicate, and hand it the wrapped module,
so the same predicate works before and after activation checkpointing or ``torch.compile``.

Examples:
    >>> from torch import nn
    >>> from fsdptk.predicates import by_type, layers, by_glob
    >>> cond = layers() | by_type(nn.Embedding) | by_glob("output*")
    >>> cond
    any_of(layers('layers'), by_type(Embedding), by_glob('output*'))
    >>> cond("model.layers.3", nn.Linear(2, 2)), cond("model.layers.3.mlp", nn.Linear(2, 2))
    (True, False)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from torch import nn

from fsdptk._core.names import clean_fqn

__all__ = [
    "get_shard_conditions",
    "Predicate",
    "ShardCondition",
    "by_name",
    "by_glob",
    "by_type",
    "layers",
    "any_of",
    "all_of",
    "not_",
    "no_split_modules",
    "clean_fqn",
    "describe_predicate",
]

ShardCondition = Callable[[str, nn.Module], bool]

def get_shard_conditions(
    name: str,
    module: nn.Module,
    names_to_match: list[str] | None = None,
    *args: Any,
    **kwargs: Any,
) -> bool:
    """torchtune's default shard condition: ``...layers.<i>`` or an exact name in ``names_to_match``.

    Args:
        name: the module's fully qualified name.
        module: the module (unused; part of the condition signature).
        names_to_match: exact FQNs that also match (e.g. ``["tok_embeddings", "output"]``).
        *args: ignored (torchtune compatibility).
        **kwargs: ignored (torchtune compatibility).

    Returns:
        bool: whether ``name`` is in ``names_to_match`` or its last two components are
        ``layers`` and an integer.

    Examples:
        >>> from torch import nn
        >>> get_shard_conditions("decoder.layers.11", nn.Identity())
        True
        >>> get_shard_conditions("tok_embeddings", nn.Identity(), ["tok_embeddings"])
        True
        >>> get_shard_conditions("decoder.layers.11.attn", nn.Identity())
        False
    """
    if names_to_match and name in names_to_match:
        return True
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit()


def describe_predicate(pred: Callable[..., Any]) -> str:
    """A short readable description of any predicate: its ``repr`` or the function's name.

    Args:
        pred: a :class:`Predicate`, a function, a ``functools.partial`` or any callable.

    Returns:
        str: e.g. ``"by_type(Linear)"``, ``"get_shard_conditions"``,
        ``"partial(get_shard_conditions, names_to_match=['output'])"``.

    Examples:
        >>> describe_predicate(get_shard_conditions)
        'get_shard_conditions'
    """
    if isinstance(pred, Predicate):
        return repr(pred)
    func = getattr(pred, "func", None)
    if func is not None and hasattr(pred, "keywords"):  # functools.partial
        parts = [describe_predicate(func)]
        parts += [repr(a) for a in getattr(pred, "args", ())]
        parts += [f"{k}={v!r}" for k, v in pred.keywords.items()]
        return f"partial({', '.join(parts)})"
    qual = getattr(pred, "__qualname__", None) or getattr(pred, "__name__", None)
    return qual if qual else repr(pred)


class Predicate:
    """A named ``(name, module) -> bool`` callable that composes with ``|``, ``&`` and ``~``.

    Args:
        fn: the test itself.
        text: its ``repr`` (how a plan prints the rule).

    Examples:
        >>> from torch import nn
        >>> p = Predicate(lambda name, m: name.endswith("proj"), "endswith('proj')")
        >>> (~p)("attn.out_proj", nn.Identity()), repr(~p)
        (False, "not_(endswith('proj'))")
    """

    __slots__ = ("_fn", "_text", "parts")

    def __init__(self, fn: ShardCondition, text: str, parts: tuple[Any, ...] = ()) -> None:
        self._fn = fn
        self._text = text
        self.parts = parts

    def __call__(self, name: str, module: nn.Module) -> bool:
        return bool(self._fn(name, module))

    def __repr__(self) -> str:
        return self._text

    def __or__(self, other: ShardCondition) -> Predicate:
        return any_of(self, other)

    def __ror__(self, other: ShardCondition) -> Predicate:
        return any_of(other, self)

    def __and__(self, other: ShardCondition) -> Predicate:
        return all_of(self, other)

    def __rand__(self, other: ShardCondition) -> Predicate:
        return all_of(other, self)

    def __invert__(self) -> Predicate:
        return not_(self)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable when fn is
        return (Predicate, (self._fn, self._text, self.parts))


def _flat_strings(values: Iterable[Any], what: str) -> tuple[str, ...]:
    out: list[str] = []
    for v in values:
        items = [v] if isinstance(v, str) or not isinstance(v, Iterable) else list(v)
        for item in items:
            if not isinstance(item, str):
                raise TypeError(f"{what} expects strings, got {type(item).__name__} ({item!r})")
            out.append(item)
    if not out:
        raise ValueError(f"{what} needs at least one name")
    return tuple(out)


def _args(values: tuple[Any, ...]) -> str:
    return ", ".join(repr(v) for v in values)


# module-level tests bound with functools.partial: predicates stay picklable without closures
def _names(names: frozenset[str], name: str, module: nn.Module) -> bool:
    return name in names


def _globs(patterns: tuple[str, ...], name: str, module: nn.Module) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _types(types: tuple[type, ...], name: str, module: nn.Module) -> bool:
    return isinstance(module, types)


def _class_names(names: frozenset[str], name: str, module: nn.Module) -> bool:
    # by name over the MRO: subclasses match (as isinstance), and so do FSDP2's ``FSDP<Cls>`` classes
    return any(c.__name__ in names for c in type(module).__mro__)


def _layers(containers: frozenset[str], name: str, module: nn.Module) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in containers and parts[-1].isdigit()


def _any(preds: tuple[ShardCondition, ...], name: str, module: nn.Module) -> bool:
    return any(p(name, module) for p in preds)


def _all(preds: tuple[ShardCondition, ...], name: str, module: nn.Module) -> bool:
    return all(p(name, module) for p in preds)


def _not(pred: ShardCondition, name: str, module: nn.Module) -> bool:
    return not pred(name, module)


def by_name(*names: str | Iterable[str]) -> Predicate:
    """Match modules whose FQN is exactly one of ``names``.

    Args:
        *names: FQNs (strings or iterables of strings).

    Returns:
        Predicate: ``by_name('tok_embeddings', 'output')``.

    Raises:
        TypeError: when a name is not a string.
        ValueError: when no name is given.

    Examples:
        >>> from torch import nn
        >>> by_name("output")("output", nn.Identity()), by_name("output")("x.output", nn.Identity())
        (True, False)
    """
    flat = _flat_strings(names, "by_name")
    return Predicate(partial(_names, frozenset(flat)), f"by_name({_args(flat)})")


def by_glob(*patterns: str | Iterable[str]) -> Predicate:
    """Match modules whose FQN matches a shell-style glob (``fnmatch``, case-sensitive).

    ``*`` also crosses dots: ``"*.attn"`` matches ``"layers.0.attn"``.

    Args:
        *patterns: glob patterns such as ``"layers.*"``, ``"*.mlp"``, ``"encoder.blocks.[0-3]"``.

    Returns:
        Predicate: ``by_glob('*.mlp')``.

    Raises:
        TypeError: when a pattern is not a string.
        ValueError: when no pattern is given.

    Examples:
        >>> from torch import nn
        >>> by_glob("*.mlp")("layers.0.mlp", nn.Identity())
        True
    """
    flat = _flat_strings(patterns, "by_glob")
    return Predicate(partial(_globs, flat), f"by_glob({_args(flat)})")


def by_type(*types: type | Iterable[type]) -> Predicate:
    """Match modules that are instances of any of ``types`` (``isinstance``).

    Args:
        *types: ``nn.Module`` subclasses (or iterables of them).

    Returns:
        Predicate: ``by_type(TransformerBlock, Embedding)``.

    Raises:
        TypeError: when an entry is not an ``nn.Module`` subclass.
        ValueError: when no type is given.

    Examples:
        >>> from torch import nn
        >>> by_type(nn.Linear)("proj", nn.Linear(2, 2))
        True
    """
    flat: list[type] = []
    for t in types:
        items = [t] if isinstance(t, type) or not isinstance(t, Iterable) else list(t)
        for item in items:
            if not (isinstance(item, type) and issubclass(item, nn.Module)):
                raise TypeError(f"by_type expects nn.Module subclasses, got {item!r}")
            flat.append(item)
    if not flat:
        raise ValueError("by_type needs at least one type")
    text = ", ".join(t.__name__ for t in flat)
    return Predicate(partial(_types, tuple(flat)), f"by_type({text})")


def layers(*containers: str) -> Predicate:
    """Match ``<...>.<container>.<i>``: the items of a layer list (torchtune's rule, any names).

    Args:
        *containers: names of the ``ModuleList`` / ``Sequential`` attributes (default ``"layers"``).

    Returns:
        Predicate: ``layers('layers')``.

    Examples:
        >>> from torch import nn
        >>> layers()("decoder.layers.2", nn.Identity()), layers("blocks", "h")("h.0", nn.Identity())
        (True, True)
    """
    flat = _flat_strings(containers or ("layers",), "layers")
    return Predicate(partial(_layers, frozenset(flat)), f"layers({_args(flat)})")


def _declared_no_split(model: nn.Module) -> list[str]:
    """Class names in ``_no_split_modules`` over the model's sub-models, sorted (transformers' walk:
    every sub-model's declaration counts; no descent into a module whose class is declared)."""
    found: set[str] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if type(module).__name__ in found:
            continue
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            found.update([declared] if isinstance(declared, str) else declared)
        stack.extend(module.children())
    return sorted(found)


def no_split_modules(model: nn.Module) -> Predicate:
    """Match the classes a model declares in ``_no_split_modules`` (its decoder layers): the FSDP
    units that transformers / accelerate pick for auto-wrapping.

    The names are gathered over the model's sub-models (as transformers does) and matched against
    the class names of each module's type and its bases, so subclasses and the ``FSDP<Class>``
    types that ``fully_shard`` creates match too. The predicate only holds the
    names: it is picklable and can be built on one rank's (meta) model and used on another's.

    Args:
        model: the model, usually a transformers ``PreTrainedModel`` built on ``meta``.

    Returns:
        Predicate: ``no_split_modules(LlamaDecoderLayer)``.

    Raises:
        TypeError: when ``model`` is not an ``nn.Module``.
        ValueError: when the model declares no ``_no_split_modules``, or declares classes of which
            it holds no instance (both messages name the model's class).

    Examples:
        >>> from torch import nn
        >>> class Block(nn.Linear): ...
        >>> class Net(nn.Sequential):
        ...     _no_split_modules = ["Block"]
        >>> cond = no_split_modules(Net(Block(2, 2), nn.ReLU()))
        >>> cond, cond("0", Block(2, 2)), cond("1", nn.ReLU())
        (no_split_modules(Block), True, False)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"no_split_modules expects the model (an nn.Module), got "
                        f"{type(model).__name__}")
    names = _declared_no_split(model)
    kind = type(model).__name__
    if not names:
        raise ValueError(
            f"{kind} declares no _no_split_modules (nor does any of its sub-models): name its "
            "repeated blocks instead, e.g. fsdptk.predicates.by_type(DecoderLayer) or layers()")
    test = partial(_class_names, frozenset(names))
    if not any(test(n, m) for n, m in model.named_modules() if n):
        raise ValueError(f"{kind} declares _no_split_modules {names} but holds no module of those "
                         "classes: pass the classes of its repeated blocks with by_type(...)")
    return Predicate(test, f"no_split_modules({', '.join(names)})")


def _check_callable(preds: tuple[Any, ...], what: str) -> None:
    if not preds:
        raise ValueError(f"{what} needs at least one predicate")
    for p in preds:
        if not callable(p):
            raise TypeError(f"{what} expects callables (name, module) -> bool, got {p!r}")


def _combine(preds: tuple[Any, ...], kind: Callable[..., bool], what: str) -> Predicate:
    """``any_of`` / ``all_of``: checked, nested calls of the same kind flattened, described."""
    _check_callable(preds, what)
    flat = _flatten(preds, kind)
    text = ", ".join(describe_predicate(p) for p in flat)
    return Predicate(partial(kind, flat), f"{what}({text})", flat)


def _flatten(preds: tuple[Any, ...], kind: Callable[..., bool]) -> tuple[Any, ...]:
    out: list[Any] = []
    for p in preds:
        fn = p._fn if isinstance(p, Predicate) else None
        if isinstance(fn, partial) and fn.func is kind:
            out.extend(fn.args[0])
        else:
            out.append(p)
    return tuple(out)


def any_of(*preds: ShardCondition) -> Predicate:
    """True when any of ``preds`` is (short-circuit, left to right).

    Args:
        *preds: predicates or plain ``(name, module) -> bool`` functions.

    Returns:
        Predicate: ``any_of(...)``; nested ``any_of`` calls are flattened.

    Raises:
        TypeError: when an entry is not callable.
        ValueError: when no predicate is given.

    Examples:
        >>> from torch import nn
        >>> any_of(by_name("a"), by_name("b"))("b", nn.Identity())
        True
    """
    return _combine(preds, _any, "any_of")


def all_of(*preds: ShardCondition) -> Predicate:
    """True when every one of ``preds`` is (short-circuit, left to right).

    Args:
        *preds: predicates or plain ``(name, module) -> bool`` functions.

    Returns:
        Predicate: ``all_of(...)``; nested ``all_of`` calls are flattened.

    Raises:
        TypeError: when an entry is not callable.
        ValueError: when no predicate is given.

    Examples:
        >>> from torch import nn
        >>> all_of(layers(), by_type(nn.Linear))("layers.0", nn.Identity())
        False
    """
    return _combine(preds, _all, "all_of")


def not_(pred: ShardCondition) -> Predicate:
    """Negate a predicate.

    Args:
        pred: a predicate or plain ``(name, module) -> bool`` function.

    Returns:
        Predicate: ``not_(...)``.

    Raises:
        TypeError: when ``pred`` is not callable.

    Examples:
        >>> from torch import nn
        >>> not_(by_type(nn.Linear))("x", nn.Linear(1, 1))
        False
    """
    _check_callable((pred,), "not_")
    return Predicate(partial(_not, pred), f"not_({describe_predicate(pred)})", (pred,))

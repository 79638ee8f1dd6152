"""Checkpoint layouts: read a checkpoint whose keys and tensors are not the model's own.

Checkpoints on the Hub often store a model tensor as several tensors (a Mixture-of-Experts layer
keeps one tensor per expert, the model one fused 3-D tensor), under other names, or transposed.
fsdptk reads them through a conversion: declarative rules, each with its inverse, planned per
shard, so a rank reads only the checkpoint tensors and slices its own shard covers (docs/layouts.md).

- For transformers models the rules are transformers' own (``conversion=\"auto\"``, the default of
  :func:`fsdptk.load_safetensors` and :func:`fsdptk.save_safetensors`): every family transformers
  converts (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4.5, OLMoE, ...) loads from its Hub layout
  and saves back to it.
- For any other model, declare the rules: :class:`Rename` (one key pattern to another) and
  :class:`Convert` (several checkpoint tensors into one model tensor, or one into several, through
  a list of operations: :class:`Stack`, :class:`Concat`, :class:`Chunk`, :class:`Transpose`,
  :class:`Transform`), gathered in a :class:`Conversion`.

Patterns are whole keys in which ``*`` stands for one dotted name segment (a layer number, a module
name) and ``#`` for the index of tensors that a :class:`Stack` stacks (an expert number). A
``Convert`` target holds the same ``*`` segments as its sources, in the same order, and no ``#``.

Examples:
    >>> import torch
    >>> conv = Conversion(
    ...     Rename("model.layers.*.attn.wq", "layers.*.attention.q"),
    ...     Convert(["layers.*.experts.#.w1", "layers.*.experts.#.w3"], "layers.*.moe.w13",
    ...             [Stack(0), Concat(1)]))
    >>> metas = {f"layers.0.experts.{e}.w{i}": ((4, 8), torch.float32) for e in range(2) for i in (1, 3)}
    >>> metas["model.layers.0.attn.wq"] = ((8, 8), torch.float32)
    >>> {k: n.shape for k, n in conv.nodes(metas).items()}
    {'layers.0.attention.q': (8, 8), 'layers.0.moe.w13': (2, 8, 8)}
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from fsdptk._engine.sources.convert import (
    Chunk,
    Concat,
    ConversionProblem,
    Leaf,
    Node,
    Op,
    Stack,
    Transform,
    Transpose,
    apply_ops,
)
from fsdptk.errors import ConversionError

__all__ = ["Conversion", "Rename", "Convert", "Stack", "Concat", "Chunk", "Transpose", "Transform",
           "ConversionArg"]


def _regex(pattern: str) -> re.Pattern[str]:
    out = []
    for part in re.split(r"([*#])", pattern):
        if part == "*":
            out.append(r"([^.]+)")
        elif part == "#":
            out.append(r"(?P<index>\d+)")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def _fill(pattern: str, captures: Sequence[str]) -> str:
    it = iter(captures)
    return re.sub(r"\*", lambda _m: next(it), pattern)


@dataclass(frozen=True)
class Rename:
    """Checkpoint key pattern ``source`` is model key pattern ``target`` (``*`` segments carried
    over in order). Its inverse is the swap.

    Examples:
        >>> Rename("model.layers.*.mlp.up_proj.weight", "layers.*.mlp.w3.weight").source
        'model.layers.*.mlp.up_proj.weight'
    """

    source: str
    target: str

    def __post_init__(self) -> None:
        if self.source.count("*") != self.target.count("*") or "#" in self.source + self.target:
            raise ValueError(f"Rename({self.source!r}, {self.target!r}): both patterns need the same "
                             "number of '*' segments and no '#'")


@dataclass(frozen=True, init=False)
class Convert:
    """Checkpoint tensors matching ``sources`` become the model tensor(s) ``targets`` through
    ``ops`` (applied in order to ``{source pattern: [tensors in '#' order]}``).

    Args:
        sources: one pattern or several (their tensors are combined in this order).
        targets: one pattern or several (a :class:`Chunk` reads one tensor as several).
        ops: the operations, e.g. ``[Stack(0), Concat(1)]`` for per-expert gate and up
            projections into one fused ``gate_up`` tensor.

    Examples:
        >>> Convert("layers.*.experts.#.w2", "layers.*.moe.w2", [Stack(0)]).targets
        ('layers.*.moe.w2',)
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    ops: tuple[Op, ...]

    def __init__(self, sources: str | Sequence[str], targets: str | Sequence[str], ops: Sequence[Op]) -> None:
        srcs = (sources,) if isinstance(sources, str) else tuple(sources)
        tgts = (targets,) if isinstance(targets, str) else tuple(targets)
        if not srcs or not tgts or not ops:
            raise ValueError("Convert needs at least one source, one target and one operation")
        if any(not isinstance(op, Op) for op in ops):
            raise TypeError(f"Convert ops must be fsdptk.conversions operations, got {list(ops)}")
        stars = {p.count("*") for p in srcs + tgts}
        if len(stars) != 1 or any("#" in t for t in tgts):
            raise ValueError(f"Convert({list(srcs)} -> {list(tgts)}): every pattern needs the same number "
                             "of '*' segments, and targets no '#'")
        object.__setattr__(self, "sources", srcs)
        object.__setattr__(self, "targets", tgts)
        object.__setattr__(self, "ops", tuple(ops))


class Conversion:
    """An ordered set of rules: how a checkpoint's tensors are read as a model's.

    A checkpoint key is read by the first :class:`Convert` one of whose sources matches it, else
    renamed by the first matching :class:`Rename`, else read as it is.

    Examples:
        >>> Conversion(Rename("tok.weight", "embed.weight")).nodes({"tok.weight": ((4, 2), None)})["embed.weight"].key
        'tok.weight'
    """

    def __init__(self, *rules: Rename | Convert) -> None:
        for r in rules:
            if not isinstance(r, (Rename, Convert)):
                raise TypeError(f"Conversion takes Rename and Convert rules, got {type(r).__name__} ({r!r})")
        self.rules = rules
        self._renames = [(_regex(r.source), r) for r in rules if isinstance(r, Rename)]
        self._converts = [(i, j, _regex(p), r) for i, r in enumerate(rules) if isinstance(r, Convert)
                          for j, p in enumerate(r.sources)]

    def __repr__(self) -> str:
        return f"Conversion({', '.join(map(repr, self.rules))})"

    def nodes(self, metas: Mapping[str, tuple[Sequence[int], Any] | Any]) -> dict[str, Node]:
        """Model key -> its node over the checkpoint ``metas`` (key -> ``(shape, dtype)`` or a
        ``TensorMeta``), in checkpoint order.

        Raises:
            ConversionError: two checkpoint keys for one model key; a gap in the ``#`` indices (the
                missing key named); tensors that do not stack or concatenate (both shapes named);
                a :class:`Transform` whose forward, run on a ``meta`` tensor, returns another shape
                or dtype than it declares (the model key and both shapes named; a forward that
                cannot run on ``meta`` is checked on every read instead).
        """
        try:
            return self._nodes(metas)
        except ConversionProblem as e:
            raise ConversionError(str(e)) from None

    def _nodes(self, metas: Mapping[str, tuple[Sequence[int], Any] | Any]) -> dict[str, Node]:
        out: dict[str, Node] = {}
        origin: dict[str, str] = {}
        groups: dict[tuple[int, tuple[str, ...]], dict[str, list[tuple[int, Leaf]]]] = {}

        def add(target: str, node: Node, key: str) -> None:
            if target in origin:
                raise ConversionProblem(f"checkpoint keys {origin[target]!r} and {key!r} both load into {target!r}")
            origin[target] = key
            out[target] = node

        for key, meta in metas.items():
            m: Any = meta
            shape, dtype = (m.shape, m.dtype) if hasattr(m, "shape") else tuple(m)
            leaf = Leaf(key, tuple(int(n) for n in shape), dtype)
            for i, j, rx, rule in self._converts:
                m = rx.fullmatch(key)
                if m is not None:
                    caps = tuple(g for n, g in enumerate(m.groups(), 1) if n != rx.groupindex.get("index"))
                    index = int(m.group("index")) if "index" in rx.groupindex else 0
                    groups.setdefault((i, caps), {}).setdefault(rule.sources[j], []).append((index, leaf))
                    break
            else:
                for rx, ren in self._renames:
                    m = rx.fullmatch(key)
                    if m is not None:
                        add(_fill(ren.target, m.groups()), leaf, key)
                        break
                else:
                    add(key, leaf, key)
        for (i, caps), inputs in groups.items():
            rule = cast(Convert, self.rules[i])
            ordered: dict[str, list[Node]] = {}
            for pattern in rule.sources:
                got = sorted(inputs.get(pattern, []), key=lambda t: t[0])
                if "#" in pattern:
                    have = {ix for ix, _ in got}
                    count = max([ix + 1 for ix in have] + [len(v) for v in inputs.values()])
                    lack = [_fill(pattern, caps).replace("#", str(ix)) for ix in range(count) if ix not in have]
                    if lack:
                        raise ConversionProblem(f"{_fill(rule.targets[0], caps)!r} is stacked from {count} "
                                              f"tensors; the checkpoint lacks {lack[:8]}")
                elif not got:
                    raise ConversionProblem(f"{_fill(rule.targets[0], caps)!r} needs "
                                          f"{_fill(pattern, caps)!r}, which the checkpoint lacks")
                ordered[pattern] = [leaf for _, leaf in got]
            try:
                built = apply_ops(rule.ops, ordered, rule.sources, rule.targets)
            except ConversionProblem as e:
                keys = [_fill(t, caps) for t in rule.targets]
                raise ConversionProblem(f"model key {keys[0]!r}: {e}" if len(keys) == 1
                                        else f"model keys {keys}: {e}") from None
            for target, node in built.items():
                add(_fill(target, caps), node, node.files()[0])
        return out


ConversionArg = Literal["auto"] | Conversion | None
"""What the file functions take as ``conversion``: ``"auto"`` (transformers' own rules for a
transformers model, none for any other), a :class:`Conversion`, or ``None`` (keys as they are)."""


def resolve_load(model: Any, conversion: ConversionArg, metas: Mapping[str, Any], *,
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Node] | None:
    """Model key -> node for a load of ``metas`` into ``model``; ``None`` reads keys as they are.
    ``shapes``: the model's keys and shapes when not its own ``state_dict``'s (a PEFT model's base
    model under the base checkpoint's keys)."""
    if conversion is None:
        return None
    if isinstance(conversion, Conversion):
        return conversion.nodes(metas)
    if conversion != "auto":
        raise TypeError(f"conversion must be 'auto', a fsdptk.conversions.Conversion or None, got {conversion!r}")
    from fsdptk._plans.hf_convert import hub_nodes, is_hf_model

    if not is_hf_model(model):
        return None
    from fsdptk._engine.sources import TensorMeta
    from fsdptk._plans.hf_convert import quantization

    as_metas = {k: m if isinstance(m, TensorMeta) else TensorMeta(tuple(m[0]), m[1]) for k, m in metas.items()}
    own = dict(shapes) if shapes is not None else {k: tuple(t.shape) for k, t in model.state_dict(keep_vars=True).items()}
    if quantization(model) is None and all(tuple(m.shape) == own.get(k) for k, m in as_metas.items()):
        # every checkpoint tensor is a model tensor of its shape: nothing to convert, and no need for
        # transformers' rule table (building it compiles every family's patterns: 0.16 s once per
        # process); a model key of another shape may be one transformers transposes (check_dims)
        return None
    try:
        return hub_nodes(model, as_metas, shapes=own)
    except ConversionProblem as e:
        raise ConversionError(str(e)) from None

"""Tensor-parallel plans built from rules over module FQNs, and a ready rule set for Llama blocks.

A plan is what ``parallelize_module`` (or :func:`fsdptk.apply_tp`) takes: ``{fqn: ParallelStyle}``.
Writing one by hand means listing every layer; :func:`build_tp_plan` builds it from ordered rules
(a glob over the FQN, or a ``(name, module) -> bool`` predicate such as those in
``fsdptk.predicates``), and :func:`llama_tp_plan` knows Llama-style blocks under both naming
schemes (Meta/torchtitan ``wq/wk/wv/wo/w1/w2/w3``, Hugging Face ``q_proj/.../down_proj``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor import (
    Replicate,
    Shard,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from fsdptk._plans.tp_styles import GatherSequence, ReplicatedKVColwise, is_norm

__all__ = ["build_tp_plan", "llama_tp_plan", "ReplicatedKVColwise", "GatherSequence", "LLAMA_NAMES"]

Pattern = str | Callable[[str, nn.Module], bool]

# role -> leaf names, for Llama-style blocks (Meta/torchtitan, torchtune, Hugging Face)
LLAMA_NAMES: dict[str, tuple[str, ...]] = {
    "q": ("wq", "q_proj"),
    "k": ("wk", "k_proj"),
    "v": ("wv", "v_proj"),
    "o": ("wo", "o_proj", "output_proj"),
    "gate": ("w1", "gate_proj"),
    "up": ("w3", "up_proj"),
    "down": ("w2", "down_proj"),
    "embedding": ("tok_embeddings", "embed_tokens"),
    "output": ("output", "lm_head"),
}


def _describe(pattern: Pattern) -> str:
    if isinstance(pattern, str):
        return repr(pattern)
    return getattr(pattern, "__name__", repr(pattern))


def _matches(pattern: Pattern, fqn: str, module: nn.Module) -> bool:
    if isinstance(pattern, str):
        return fnmatchcase(fqn, pattern)
    return bool(pattern(fqn, module))


def build_tp_plan(
    model: nn.Module,
    rules: Mapping[str, ParallelStyle] | Iterable[tuple[Pattern, ParallelStyle]],
    *,
    allow_unmatched: bool = False,
) -> dict[str, ParallelStyle]:
    """Build a ``parallelize_module`` plan (exact FQN -> style) from ordered rules.

    Each module of ``model`` (the root is ``""``) gets the style of the FIRST rule that matches
    it; later rules never override. A string pattern is an ``fnmatch`` glob over the whole FQN
    (``*`` also crosses dots: ``"*.wq"`` matches ``"layers.3.attention.wq"``); a callable is a
    predicate ``(fqn, module) -> bool``. One style object may serve many modules (as
    ``parallelize_module``'s own wildcards do).

    Args:
        model: the model the plan is for (only read).
        rules: ``{pattern: style}`` or a sequence of ``(pattern_or_predicate, style)``.
        allow_unmatched: accept rules that match no module instead of raising.

    Returns:
        dict[str, ParallelStyle]: plan keyed by exact FQN, in ``named_modules`` order.

    Raises:
        TypeError: if a style is not a ParallelStyle or a pattern is neither str nor callable.
        ValueError: if a rule matches no module (naming the rule and some FQNs) and
            ``allow_unmatched`` is False.

    Examples:
        >>> plan = build_tp_plan(model, [("*.wq", ColwiseParallel()), ("*.wo", RowwiseParallel())])  # needs a TP process group; tests/test_tp.py runs it  # doctest: +SKIP
        >>> apply_tp(model, mesh["tp"], plan)  # needs a TP process group; tests/test_tp.py runs it  # doctest: +SKIP
    """
    pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    for pattern, style in pairs:
        if not (isinstance(pattern, str) or callable(pattern)):
            raise TypeError(f"rule pattern must be a str glob or a callable, got {pattern!r}")
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"rule {_describe(pattern)}: style must be a ParallelStyle, "
                f"got {type(style).__name__}"
            )
    plan: dict[str, ParallelStyle] = {}
    hits = [0] * len(pairs)
    for fqn, module in model.named_modules():
        for i, (pattern, style) in enumerate(pairs):
            if _matches(pattern, fqn, module):
                plan[fqn] = style
                hits[i] += 1
                break
    unmatched = [i for i, n in enumerate(hits) if n == 0]
    if unmatched and not allow_unmatched:
        names = [n for n, _ in model.named_modules() if n][:12]
        rules_txt = ", ".join(
            f"{_describe(pairs[i][0])} -> {type(pairs[i][1]).__name__}" for i in unmatched
        )
        raise ValueError(
            f"TP plan rules matched no module of {type(model).__name__}: {rules_txt} (or an "
            f"earlier rule took every module they match). Module FQNs begin {names}. Pass "
            "allow_unmatched=True to accept this."
        )
    return plan


def _leaf_is(names: tuple[str, ...], kind: type) -> Callable[[str, nn.Module], bool]:
    def pred(fqn: str, module: nn.Module) -> bool:
        return fqn.rsplit(".", 1)[-1] in names and isinstance(module, kind)

    pred.__name__ = f"{kind.__name__} named {'/'.join(names)}"
    return pred


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def llama_tp_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool = False,
    embeddings_and_output: bool = True,
    num_kv_heads: int | None = None,
    names: Mapping[str, tuple[str, ...]] | None = None,
) -> dict[str, ParallelStyle]:
    """The Megatron-style TP plan for Llama-style decoder blocks, found by name.

    Attention q/k/v and MLP gate/up projections are colwise, o/down rowwise (one all-reduce
    per block half). Projections are ``nn.Linear`` leaves whose last FQN atom is in
    :data:`LLAMA_NAMES` (``wq``/``q_proj``, ``w1``/``gate_proj``, ...). With
    ``embeddings_and_output`` the token embedding is row-sharded over the vocabulary and the
    output projection colwise with replicated logits. With ``sequence_parallel`` activations
    between blocks stay sharded on the sequence dim (dim 1; its length must divide by the TP
    size): norms outside the attention/MLP modules become ``SequenceParallel`` (their weight
    gradients are then summed over TP ranks, which is why they must be in the plan), the
    attention and MLP modules gather their input (:class:`GatherSequence`) and o/down
    reduce-scatter. It reads only module names, types and weights, so it may be called before or
    after :func:`fsdptk.prepare_mha_for_tp` (which changes plain int attributes only).

    Args:
        model: the model (any device, including meta); only read.
        sequence_parallel: shard activations on the sequence dim between blocks.
        embeddings_and_output: also shard the token embedding and the output projection
            (required for ``sequence_parallel``; tied embedding/output weights are not supported).
        num_kv_heads: the model's global KV head count; given, k/v use
            :class:`ReplicatedKVColwise` (needed when it is below the TP size).
        names: override of :data:`LLAMA_NAMES` (same keys) for other naming schemes.

    Returns:
        dict[str, ParallelStyle]: exact FQN -> style, for :func:`fsdptk.apply_tp`.

    Raises:
        ValueError: if a projection role (q, k, v, o, gate, up, down; embedding and output when
            requested) matches no module, if the embedding and output share a weight, or if
            ``sequence_parallel`` is asked without ``embeddings_and_output``.

    Examples:
        >>> plan = llama_tp_plan(model, sequence_parallel=True)  # needs a TP process group; tests/test_tp.py runs it  # doctest: +SKIP
        >>> plan["layers.0.attention.wq"]  # needs a TP process group; tests/test_tp.py runs it  # doctest: +SKIP
        ColwiseParallel(...)
    """
    if sequence_parallel and not embeddings_and_output:
        raise ValueError(
            "sequence_parallel=True needs embeddings_and_output=True: the embedding must emit "
            "sequence-sharded activations and the output projection gather them"
        )
    nm = {**LLAMA_NAMES, **(names or {})}
    sp_out = Shard(1) if sequence_parallel else Replicate()
    if num_kv_heads is None:
        kv_style: ParallelStyle = ColwiseParallel()
    else:
        kv_style = ReplicatedKVColwise(num_kv_heads)
    roles: list[tuple[str, type, ParallelStyle]] = [
        ("q", nn.Linear, ColwiseParallel()),
        ("k", nn.Linear, kv_style),
        ("v", nn.Linear, kv_style),
        ("o", nn.Linear, RowwiseParallel(output_layouts=sp_out)),
        ("gate", nn.Linear, ColwiseParallel()),
        ("up", nn.Linear, ColwiseParallel()),
        ("down", nn.Linear, RowwiseParallel(output_layouts=sp_out)),
    ]
    if embeddings_and_output:
        roles += [
            ("embedding", nn.Embedding,
             RowwiseParallel(input_layouts=Replicate(), output_layouts=sp_out)),
            ("output", nn.Linear,
             ColwiseParallel(input_layouts=sp_out, output_layouts=Replicate())),
        ]
    rules: list[tuple[Pattern, ParallelStyle]] = [
        (_leaf_is(nm[r], kind), s) for r, kind, s in roles
    ]
    plan = build_tp_plan(model, rules)
    if embeddings_and_output:
        _check_untied(model, plan, nm)
    if sequence_parallel:
        openers = nm["q"] + nm["gate"] + nm["up"]  # their parents: the attention / MLP modules
        blocks = {_parent(f) for f in plan if f.rsplit(".", 1)[-1] in openers}
        gather = GatherSequence()
        for fqn in blocks:
            plan[fqn] = gather
        inside = tuple(f"{b}." for b in blocks)
        for fqn, module in model.named_modules():
            if fqn not in plan and is_norm(module) and not fqn.startswith(inside):
                plan[fqn] = SequenceParallel()
    return plan


def _check_untied(model: nn.Module, plan: Mapping[str, ParallelStyle], nm: Mapping) -> None:
    emb = [f for f in plan if f.rsplit(".", 1)[-1] in nm["embedding"]]
    out = [f for f in plan if f.rsplit(".", 1)[-1] in nm["output"]]
    for e in emb:
        for o in out:
            if model.get_submodule(e).weight is model.get_submodule(o).weight:
                raise ValueError(
                    f"'{e}.weight' and '{o}.weight' are the same tensor (tied embeddings): "
                    "row-sharding one and column-sharding the other would untie them. Pass "
                    "embeddings_and_output=False."
                )

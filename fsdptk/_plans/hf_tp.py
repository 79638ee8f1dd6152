"""A Hugging Face model's own tensor-parallel plan, translated into DTensor ``ParallelStyle``\\ s.

transformers models declare how they shard (``model.tp_plan``: the config's
``base_model_tp_plan`` merged with the class's own entries such as ``lm_head``), as wildcard
patterns (``model.layers.*.self_attn.q_proj``) mapped to style strings (``"colwise"``). transformers
applies them with its own hook classes (``transformers.distributed.tensor_parallel``);
:func:`fsdptk.hf.hf_tp_plan` translates each string into torch's ``ParallelStyle`` with the same
layouts, keyed by the model's concrete module FQNs, so the plan goes through
:func:`fsdptk.apply_tp` and composes with FSDP2 (:func:`fsdptk.shard_model`) over the
data-parallel mesh.

Each string becomes torch's style with the same layouts (the table is in ``docs/hf_2d.md``; the
classes fsdptk adds are in :mod:`fsdptk._plans.tp_styles`):
``colwise*`` / ``rowwise*`` / ``embedding_*`` are :class:`ColwiseKeepTied` /
:class:`RowwiseKeepTied` (torch's classes, keeping a tied weight one Parameter),
``sequence_parallel`` is ``SequenceParallel``, ``replicated_with_grad_allreduce`` is
:class:`ReplicatedPartialGrad`, ``all_reduce`` is ``PrepareModuleOutput(Partial -> Replicate)``,
``replicate`` needs nothing; ``moe_tp_experts`` (a Mixture-of-Experts layer's fused experts, with
its parameters' ``packed_colwise`` / ``rowwise`` rules) is :class:`MoEExpertsTP`, and with LoRA on
those experts (PEFT's ``ParamWrapper`` s, ``target_parameters``) the outermost wrapper gets
:class:`~fsdptk._plans.tp_experts_lora.MoEExpertsLoraTP` (its factors split with the experts).
transformers 5.25 no longer names the fused experts in its TP plans (only expert parallelism
shards them there); fsdptk keeps the split above for them on every supported release (see
``_with_expert_rules``). ``mla_kv_a_proj`` (multi-head latent attention's KV down-projection) is
:class:`~fsdptk._plans.tp_mla.MlaKvAProj`. Strings for expert parallelism and head-replicating
splits (``packed_rowwise``, ``moe_identity_expert``, ``grouped_gemm``, ``ep_dispatch_experts``,
``unit_colwise``, ``unit_rowwise``, ``local_params``) and other rules naming a parameter rather
than a module have no translation: :func:`fsdptk.hf.hf_tp_plan` raises a ValueError naming the
string and the FQN.

Attention: transformers' attention modules reshape with ``-1`` heads, so an even split of the q/k/v
projections needs no attribute change. With fewer KV heads than TP ranks (``tp % num_kv_heads ==
0``) the k/v projections become :class:`~fsdptk.tp_plan.ReplicatedKVColwise` (each rank keeps the
KV head its query heads use) and the attention module's ``num_key_value_groups`` is set to its
per-rank value; any other head count that does not divide is refused by :func:`fsdptk.apply_tp`
before the model changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from fsdptk._core.names import param_owners
from fsdptk._plans.tp_experts_lora import MoEExpertsLoraTP, param_wrapper_chain
from fsdptk._plans.tp_mla import MlaKvAProj
from fsdptk._plans.tp_styles import (
    ColwiseKeepTied,
    GatherSequence,
    HFAttentionHeads,
    MoEExpertsTP,
    ReplicatedKVColwise,
    ReplicatedPartialGrad,
    RowwiseKeepTied,
    _KeepTied,
    is_norm,
)

__all__ = ["translate_plan", "ColwiseKeepTied", "RowwiseKeepTied", "HFAttentionHeads",
           "ReplicatedPartialGrad", "MoEExpertsTP", "MoEExpertsLoraTP", "TRANSLATED", "REFUSED", "COMPOSITE"]


# ------------------------------------------------------------------------- string -> style
_ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input")

# string -> (module type it shards, style factory; None: nothing to apply)
TRANSLATED: dict[str, tuple[type[nn.Module] | None, Callable[[], ParallelStyle] | None]] = {
    "colwise": (nn.Linear, lambda: ColwiseKeepTied()),
    "colwise_rep": (nn.Linear, lambda: ColwiseKeepTied(output_layouts=Replicate())),
    "colwise_gather_output": (nn.Linear, lambda: ColwiseKeepTied(output_layouts=Replicate())),
    "rowwise": (nn.Linear, lambda: RowwiseKeepTied()),
    "rowwise_rep": (nn.Linear, lambda: RowwiseKeepTied(input_layouts=Replicate())),
    "rowwise_split_input": (nn.Linear, lambda: RowwiseKeepTied(input_layouts=Replicate())),
    "embedding_rowwise": (nn.Embedding, lambda: RowwiseKeepTied(input_layouts=Replicate())),
    "embedding_colwise": (nn.Embedding, lambda: ColwiseKeepTied(output_layouts=Replicate())),
    "sequence_parallel": (None, lambda: SequenceParallel(use_local_output=True)),
    "replicated_with_grad_allreduce": (None, lambda: ReplicatedPartialGrad()),
    "all_reduce": (None, lambda: PrepareModuleOutput(
        output_layouts=Partial(), desired_output_layouts=Replicate())),
    "replicate": (None, None),
}

# strings translated with the plan's rules for the module's parameters (not from the table above)
COMPOSITE: dict[str, str] = {
    "moe_tp_experts": "MoEExpertsTP: fused experts, their parameters' packed_colwise / colwise / rowwise rules",
    "mla_kv_a_proj": "MlaKvAProj: the rotary slice's gradient summed over TP (the config's qk_rope_head_dim)",
}

# strings transformers knows that have no DTensor module-style translation here, and why
REFUSED: dict[str, str] = {
    "packed_colwise": "a parameter style: it applies inside a 'moe_tp_experts' module",
    "packed_rowwise": "packed rowwise expert weights are not translated",
    "moe_identity_expert": "mixture-of-experts layers: expert parallel is not built",
    "grouped_gemm": "expert-parallel weights: expert parallel is not built",
    "ep_dispatch_experts": "expert-parallel token dispatch: expert parallel is not built",
    "unit_colwise": "head-aligned splits over a head-replicating sub-mesh are not translated",
    "unit_rowwise": "head-aligned splits over a head-replicating sub-mesh are not translated",
    "local_params": "parameter-level sharding (attention sinks) is not translated",
}

_KV_LEAVES = ("k_proj", "v_proj")

# The fused experts' TP rules fsdptk keeps where the model's plan no longer names them (see
# ``_with_expert_rules``): a parameter's name -> the string transformers <= 5.24 declared for it.
_EXPERT_PARAMS = {"gate_up_proj": "packed_colwise", "gate_proj": "colwise", "up_proj": "colwise",
                  "down_proj": "rowwise"}


def _generic(name: str) -> str:
    """transformers' ``replace_layer_number_by_wildcard``: ``a.3.b`` -> ``a.*.b``."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _declared_plan(model: nn.Module) -> dict[str, str]:
    plan = getattr(model, "tp_plan", None)
    if plan is None:
        plan = getattr(model, "_tp_plan", None)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} declares no tensor-parallel plan (its tp_plan, merged from "
            "config.base_model_tp_plan, is empty): build one with fsdptk.build_tp_plan or "
            "fsdptk.llama_tp_plan instead")
    return dict(plan)


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _match(modules: Mapping[str, nn.Module], rules: Mapping[str, str]) -> dict[str, str]:
    """Concrete module FQN -> style string, transformers' matching (layer numbers -> ``*``)."""
    found: dict[str, str] = {}
    names: set[str] = set()
    for fqn in modules:
        names.update((fqn, _generic(fqn)))
        if (s := rules.get(fqn, rules.get(_generic(fqn)))) is not None:
            found[fqn] = s
    for mfqn, module in modules.items():
        for pname, _ in module.named_parameters(recurse=False):
            fqn = f"{mfqn}.{pname}" if mfqn else pname
            rule = fqn if fqn in rules else _generic(fqn)
            owner = rules.get(mfqn, rules.get(_generic(mfqn)))
            if owner == "moe_tp_experts":  # its parameters' styles are the module style's
                continue
            if rule in rules and rule not in names and rules[rule] != "replicate":
                raise ValueError(
                    f"tp_plan rule '{rule}' -> '{rules[rule]}' names the parameter '{fqn}', not a "
                    "module: parameter-level styles (expert weights, attention sinks) have no "
                    "translation")
    return found


def _translate(string: str, fqn: str, module: nn.Module) -> ParallelStyle | None:
    if string in REFUSED:
        raise ValueError(f"tp_plan style '{string}' of module '{fqn}' ({type(module).__name__}) "
                         f"has no translation: {REFUSED[string]}")
    if string not in TRANSLATED:
        raise ValueError(f"tp_plan style '{string}' of module '{fqn}' ({type(module).__name__}) "
                         f"is unknown; translated styles: {sorted(TRANSLATED)}")
    kind, make = TRANSLATED[string]
    if kind is not None and not isinstance(module, kind):
        raise ValueError(f"tp_plan style '{string}' of module '{fqn}' shards an "
                         f"nn.{kind.__name__}, but the module is a {type(module).__name__}")
    return None if make is None else make()


def _experts(fqn: str, module: nn.Module, rules: Mapping[str, str]) -> MoEExpertsTP:
    """The ``moe_tp_experts`` style of ``fqn`` with its parameters' declared strings."""
    params = {}
    for pname, _ in module.named_parameters(recurse=False):
        full = f"{fqn}.{pname}"
        string = rules.get(full, rules.get(_generic(full)))
        if string is not None:
            params[pname] = string
    style = MoEExpertsTP(params)
    for pname, p in module.named_parameters(recurse=False):
        if params.get(pname) not in MoEExpertsTP.STRINGS:
            raise ValueError(f"experts module '{fqn}' ({type(module).__name__}): parameter '{pname}' "
                             f"(shape {list(p.shape)}) has tp_plan style {params.get(pname)!r}; "
                             f"'moe_tp_experts' shards {list(MoEExpertsTP.STRINGS)} parameters only")
    return style


def _placement(style: ParallelStyle | None, module: nn.Module, pname: str) -> str:
    if style is None:
        return "unsharded"
    dim = _tp_shard_dims(style, module, None).get(pname)
    return "replicated" if dim is None else f"Shard({dim})"


def _tie(model: nn.Module, strings: Mapping[str, str],
         styles: Mapping[str, ParallelStyle | None]) -> None:
    """A Parameter shared by several modules (tied embeddings) must be placed the same way by all
    of them; their styles are told of each other so that it stays one Parameter."""
    for _, group in param_owners(model, remove_duplicate=False):
        if len(group) < 2:
            continue
        where = [(f"{f}.{n}" if f else n, strings.get(f), _placement(styles.get(f), m, n))
                 for f, n, m in group]
        desc = ", ".join(f"'{k}' {p} ({s or 'not in the plan'})" for k, s, p in where)
        if len({p for _, _, p in where}) > 1:
            raise ValueError(f"tied parameter placed differently by the plan: {desc}; its modules "
                             "must shard it the same way to stay one Parameter")
        planned = [(f, n, m) for f, n, m in group if styles.get(f) is not None]
        if any(not isinstance(styles[f], _KeepTied) for f, _, _ in planned):
            raise ValueError(f"tied parameter {desc}: only the colwise / rowwise / embedding "
                             "styles keep a tie; the others would untie it")
        for f, n, _ in planned:
            for g, o, other in group:
                if (g, o) != (f, n):
                    cast(_KeepTied, styles[f]).tie(n, other, o)


def _config(model: nn.Module, module: nn.Module) -> Any:
    """The config a module reads: its own, else the model's text config."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        cfg = getattr(model, "config", None)
        if cfg is not None and hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config()
    return cfg


def _rope_dim(model: nn.Module, fqn: str, modules: Mapping[str, nn.Module]) -> int:
    """``qk_rope_head_dim`` for the ``mla_kv_a_proj`` module ``fqn`` (its attention's config)."""
    parent = modules.get(_parent(fqn), modules[fqn])
    rope = getattr(_config(model, parent), "qk_rope_head_dim", None)
    if isinstance(rope, bool) or not isinstance(rope, int) or rope <= 0:
        raise ValueError(f"tp_plan style 'mla_kv_a_proj' of module '{fqn}' needs the config's "
                         f"qk_rope_head_dim (a positive int), got {rope!r}")
    return rope


def _with_expert_rules(model: nn.Module, modules: Mapping[str, nn.Module], declared: dict[str, str]
                       ) -> dict[str, str]:
    """``declared`` with fsdptk's TP rules for fused experts that the model's plan leaves out.

    transformers 5.25 took the fused experts out of the TP plans (``base_model_tp_plan`` no longer
    names ``mlp.experts``: they are sharded by expert parallelism only, ``base_model_ep_plan``'s
    ``ep_dispatch_experts`` / ``grouped_gemm``). Under FSDP x TP that would leave every TP rank a
    whole copy of the experts, the bulk of a MoE model. fsdptk keeps the split transformers 5.23
    declared, the same on every supported release: an experts module the EP plan dispatches to and
    the TP plan does not mention becomes ``moe_tp_experts`` with ``packed_colwise`` for
    ``gate_up_proj`` (gate rows then up rows), ``colwise`` for ``gate_proj`` / ``up_proj`` and
    ``rowwise`` for ``down_proj``. Experts stored transposed (``is_transposed``: gpt-oss) are left
    as the model's plan leaves them; a parameter with no rule here (a bias) is refused by name by
    :class:`MoEExpertsTP`.
    """
    ep = getattr(model, "ep_plan", None) or getattr(model, "_ep_plan", None) or {}
    out = dict(declared)
    for rule, string in ep.items():
        if string != "ep_dispatch_experts" or any(k == rule or k.startswith(rule + ".") for k in declared):
            continue
        found = [m for f, m in modules.items() if f == rule or _generic(f) == rule]
        if not found or any(getattr(m, "is_transposed", False) for m in found):
            continue
        out[rule] = "moe_tp_experts"
        for prule, pstring in ep.items():
            pname = prule[len(rule) + 1:] if prule.startswith(rule + ".") else ""
            if pstring == "grouped_gemm" and pname in _EXPERT_PARAMS:
                out[prule] = _EXPERT_PARAMS[pname]
    return out


def _heads(model: nn.Module, attn: nn.Module) -> tuple[int, int] | None:
    cfg = _config(model, attn)
    nq = getattr(cfg, "num_attention_heads", None)
    if not isinstance(nq, int):
        return None
    kv = getattr(cfg, "num_key_value_heads", None)
    return nq, kv if isinstance(kv, int) else nq


def _sequence_parallel(model: nn.Module, modules: Mapping[str, nn.Module], strings: Mapping[str, str],
                       styles: dict[str, ParallelStyle | None], attn_heads: Mapping) -> None:
    """Rewrite ``styles`` so activations between the blocks stay sharded on the sequence dim."""
    blocks = sorted({_parent(f) for f, s in strings.items() if s in _ROWWISE})
    inside = tuple(f"{b}." for b in blocks)
    outer = {f: s for f, s in strings.items() if not f.startswith(inside)}
    emb = [f for f, s in outer.items() if s == "embedding_rowwise"]
    out = [f for f, s in outer.items() if s in ("colwise_gather_output", "colwise_rep")]
    other = {f: s for f, s in outer.items() if f not in emb + out and s != "replicate"}
    if not blocks or not emb or not out or other:
        raise ValueError(
            f"sequence_parallel=True needs a plan whose rowwise projections close blocks, with the "
            f"input embedding 'embedding_rowwise' and the output projection "
            f"'colwise_gather_output' outside them; {type(model).__name__}'s plan has blocks "
            f"{blocks}, embeddings {emb}, outputs {out} and other modules outside blocks {other}")
    for f in emb:
        styles[f] = RowwiseKeepTied(input_layouts=Replicate(), output_layouts=Shard(1),
                                    use_local_output=False)
    for f in out:
        styles[f] = ColwiseKeepTied(input_layouts=Shard(1), output_layouts=Replicate())
    for f, s in strings.items():
        if s in _ROWWISE and _parent(f) in blocks:
            styles[f] = RowwiseKeepTied(
                input_layouts=Shard(-1) if s == "rowwise" else Replicate(),
                output_layouts=Shard(1), use_local_output=False)
    for b in blocks:
        heads = attn_heads.get(b)
        styles[b] = (HFAttentionHeads(*heads, gather_sequence=True) if heads
                     else GatherSequence())
    for fqn, module in modules.items():
        if fqn in strings or fqn in styles or fqn.startswith(inside) or fqn in blocks:
            continue
        if any(True for _ in module.parameters(recurse=False)):
            if not is_norm(module):
                raise ValueError(
                    f"sequence_parallel=True: '{fqn}' ({type(module).__name__}) holds parameters "
                    "outside the attention / MLP blocks and is not a norm, so it cannot run on "
                    "sequence shards; use sequence_parallel=False")
            styles[fqn] = SequenceParallel(use_local_output=False)


def translate_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """:func:`fsdptk.hf.hf_tp_plan` (documented there): the model's declared plan, translated."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    from fsdptk._plans.peft import base_modules

    view = base_modules(model)
    if view is None:
        strings, styles = _translate_tree(model, dict(model.named_modules()), sequence_parallel)
    else:  # a PEFT model: the base model's plan on its base layers, then the adapters'
        if sequence_parallel:
            raise ValueError(
                "sequence_parallel=True is not supported on a PEFT model: its adapters would add "
                "sequence-sharded and whole activations; use sequence_parallel=False")
        get_base = getattr(model, "get_base_model", None)
        base = get_base() if callable(get_base) else model
        real = {b: f for b, (f, _) in view.items()}
        strings_b, styles_b = _translate_tree(base, {b: m for b, (_, m) in view.items()}, False)
        strings = {real[b]: s for b, s in strings_b.items()}
        styles = {real[b]: s for b, s in styles_b.items()}
        modules = dict(model.named_modules())
        for fqn, style in list(styles.items()):
            tuner = _parent(fqn)
            if not fqn.endswith(".base_layer") or style is None:
                continue
            if param_wrapper_chain(modules[tuner]):  # LoRA on the parameters (fused experts)
                styles.update(_wrapper_styles(fqn, modules, style, strings[fqn]))
            else:
                styles.update(_adapter_styles(tuner, modules[tuner], style, strings[fqn]))
    _tie(model, strings, styles)
    return {f: style for f, _ in model.named_modules() if (style := styles.get(f)) is not None}


def _translate_tree(model: nn.Module, modules: Mapping[str, nn.Module], sequence_parallel: bool
                    ) -> tuple[dict[str, str], dict[str, ParallelStyle | None]]:
    """(fqn -> style string, fqn -> style) over ``modules`` (the model's tree, fqn -> module; for
    a PEFT model its base model's tree, base layers standing where their tuners are)."""
    declared = _with_expert_rules(model, modules, _declared_plan(model))
    strings = _match(modules, declared)
    styles: dict[str, ParallelStyle | None] = {}
    for f, s in strings.items():
        if s == "moe_tp_experts":
            styles[f] = _experts(f, modules[f], declared)
        elif s == "mla_kv_a_proj":
            styles[f] = MlaKvAProj(_rope_dim(model, f, modules))
        else:
            styles[f] = _translate(s, f, modules[f])

    attn_heads: dict[str, tuple[int, int]] = {}
    for f, s in strings.items():
        parent = _parent(f)
        if s == "mla_kv_a_proj" and parent in modules and (heads := _heads(model, modules[parent])):
            attn_heads[parent] = heads  # MLA: the q / kv_b projections split the heads (checked)
            continue
        if s == "colwise" and f.rpartition(".")[2] in _KV_LEAVES and parent in modules:
            heads = _heads(model, modules[parent])
            if heads is None:
                continue
            attn_heads[parent] = heads
            if heads[1] < heads[0]:  # GQA: KV heads may be fewer than TP ranks
                styles[f] = ReplicatedKVColwise(heads[1])
    for parent, heads in attn_heads.items():
        if parent not in strings:  # never replace a style the model declares for it
            styles[parent] = HFAttentionHeads(*heads)
    if sequence_parallel:
        _sequence_parallel(model, modules, strings, styles, attn_heads)
    return strings, styles


def _wrapper_styles(fqn: str, modules: Mapping[str, nn.Module], style: ParallelStyle, string: str
                    ) -> dict[str, ParallelStyle]:
    """The style of the outermost PEFT ``ParamWrapper`` around ``fqn`` (LoRA on its parameters,
    ``target_parameters``): :class:`MoEExpertsLoraTP` for fused experts sharded with
    ``moe_tp_experts``; any other wrapped module is refused by name."""
    outer = fqn
    while _parent(outer) in modules and outer.endswith(".base_layer") and param_wrapper_chain(
            modules[_parent(outer)]):
        outer = _parent(outer)
    if not isinstance(style, MoEExpertsTP):
        params = [str(w.parameter_name) for w in param_wrapper_chain(modules[outer])]
        raise ValueError(f"PEFT ParamWrapper '{outer}' (target_parameters {params}) wraps '{fqn}', whose "
                         f"tp_plan style is '{string}': tensor parallel on a ParamWrapper is built for "
                         "fused experts sharded with 'moe_tp_experts' only")
    return {outer: MoEExpertsLoraTP(style.params)}


def _adapter_styles(fqn: str, tuner: nn.Module, style: ParallelStyle, string: str
                    ) -> dict[str, ParallelStyle]:
    """The styles of a LoRA layer's adapters whose base layer gets ``style``.

    ``y = W x + s * B (A x)``. Colwise ``W`` (output features split): ``B`` is split the same way
    (its output adds to this rank's slice of ``W x``), ``A`` is whole on every rank; ``B``'s style
    takes ``A x`` as replicated, so the gradient reaching ``A`` is summed over the TP ranks.
    Rowwise ``W`` (input features split): ``A`` is split the same way and its partial sums are
    all-reduced, ``B`` is whole on every rank and sees the whole ``A x``. Each adapter's
    parameters keep their full shapes in state dicts; nothing else changes.
    """
    from peft.tuners.lora import LoraLayer

    where = f"'{fqn}' ({type(tuner).__name__}, base layer '{string}')"
    if not isinstance(tuner, LoraLayer) or not isinstance(getattr(tuner, "base_layer", None), nn.Linear):
        raise ValueError(f"tensor parallel on a PEFT tuner layer is built for LoRA on nn.Linear "
                         f"only; {where} is not one")
    variants = sorted(getattr(tuner, "lora_variant", {}) or {})
    if variants or len(getattr(tuner, "lora_magnitude_vector", ())):
        raise ValueError(
            f"{where}: adapter(s) {variants} use a LoRA variant (DoRA, ...), whose weight norm reads "
            "the whole base weight and B @ A in one piece; tensor parallel is built for plain LoRA")
    out: dict[str, ParallelStyle] = {}
    for name in tuner.lora_A:
        a, b = f"{fqn}.lora_A.{name}", f"{fqn}.lora_B.{name}"
        if isinstance(style, ReplicatedKVColwise):
            out[b] = ReplicatedKVColwise(style.num_kv_heads)
        elif isinstance(style, ColwiseParallel):
            out[b] = ColwiseParallel(output_layouts=style.output_layouts[0],
                                     use_local_output=style.use_local_output)
        elif isinstance(style, RowwiseParallel):
            out[a] = RowwiseKeepTied(input_layouts=style.input_layouts[0],
                                     output_layouts=style.output_layouts[0],
                                     use_local_output=style.use_local_output)
        else:
            raise ValueError(f"{where}: the base layer's style {type(style).__name__} has no LoRA "
                             "counterpart; only colwise / rowwise projections can carry adapters")
    return out


# --------------------------------------------------------------------- per-rank bytes (planner)
def _tp_shard_dims(style: ParallelStyle | None, module: nn.Module, tp: int | None
                   ) -> dict[str, int]:
    """Parameter name -> the dim the style shards over ``tp`` ranks (absent: whole on every
    rank; ReplicatedKVColwise's split depends on ``tp``: none when it is unknown)."""
    emb = isinstance(module, nn.Embedding)
    names = [n for n, _ in module.named_parameters(recurse=False)]
    if isinstance(style, ReplicatedKVColwise):
        return {n: 0 for n in names} if tp and style.num_kv_heads % tp == 0 else {}
    if isinstance(style, ColwiseParallel):
        return {n: 1 if emb else 0 for n in names}
    if isinstance(style, RowwiseParallel):
        return {n: 0 if emb else 1 for n in names if emb or n != "bias"}
    if isinstance(style, MoEExpertsTP):
        return {n: 2 if s == "rowwise" else 1 for n, s in style.params.items()}
    return {}


def describe_hf_2d(model: nn.Module, shard_conditions: Any, *, world_size: int, tp: int,
                   sequence_parallel: bool = False) -> Any:
    """The TP x FSDP sharding plan of a transformers model, computed on its ``meta`` build.

    Translates the model's own TP plan (:func:`fsdptk.hf.hf_tp_plan`, head counts checked as
    :func:`fsdptk.apply_tp` would), then describes FSDP over ``world_size // tp`` ranks of each
    parameter's TP-rank-0 shard (the largest one when a dim does not divide), with the planner
    ``shard_model`` uses. The model is a throwaway: each TP-sharded parameter gets a ``to_local``
    returning a ``meta`` tensor of its shard's shape.

    Args:
        model: a transformers model on ``meta`` (e.g. :func:`fsdptk.hf.hf_meta_model`).
        shard_conditions: the FSDP unit conditions (e.g. ``no_split_modules(model)``).
        world_size: all ranks (``dp_shard * tp``).
        tp: the tensor-parallel degree (a divisor of ``world_size``).
        sequence_parallel: translate the plan as ``hf_tp_plan(..., sequence_parallel=True)``.

    Returns:
        ShardingPlan: units, full bytes and bytes per rank (TP shard, then FSDP shard).

    Raises:
        ValueError: ``tp`` does not divide ``world_size``, the plan has no translation, or the
            head counts do not split over ``tp`` ranks.

    Examples:
        >>> model = hf_meta_model("ckpt")  # needs an HF checkpoint; tests/test_hf_tp.py runs it  # doctest: +SKIP
        >>> plan = describe_hf_2d(model, no_split_modules(model), world_size=8, tp=2)  # needs an HF checkpoint; tests/test_hf_tp.py runs it  # doctest: +SKIP
        >>> plan.total_bytes_per_rank  # needs an HF checkpoint; tests/test_hf_tp.py runs it  # doctest: +SKIP
    """
    from fsdptk.sharding import describe_sharding

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(f"tp ({tp}) must be a positive divisor of the world size ({world_size})")
    plan = translate_plan(model, sequence_parallel=sequence_parallel)
    for fqn, style in plan.items():
        module = model.get_submodule(fqn)
        check = getattr(style, "_check", None)
        if callable(check):
            check(module, tp, fqn)
        for pname, dim in _tp_shard_dims(style, module, tp).items():
            param: Any = module._parameters[pname]
            shape = torch.empty(param.shape, device="meta").chunk(tp, dim=dim)[0].shape
            param.to_local = lambda shape=shape: torch.empty(shape, device="meta")
    return describe_sharding(model, shard_conditions, world_size=world_size // tp)

"""transformers' expert-parallel plan (``model.ep_plan``, merged from ``config.base_model_ep_plan``)
read as the experts modules :func:`fsdptk.apply_ep` shards (:func:`fsdptk.hf.hf_ep_plan`)."""

from __future__ import annotations

from torch import nn

from fsdptk._plans.hf_tp import _generic

__all__ = ["experts_from_plan", "KNOWN"]

# transformers' EP style strings: the experts module's token dispatch, and its parameters'
# Shard(0) over the experts (both what ExpertParallel does for a module and its parameters)
KNOWN = {"ep_dispatch_experts": "module", "grouped_gemm": "parameter"}


def experts_from_plan(model: nn.Module) -> list[str]:
    """The FQNs of the modules the model's EP plan dispatches to, checked against its rules.

    A PEFT model's plan is its base model's, matched on the base model's module tree (PEFT's
    prefixes and ``base_layer`` levels read off the tree by :func:`fsdptk._plans.peft.base_modules`)
    and answered with the PEFT model's own FQNs: with LoRA on the experts (``ParamWrapper`` s over
    an experts module, ``target_parameters``) the experts module itself, inside its wrappers, which
    :func:`fsdptk.apply_ep` then shards with it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    from fsdptk._plans.peft import base_model, base_modules

    view = base_modules(model)
    if view is None:
        return _experts(model, dict(model.named_modules()))
    base = _experts(base_model(model), {b: m for b, (_, m) in view.items()})
    return [view[b][0] for b in base]


def _experts(model: nn.Module, modules: dict[str, nn.Module]) -> list[str]:
    """The experts modules of ``model``'s plan among ``modules`` (fqn -> module)."""
    plan = getattr(model, "ep_plan", None) or getattr(model, "_ep_plan", None) or {}
    if not plan:
        raise ValueError(
            f"{type(model).__name__} declares no expert-parallel plan (its ep_plan, merged from "
            "config.base_model_ep_plan, is empty): pass apply_ep a predicate selecting the experts "
            "modules, or use ep=1")
    for rule, string in plan.items():
        if string not in KNOWN:
            raise ValueError(f"ep_plan style '{string}' of '{rule}' has no translation; translated "
                             f"styles: {sorted(KNOWN)}")
    experts = [f for f in modules if plan.get(f, plan.get(_generic(f))) == "ep_dispatch_experts"]
    if not experts:
        raise ValueError(f"{type(model).__name__}'s ep_plan {plan} names no module of the model "
                         "with 'ep_dispatch_experts'")
    for fqn in experts:
        module = modules[fqn]
        for pname, p in module.named_parameters():
            full = f"{fqn}.{pname}"
            if plan.get(full, plan.get(_generic(full))) != "grouped_gemm":
                raise ValueError(
                    f"ep_plan gives parameter '{full}' (shape {list(p.shape)}) of experts module "
                    f"'{fqn}' no 'grouped_gemm' rule: every parameter of an expert-parallel module "
                    "is sharded on its experts dim")
    return experts

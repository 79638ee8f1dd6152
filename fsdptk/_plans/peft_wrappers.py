"""PEFT's ``ParamWrapper`` (LoRA on a parameter, ``target_parameters``: e.g. the fused experts of a
transformers 5 MoE model) and the rules fsdptk keeps around it: the LoRA factors a wrapper reads
without calling them stay in their wrapper's FSDP unit (peft#3080), and LoRA on the experts under
expert parallelism is refused by name (nothing cuts the factors to each rank's experts yet)."""

from __future__ import annotations

from torch import nn

from fsdptk._plans.peft import peft_configs

__all__ = ["lora_on_ep_experts", "param_wrapped", "read_not_called"]


def read_not_called(model: nn.Module) -> dict[int, tuple[str, str]]:
    """``{id(module): (module fqn, wrapper fqn)}`` of the modules whose parameters a PEFT
    ``ParamWrapper`` (LoRA on a parameter: ``target_parameters``, e.g. fused MoE experts) reads
    without calling them: its ``lora_A`` / ``lora_B`` and their per-adapter ``nn.Linear``. FSDP2
    gathers a unit's parameters in the unit's forward hook, which never runs for these, so such a
    module cannot be an FSDP unit of its own (the wrapper would read sharded factors: peft#3080).
    Empty for a model without PEFT adapters."""
    if peft_configs(model) is None:
        return {}
    from peft.tuners.lora.layer import ParamWrapper

    out: dict[int, tuple[str, str]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, ParamWrapper):
            for part in ("lora_A", "lora_B"):
                holder = getattr(mod, part)
                out[id(holder)] = (f"{name}.{part}", name)
                for adapter, sub in holder.items():
                    out[id(sub)] = (f"{name}.{part}.{adapter}", name)
    return out


def param_wrapped(model: nn.Module) -> dict[int, tuple[str, list[str]]]:
    """``{id(module): (outermost wrapper fqn, wrapped parameter names)}`` of every module whose
    parameters PEFT ``ParamWrapper`` s wrap (LoRA on parameters, ``target_parameters``). Empty for
    a model without PEFT adapters."""
    if peft_configs(model) is None:
        return {}
    from peft.tuners.lora.layer import ParamWrapper

    out: dict[int, tuple[str, list[str]]] = {}
    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    for name, mod in model.named_modules():
        if isinstance(mod, ParamWrapper) and id(mod) not in inner:
            params: list[str] = []
            base: nn.Module = mod
            while isinstance(base, ParamWrapper):
                params.append(base.parameter_name)
                base = base.base_layer
            out[id(base)] = (name, sorted(params))
    return out


def lora_on_ep_experts(wrapper: str, params: list[str], experts: str) -> str:
    """The message refusing LoRA on the experts under expert parallelism."""
    return (f"LoRA on the experts under expert parallelism is not supported: PEFT's ParamWrapper "
            f"'{wrapper}' (target_parameters {params}) wraps experts module '{experts}', and fsdptk "
            "does not cut its LoRA factors (A (r * E, in), B (out, r * E)) to each rank's experts. "
            "Use ep=1 (FSDP / HSDP shard the factors with their decoder layer), or LoRA on the other "
            "layers only (target_modules, no target_parameters) with ep > 1")

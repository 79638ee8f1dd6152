"""PEFT (LoRA, DoRA, ...) models under FSDP2: which tensors are adapter weights, what PEFT calls
them in its files, and which key of a plain base checkpoint each base tensor of the wrapped model
comes from.

Nothing here guesses from names. Adapter weights are what PEFT's own
``peft.utils.get_peft_model_state_dict`` returns for an adapter, matched back to the model by tensor
identity (it is given ``model.state_dict(keep_vars=True)``, so it returns the model's own tensor
objects under the keys ``save_pretrained`` writes, adapter name stripped). Base names come from the
module tree: a tuner layer's ``base_layer`` child (and an ``AuxiliaryTrainingWrapper``'s
``original_module``) stands where its parent stood in the base model, and the base model is the
module ``get_base_model()`` returns (``base_model.model`` inside a ``PeftModel``).

peft is imported only when it is already imported (a PEFT model cannot exist otherwise), so
non-PEFT models never pay for it, and their behaviour (torchtune's rule for
``adapter_weights_only``) is untouched.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from fsdptk._engine.sources.base_keys import BaseView

__all__ = [
    "BaseView",
    "adapter_config_json",
    "adapter_file_names",
    "adapter_predicate",
    "base_modules",
    "base_names",
    "base_view",
    "check_adapter_dir",
    "peft_configs",
    "require_adapter",
    "staged_adapter_config",
    "without_left_adapters",
]


def peft_configs(model: nn.Module) -> dict[str, Any] | None:
    """``model.peft_config`` (adapter name -> ``PeftConfig``) when ``model`` is a PEFT model
    (``peft.PeftModel``, or a model with PEFT tuners injected), else ``None``."""
    if "peft" not in sys.modules:
        return None
    from peft import PeftConfig

    configs = getattr(model, "peft_config", None)
    if isinstance(configs, Mapping) and configs and all(isinstance(c, PeftConfig) for c in configs.values()):
        return dict(configs)
    return None


def require_adapter(model: nn.Module, adapter_name: str) -> Any:
    """The ``PeftConfig`` of ``adapter_name``.

    Raises:
        TypeError: ``model`` is not a PEFT model (names its class).
        KeyError: the model has no adapter of that name (names it and the ones it has).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    configs = peft_configs(model)
    if configs is None:
        raise TypeError(f"{type(model).__name__} has no PEFT adapter (no peft_config of PeftConfig "
                        "objects): wrap it with peft.get_peft_model(model, config) before sharding")
    if not isinstance(adapter_name, str) or adapter_name not in configs:
        raise KeyError(f"the model has no adapter named {adapter_name!r}; its adapters are "
                       f"{sorted(configs)}")
    return configs[adapter_name]


def adapter_file_names(model: nn.Module, adapter_name: str, *,
                       embeddings: bool | Literal["auto"] = "auto") -> dict[str, str]:
    """``{key in PEFT's adapter file: model fqn}`` for one adapter, as PEFT itself decides.

    PEFT's ``get_peft_model_state_dict`` is given ``model.state_dict(keep_vars=True)`` and returns
    the model's own tensor objects (sharded or not) under the keys ``PeftModel.save_pretrained``
    writes; each is matched back to its fqn by identity. Nothing moves. ``embeddings`` is PEFT's
    ``save_embedding_layers`` (``"auto"``: as ``save_pretrained``, which saves the embedding
    layers when targeted or resized; ``False`` for the adapter weights proper).

    Raises:
        TypeError / KeyError: see :func:`require_adapter`.
        NotImplementedError: PEFT's state dict holds a tensor that is not one of the model's (a
            tuner that computes what it saves, e.g. prompt learning).
    """
    require_adapter(model, adapter_name)
    from peft.utils import get_peft_model_state_dict

    # PEFT >= 0.22 gathers DTensors inside get_peft_model_state_dict (a collective on every
    # sharded tensor, and a copy that fails on meta): it is shown stand-ins of the same shapes and
    # dtypes (one per tensor, a tied tensor's keys sharing theirs), so only names are learned here
    stand_ins: dict[int, torch.Tensor] = {}
    sd = {fqn: stand_ins.setdefault(id(t), _stand_in(t)) for fqn, t in model.state_dict(keep_vars=True).items()}
    fqn_of: dict[int, str] = {}
    for fqn, t in sd.items():
        fqn_of.setdefault(id(t), fqn)
    out = get_peft_model_state_dict(model, state_dict=sd, adapter_name=adapter_name,
                                    save_embedding_layers=embeddings)
    names: dict[str, str] = {}
    for key, t in out.items():
        found = fqn_of.get(id(t))
        if found is None:
            raise NotImplementedError(
                f"adapter {adapter_name!r}: PEFT saves {key!r}, which is no tensor of the model (its "
                "tuner computes it); fsdptk gathers tuners whose adapter state is the model's own "
                "tensors (LoRA, DoRA, IA3, ...)")
        names[key] = found
    return names


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a DTensor a plain meta tensor of its global shape and dtype."""
    from torch.distributed.tensor import DTensor

    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, DTensor) else t


def _adapter_ids(model: nn.Module, configs: Mapping[str, Any]) -> tuple[set[int], set[str]]:
    """ids and fqns of every adapter tensor, over all the model's adapters."""
    sd = model.state_dict(keep_vars=True)
    fqns = {fqn for name in configs
            for fqn in adapter_file_names(model, name, embeddings=False).values()}
    return {id(sd[f]) for f in fqns}, fqns


def adapter_predicate(model: nn.Module) -> Callable[[str, torch.Tensor], bool] | None:
    """``(fqn, tensor) -> bool`` selecting the adapter weights of every adapter of a PEFT model
    (what ``get_peft_model_state_dict`` returns for each), or ``None`` for any other model (the
    caller keeps its own rule)."""
    configs = peft_configs(model)
    if configs is None:
        return None
    ids, _ = _adapter_ids(model, configs)
    return lambda _fqn, t: id(t) in ids


def base_model(model: nn.Module) -> nn.Module:
    """The transformers (or other) model the tuners were injected into: ``get_base_model()`` of a
    ``PeftModel``, the model itself otherwise."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _stand_ins(model: nn.Module) -> tuple[str, set[str]]:
    """(path of the base model inside ``model``, module paths that stand where their parent stood
    in the base model: tuner layers' ``base_layer``, auxiliary wrappers' ``original_module``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    root = base_model(model)
    root_path, dropped = None, set()
    for name, mod in model.named_modules():
        if mod is root and root_path is None:
            root_path = name
        if isinstance(mod, BaseTunerLayer) and isinstance(getattr(mod, "base_layer", None), nn.Module):
            dropped.add(f"{name}.base_layer" if name else "base_layer")
        if isinstance(mod, AuxiliaryTrainingWrapper):
            dropped.add(f"{name}.original_module" if name else "original_module")
    return root_path or "", dropped


def base_names(model: nn.Module) -> tuple[dict[str, str], set[str]] | None:
    """``({model key: base checkpoint key}, adapter keys)`` for a PEFT model, else ``None``.

    Every persistent key that is not an adapter weight gets the key it has in the base model's own
    ``state_dict`` (the ``base_model.model.`` prefix and each ``.base_layer`` / ``.original_module``
    level removed); a key outside the base model (e.g. a ``PeftModel``'s own) keeps its name.

    Raises:
        ValueError: two model keys would read the same base key (names both).
    """
    configs = peft_configs(model)
    if configs is None:
        return None
    _, adapters = _adapter_ids(model, configs)
    root, dropped = _stand_ins(model)
    prefix = f"{root}." if root else ""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for key in model.state_dict(keep_vars=True):
        if key in adapters or not key.startswith(prefix):
            continue
        parts, path = [], ""
        *mods, leaf = key.split(".")
        for part in mods:
            path = f"{path}.{part}" if path else part
            if path not in dropped:
                parts.append(part)
        base = ".".join(parts + [leaf])[len(prefix):]
        if base in seen:
            raise ValueError(f"model keys {seen[base]!r} and {key!r} both stand for base checkpoint "
                             f"key {base!r}; load this model's base weights with an explicit rename")
        seen[base] = key
        out[key] = base
    return out, adapters


def base_modules(model: nn.Module) -> dict[str, tuple[str, nn.Module]] | None:
    """``{base module fqn: (model fqn, module)}`` for a PEFT model, else ``None``: the base model's
    module tree as it was before the tuners were injected (in ``named_modules`` order).

    A tuner layer is replaced by its ``base_layer`` (an auxiliary wrapper by its
    ``original_module``), which takes the tuner's base name; the tuner's other children (its
    adapter modules: ``lora_A``, ``lora_B``, dropouts, ...) are left out, and so is anything outside
    the base model. ``""`` is the base model itself.
    """
    if peft_configs(model) is None:
        return None
    root, dropped = _stand_ins(model)
    prefix = f"{root}." if root else ""
    tuners = {d.rpartition(".")[0] for d in dropped}
    out: dict[str, tuple[str, nn.Module]] = {}
    for name, mod in model.named_modules():
        if name in tuners or (root and name != root and not name.startswith(prefix)):
            continue
        kept, path, adapter = [], "", False
        for part in name.split(".") if name else []:
            parent, path = path, f"{path}.{part}" if path else part
            if parent in tuners:
                if path not in dropped:
                    adapter = True
                    break
                continue
            kept.append(part)
        if adapter:
            continue
        joined = ".".join(kept)
        out[joined[len(prefix):] if joined != root else ""] = (name, mod)
    return out


def base_view(model: nn.Module, source: Mapping[str, Any]) -> Mapping[str, Any]:
    """``source`` seen under the model's keys (:class:`BaseView`) when ``model`` is a PEFT model;
    ``source`` itself otherwise."""
    names = base_names(model)
    if names is None:
        return source
    return BaseView(source, *names)


def without_left_adapters(source: Any, missing: list[str]) -> list[str]:
    """``missing`` less the adapter keys when the load read none of them: a base checkpoint into a
    PEFT model leaves the adapters to ``load_adapter`` (or their own init), they are not missing
    from it. ``missing`` is agreed on every rank, so every rank decides alike."""
    adapters = getattr(source, "adapters", None)
    if not adapters:
        return missing
    if not adapters.issubset(missing):
        return missing
    return [k for k in missing if k not in adapters]


def adapter_config_json(model: nn.Module, adapter_name: str) -> tuple[Any, dict[str, str] | None]:
    """The copy of the adapter's config ``PeftModel.save_pretrained`` writes, and its
    ``auto_mapping_dict``: ``base_model_name_or_path`` filled from the base model,
    ``inference_mode=True``, the base model's class recorded when no ``task_type`` is set."""
    from torch.distributed.fsdp import FSDPModule

    config = copy.deepcopy(require_adapter(model, adapter_name))
    base = base_model(model)
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto = None
    if config.task_type is None:
        cls = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))
        auto = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return config, auto


def staged_adapter_config(model: nn.Module, adapter_name: str) -> Callable[[Any], None]:
    """``write(directory)``: writes ``adapter_config.json`` there as ``save_pretrained`` does."""
    config, auto = adapter_config_json(model, adapter_name)

    def write(directory: Any) -> None:
        config.save_pretrained(str(directory), auto_mapping_dict=auto)

    return write


# adapter_config.json fields that must agree for a resume (shapes, or the computation they feed)
_CONFIG_FIELDS = ("peft_type", "r", "lora_alpha", "use_dora", "use_rslora", "bias", "target_modules")


def _comparable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, list, tuple)):
        return sorted(value)
    return getattr(value, "value", value)  # enums (PeftType) as their string


def check_adapter_dir(weights: Any, config_file: Any, names: Mapping[str, str],
                      shapes: Mapping[str, tuple[int, ...]], config: Any, adapter_name: str, *,
                      strict: bool) -> tuple[list[str], list[str]]:
    """Check an adapter directory against the model's adapter, from headers only (rank 0).

    Args:
        weights: ``adapter_model.safetensors``.
        config_file: ``adapter_config.json``.
        names: ``{file key: model fqn}`` of the adapter (:func:`adapter_file_names`).
        shapes: model fqn -> full shape.
        config: the adapter's ``PeftConfig``.
        adapter_name: its name (for messages).
        strict: missing / unexpected keys and a disagreeing config are errors.

    Returns:
        (missing model fqns, unexpected file keys).

    Raises:
        FileNotFoundError: either file is absent.
        ValueError: a shape differs (always), or the config disagrees (``strict``).
        StateDictMismatchError: ``strict`` and keys missing or unexpected.
    """
    import json
    from pathlib import Path

    from fsdptk._files.safetensors_io import SafetensorsCheckpoint
    from fsdptk.errors import StateDictMismatchError

    weights, config_file = Path(weights), Path(config_file)
    for f in (weights, config_file):
        if not f.is_file():
            raise FileNotFoundError(f"{str(f)!r} does not exist: not a PEFT adapter directory "
                                    "(save_pretrained / fsdptk.hf.save_adapter writes "
                                    "adapter_model.safetensors and adapter_config.json)")
    saved = json.loads(config_file.read_text())
    ours = config.to_dict()
    differ = [f"{k}: {_comparable(saved[k])!r} in {config_file.name}, {_comparable(ours[k])!r} in "
              f"the model's adapter {adapter_name!r}" for k in _CONFIG_FIELDS
              if k in saved and k in ours and _comparable(saved[k]) != _comparable(ours[k])]
    rank_note = next((d for d in differ if d.startswith("r:")), None)
    ckpt = SafetensorsCheckpoint(weights)
    try:
        keys = list(ckpt.keys())
        problems = []
        for key in keys:
            fqn = names.get(key)
            if fqn is None:
                continue
            shape = tuple(ckpt.shape(key))
            if shape != shapes[fqn]:
                problems.append(f"{key!r}: shape {list(shape)} in the file, {list(shapes[fqn])} in the "
                                f"model ({fqn!r})")
    finally:
        ckpt.close()
    if problems:
        raise ValueError(f"cannot load adapter {str(weights.parent)!r} into adapter {adapter_name!r}: "
                         + "; ".join(problems[:10]) + (f" (adapter rank differs: {rank_note})"
                                                       if rank_note else ""))
    if strict and differ:
        raise ValueError(f"adapter {str(weights.parent)!r} does not match the model's adapter "
                         f"{adapter_name!r}: " + "; ".join(differ) + " (strict=False loads it anyway)")
    missing = [fqn for key, fqn in names.items() if key not in set(keys)]
    unexpected = [k for k in keys if k not in names]
    if strict and (missing or unexpected):
        raise StateDictMismatchError.for_keys(missing, unexpected, "adapter " + repr(adapter_name))
    return missing, unexpected


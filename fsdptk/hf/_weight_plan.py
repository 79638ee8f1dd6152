"""What a weight source moves, planned from the model alone (no communication): the items the save
path gathers (:func:`fsdptk._files.save.save_items`, tied tensors once), their conversion to the Hub
layout (:func:`fsdptk.conversions.quantized_layout`, transformers' rules run backwards, as
``save_safetensors`` writes, quantized as its ``quantize=`` does), and for PEFT models the adapter
tensors alone or the LoRA factors to merge into their base weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdptk._engine.layouts import box_shape, full_box
from fsdptk._engine.sources.convert import Node

__all__ = ["Items", "Plan", "plan_items"]

Items = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Plan:
    """The same on every rank (the model's structure; checked with a fingerprint)."""

    keys: list[str]  # model fqns gathered, in order (LoRA factors just before their base weight)
    shapes: list[tuple[int, ...]]  # their full shapes
    model_dtypes: dict[str, torch.dtype]  # model key -> its dtype
    dtypes: dict[str, torch.dtype]  # model key -> the dtype its Hub tensors are given in
    conv_key: dict[str, str]  # model key -> its key in the conversion (its Hub name when none)
    nodes: dict[str, Node] | None  # conversion key -> node over the Hub layout (None: names as they are)
    item_hub: dict[str, list[str]]  # model key -> the Hub tensors it makes (a LoRA factor: its base's)
    hub: list[tuple[str, torch.dtype, tuple[int, ...]]]  # every Hub tensor, in iteration order
    order: dict[str, int]  # Hub name -> its index in ``hub``
    merges: dict[str, tuple[str, str, float]]  # base weight key -> (lora_A key, lora_B key, scaling)
    lora: frozenset[str]  # LoRA factor keys (merged into their base, never yielded themselves)
    written: dict[str, torch.dtype]  # Hub name -> its own dtype, never cast (quantized weights, scales)
    quantization_config: dict[str, Any] | None  # the release's config.json entry (None: unquantized)


def plan_items(model: nn.Module, *, conversion: Any, dtype: torch.dtype | None, adapters: str | None,
               quantize: str | None = None, block_size: Any = (128, 128), quantize_if: Any = None
               ) -> tuple[Plan, Items]:
    """The plan and the model's items to gather, for ``adapters`` ``None``, ``"only"`` or ``"merged"``;
    with ``quantize`` (``adapters=None`` only, checked by the caller) the Hub layout of
    ``save_safetensors(quantize=quantize, block_size=block_size, quantize_if=quantize_if)``.

    Raises:
        TypeError: ``adapters`` given for a model without a PEFT adapter; ``quantize_if`` returned
            something other than a bool.
        ValueError: ``quantize_if`` chose a tensor the format cannot take; nothing to quantize.
        NotImplementedError: ``adapters="merged"`` on anything but plain LoRA on linear layers.
        ConversionError: transformers' save layout does not convert back (as ``save_safetensors``).
    """
    from fsdptk._files.save import save_items

    merges: dict[str, tuple[str, str, float]] = {}
    written: dict[str, torch.dtype] = {}
    quantization_config: dict[str, Any] | None = None
    if adapters is None:
        from fsdptk.conversions import quantized_layout

        items, _, dtypes = save_items(model, "omit", None, dtype)
        layout = quantized_layout(model, conversion, quantize=quantize, block_size=block_size,
                                  quantize_if=quantize_if, dtype=dtype)
        nodes, written, quantization_config = layout.nodes, dict(layout.written), layout.quantization_config
        conv_key = {k: k for k, _ in items}
    elif adapters == "only":
        from fsdptk._plans import peft as _peft

        names = _peft.adapter_file_names(model, _active_adapter(model))
        sd = model.state_dict(keep_vars=True)
        items = [(fqn, sd[fqn]) for fqn in names.values()]
        dtypes = {k: dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype for k, t in items}
        conv_key = {fqn: key for key, fqn in names.items()}
        nodes = None
    else:
        items, dtypes, conv_key, nodes, merges = _merged(model, conversion, dtype)
    lora = frozenset(k for a, b, _ in merges.values() for k in (a, b))
    base_of = {k: base for base, (a, b, _) in merges.items() for k in (a, b)}
    item_hub: dict[str, list[str]] = {}
    pieces: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}  # name -> dtype, shape, last item
    for i, (key, t) in enumerate(items):
        if key in lora:
            continue
        ck = conv_key[key]
        if nodes is not None:
            node = nodes[ck]
            names_here = [(leaf, box_shape(box)) for leaf, box in node.leaves(full_box(node.shape))]
        else:
            names_here = [(ck, tuple(t.shape))]
        item_hub[key] = list(dict.fromkeys(n for n, _ in names_here))
        for name, shape in names_here:
            pieces[name] = (written.get(name, dtypes[key]), pieces[name][1] if name in pieces else shape, i)
    for key in lora:
        item_hub[key] = item_hub[base_of[key]]
    first = {name: j for j, name in enumerate(pieces)}
    hub_order = sorted(pieces, key=lambda n: (pieces[n][2], first[n]))
    hub = [(n, pieces[n][0], pieces[n][1]) for n in hub_order]
    plan = Plan(keys=[k for k, _ in items], shapes=[tuple(t.shape) for _, t in items],
                model_dtypes={k: t.dtype for k, t in items}, dtypes=dtypes, conv_key=conv_key, nodes=nodes,
                item_hub=item_hub, hub=hub, order={n: j for j, n in enumerate(hub_order)}, merges=merges,
                lora=lora, written=written, quantization_config=quantization_config)
    return plan, items


def _active_adapter(model: nn.Module) -> str:
    """The PEFT model's one active adapter (``"default"`` unless set otherwise)."""
    from fsdptk._plans import peft as _peft

    configs = _peft.peft_configs(model)
    if configs is None:
        raise TypeError(f"adapters is for PEFT models: {type(model).__name__} has no PEFT adapter (no "
                        "peft_config of PeftConfig objects); pass adapters=None, or wrap the model with "
                        "peft.get_peft_model(model, config) before sharding")
    active = getattr(model, "active_adapter", "default")
    if isinstance(active, (list, tuple)):
        if len(active) != 1:
            raise NotImplementedError(f"adapters: the model has {len(active)} active adapters {list(active)}; "
                                      "activate one (model.set_adapter(name))")
        active = active[0]
    _peft.require_adapter(model, active)
    return str(active)


def _merged(model: nn.Module, conversion: Any, dtype: torch.dtype | None
            ) -> tuple[Items, dict[str, torch.dtype], dict[str, str], dict[str, Node] | None,
                       dict[str, tuple[str, str, float]]]:
    """``adapters="merged"``: the base weights under the base names (LoRA factors placed just
    before the weight they merge into) and the conversion of the base model's Hub layout."""
    from fsdptk._files.save import save_items
    from fsdptk._plans import peft as _peft
    from fsdptk.conversions import resolve_save

    adapter = _active_adapter(model)
    found = _peft.base_names(model)
    assert found is not None, "a PEFT model (checked by _active_adapter)"
    base_key, _ = found
    merges = _lora_merges(model, adapter)
    every, _, dtypes = save_items(model, "omit", None, dtype)
    sd = model.state_dict(keep_vars=True)
    items: Items = []
    for key, t in every:
        if key not in base_key:
            continue
        if key in merges:
            a, b, _ = merges[key]
            items += [(a, sd[a]), (b, sd[b])]
            dtypes[a], dtypes[b] = sd[a].dtype, sd[b].dtype
        items.append((key, t))
    conv_key = {k: base_key[k] for k, _ in items if k in base_key}
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    shapes = {base_key[k]: (tuple(t.shape), t.dtype) for k, t in items if k in base_key}
    nodes = resolve_save(base, conversion, shapes)
    return items, dtypes, conv_key, nodes, merges


def _lora_merges(model: nn.Module, adapter: str) -> dict[str, tuple[str, str, float]]:
    """``{base weight key: (lora_A key, lora_B key, scaling)}`` of every LoRA layer of ``adapter``.

    Raises:
        NotImplementedError: a tuner or layer that is not plain LoRA on a linear layer (named).
    """
    from peft.tuners.lora import LoraLayer

    config = getattr(model, "peft_config", {}).get(adapter)
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None)))
    if kind != "LORA":
        raise NotImplementedError(f"adapters='merged' merges LoRA adapters; adapter {adapter!r} is {kind} "
                                  "(use adapters='only')")
    out: dict[str, tuple[str, str, float]] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, LoraLayer) or adapter not in getattr(mod, "lora_A", {}):
            continue
        base = mod.get_base_layer()
        why = None
        if type(base) is not nn.Linear:
            why = f"its base layer is {type(base).__name__}, not torch.nn.Linear"
        elif getattr(mod, "use_dora", {}).get(adapter, False):
            why = "it uses DoRA"
        elif getattr(mod, "fan_in_fan_out", False):
            why = "it has fan_in_fan_out=True"
        elif getattr(mod, "lora_bias", {}).get(adapter, False):
            why = "it has a LoRA bias"
        elif getattr(mod, "merged_adapters", []):
            why = f"adapters {mod.merged_adapters} are already merged into it"
        if why is not None:
            raise NotImplementedError(f"adapters='merged': LoRA layer {name!r}: {why}; fsdptk merges plain LoRA "
                                      "on linear layers (use adapters='only' for this model)")
        out[f"{name}.base_layer.weight"] = (f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight",
                                            float(mod.scaling[adapter]))
    return out

"""The Hub items a model emits, planned from the model alone (no communication, no tensor moves):
one plan that :func:`fsdptk.save_safetensors`, :func:`fsdptk.hf.save_adapter` and
:func:`fsdptk.hf.weight_source` each give a destination (files, the adapter file on rank 0, the
source's owners).

- :func:`save_items`: the model's tensors a save gathers (a tied tensor once, or under every key)
  and the dtype each is written in;
- :func:`adapter_items`: one PEFT adapter's tensors under the keys PEFT's ``save_pretrained``
  writes (``save_adapter``);
- :func:`resolve_save` / :func:`save_layout` / :func:`quantized_layout`: their conversion to the
  Hub layout (transformers' rules run backwards), quantized as ``save_safetensors(quantize=...)``
  writes it (:mod:`fsdptk._plans.quant_save` choosing the tensors);
- :func:`plan_items`: all of it for a weight source, and for PEFT models the adapter tensors alone
  or the LoRA factors to merge into their base weights (:mod:`fsdptk._plans.lora_merge`: PEFT's
  own ``merge_and_unload`` arithmetic for ``lora.Linear`` and for ``ParamWrapper`` on fused
  experts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdptk._core.names import tie_groups
from fsdptk._engine.layouts import box_shape, full_box
from fsdptk._engine.sources.convert import ConversionProblem, Node
from fsdptk._plans.lora_merge import Merge, lora_merges
from fsdptk.conversions import Conversion, ConversionArg
from fsdptk.errors import ConversionError

__all__ = ["Items", "Plan", "SaveLayout", "adapter_items", "plan_items", "quantized_layout",
           "resolve_save", "save_items", "save_layout"]

Items = list[tuple[str, torch.Tensor]]


# ----------------------------------------------------------------------------------------------
# the model's items and the Hub layout they are written in
def save_items(model: nn.Module, tied: str, dtype: torch.dtype | None
               ) -> tuple[Items, dict[str, torch.dtype]]:
    """(model items to gather, {model key: dtype in the file}); ``tied="omit"``: a tied tensor
    once, under its canonical key."""
    if tied not in ("omit", "both"):
        raise ValueError(f"tied must be 'omit' or 'both', got {tied!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    sd = model.state_dict(keep_vars=True)
    skip = {k for g in tie_groups(model) for k in g[1:]} if tied == "omit" else set()
    items = [(k, t) for k, t in sd.items() if k not in skip]
    return items, _file_dtypes(items, dtype)


def adapter_items(model: nn.Module, adapter_name: str) -> tuple[Items, dict[str, str], dict[str, torch.dtype]]:
    """``save_adapter``'s items: (the adapter's tensors under the keys PEFT's ``save_pretrained``
    writes, {key: file key}, {key: its own dtype}).

    Raises:
        TypeError / KeyError / NotImplementedError: :func:`fsdptk._plans.peft.adapter_file_names`'.
    """
    from fsdptk._plans import peft as _peft

    names = _peft.adapter_file_names(model, adapter_name)
    sd = model.state_dict(keep_vars=True)
    items = [(key, sd[fqn]) for key, fqn in names.items()]
    out_name = {key: key for key, _ in items}
    dtypes = {key: t.dtype for key, t in items}
    return items, out_name, dtypes


def resolve_save(model: Any, conversion: ConversionArg, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                 ) -> dict[str, Node] | None:
    """Model key -> node over the checkpoint layout a save writes; ``None``: the model's own keys."""
    if conversion is None:
        return None
    if isinstance(conversion, Conversion):
        raise TypeError("a save writes the Hub layout of a transformers model (conversion='auto') or the "
                        "model's own keys (conversion=None, with rename= for other names); a declared "
                        "Conversion applies to loads")
    if conversion != "auto":
        raise TypeError(f"conversion must be 'auto', a fsdptk.conversions.Conversion or None, got {conversion!r}")
    from fsdptk._plans.hf_convert import hub_save_nodes, is_hf_model

    if not is_hf_model(model):
        return None
    try:
        return hub_save_nodes(model, shapes)
    except ConversionProblem as e:
        raise ConversionError(str(e)) from None



def save_layout(model: Any, conversion: ConversionArg) -> dict[str, Node] | None:
    """Model key -> node over the checkpoint layout a save of ``model`` writes (every key of
    ``model.state_dict()``); ``None``: the model's own keys."""
    shapes = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict(keep_vars=True).items()}
    return resolve_save(model, conversion, shapes)


class SaveLayout(NamedTuple):
    """What a save writes (:func:`quantized_layout`): ``nodes`` (model key -> node over the
    checkpoint layout; ``None``: the model's own keys, unquantized), ``written`` (checkpoint keys
    written in their own dtype: quantized weights and their scales), ``quantization_config`` (for
    ``config.json``; ``None``: unquantized)."""

    nodes: dict[str, Node] | None
    written: dict[str, torch.dtype]
    quantization_config: dict[str, Any] | None


def quantized_layout(model: Any, conversion: ConversionArg, *, quantize: str | None, block_size: Any = (128, 128),
                     quantize_if: Any = None, dtype: torch.dtype | None = None) -> SaveLayout:
    """The layout a save of ``model`` writes, quantized as ``quantize`` says (``None``: as
    :func:`save_layout`): the checkpoint layout (Hub or the model's own), its chosen tensors
    replaced by the release format's (FP8: ``<w>`` + ``<w>_scale_inv``; MXFP4: ``<w>_blocks`` +
    ``<w>_scales``), as trees whose inverse quantizes on the writer. ``dtype``: the floating dtype
    written (what is quantized, and what ``quantize_if`` sees); default the model's.

    Raises:
        ValueError: a bad ``quantize`` or ``block_size``; ``quantize_if`` chose a tensor the format
            cannot take; nothing to quantize (``mxfp4`` of a model without gpt-oss experts).
        TypeError: ``quantize_if`` is not callable, or returned something other than a bool.
        ConversionError: the quantized layout does not convert back to the model's tensors.
    """
    from fsdptk._plans.quant_save import plan_quantized, quant_format

    fmt = quant_format(quantize, block_size, quantize_if)
    if fmt is None:
        return SaveLayout(save_layout(model, conversion), {}, None)
    from fsdptk._engine.sources import TensorMeta
    from fsdptk._plans.hf_convert import hub_file_metas, hub_save_nodes, quantized_leaves

    shapes = {k: (tuple(t.shape), dtype if dtype is not None and t.dtype.is_floating_point else t.dtype)
              for k, t in model.state_dict(keep_vars=True).items()}
    try:
        trees = resolve_save(model, conversion, shapes)
        metas = hub_file_metas(model, shapes) if trees is not None else None
        if metas is None:
            trees, metas = None, {k: TensorMeta(s, d) for k, (s, d) in shapes.items()}
        owners = {f: k for k, n in trees.items() for f in n.files()} if trees is not None else {}
        plan = plan_quantized(model, fmt, metas, owners, quantize_if)
        if trees is None:
            nodes = quantized_leaves(model, plan.metas, plan.config)
        else:
            nodes = hub_save_nodes(model, shapes, metas=plan.metas, quant=plan.config) or {}
    except ConversionProblem as e:
        raise ConversionError(str(e)) from None
    return SaveLayout(nodes, plan.written, plan.config)


# ----------------------------------------------------------------------------------------------
# a weight source's plan
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
    merges: dict[str, Merge]  # base weight key -> the LoRA layer merged into it
    lora: frozenset[str]  # LoRA factor keys (merged into their base, never yielded themselves)
    written: dict[str, torch.dtype]  # Hub name -> its own dtype, never cast (quantized weights, scales)
    quantization_config: dict[str, Any] | None  # the release's config.json entry (None: unquantized)


def plan_items(model: nn.Module, *, conversion: Any, dtype: torch.dtype | None, adapters: str | None,
               quantize: str | None = None, block_size: Any = (128, 128), quantize_if: Any = None
               ) -> tuple[Plan, Items]:
    """The plan and the model's items to gather, for ``adapters`` ``None``, ``"only"`` or ``"merged"``;
    with ``quantize`` (``adapters=None`` only, checked by the caller) the Hub layout of
    ``save_safetensors(quantize=quantize, block_size=block_size, quantize_if=quantize_if)``.

    Planned top down: the mode's Hub layout over every tensor it may gather (conversion,
    quantization, adapters), the Hub tensors each makes, then the items (a tied tensor once, under
    its canonical key, as :func:`save_items` gathers it) and their Hub tensors in order.

    Raises:
        TypeError: ``adapters`` given for a model without a PEFT adapter; ``quantize_if`` returned
            something other than a bool.
        ValueError: ``quantize_if`` chose a tensor the format cannot take; nothing to quantize.
        NotImplementedError: ``adapters="merged"`` on anything but plain LoRA on linear layers and
            PEFT's ``ParamWrapper`` (LoRA on a parameter, e.g. fused MoE experts), named.
        ConversionError: transformers' save layout does not convert back (as ``save_safetensors``).

    Examples:
        >>> import torch
        >>> m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 3), "b": torch.nn.Linear(2, 3)})
        >>> m.b.weight = m.a.weight  # tied: gathered once, under its canonical key
        >>> plan, items = plan_items(m, conversion=None, dtype=torch.bfloat16, adapters=None)
        >>> plan.hub  # doctest: +NORMALIZE_WHITESPACE
        [('a.weight', torch.bfloat16, (3, 2)), ('a.bias', torch.bfloat16, (3,)),
         ('b.bias', torch.bfloat16, (3,))]
    """
    layout = _layout(model, conversion, dtype, adapters, quantize, block_size, quantize_if)
    made = _hub_shapes(layout.nodes)
    aliases = {k for g in tie_groups(model) for k in g[1:]} if layout.once else set()
    items = [(k, t) for k, t in layout.items if k not in aliases]
    dtypes = {k: d for k, d in layout.dtypes.items() if k not in aliases}
    conv_key = {k: layout.conv_key[k] for k, _ in items if k in layout.conv_key}
    merges, written = layout.merges, layout.written
    lora = frozenset(k for m in merges.values() for k in (m.a, m.b))
    base_of = {k: base for base, m in merges.items() for k in (m.a, m.b)}
    item_hub: dict[str, list[str]] = {}
    pieces: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}  # name -> dtype, shape, last item
    for i, (key, t) in enumerate(items):
        if key in lora:
            continue
        ck = conv_key[key]
        names_here = made[ck] if made is not None else [(ck, tuple(t.shape))]
        item_hub[key] = list(dict.fromkeys(n for n, _ in names_here))
        for name, shape in names_here:
            pieces[name] = (written.get(name, dtypes[key]), pieces[name][1] if name in pieces else shape, i)
    for key in lora:
        item_hub[key] = item_hub[base_of[key]]
    first = {name: j for j, name in enumerate(pieces)}
    hub_order = sorted(pieces, key=lambda n: (pieces[n][2], first[n]))
    hub = [(n, pieces[n][0], pieces[n][1]) for n in hub_order]
    plan = Plan(keys=[k for k, _ in items], shapes=[tuple(t.shape) for _, t in items],
                model_dtypes={k: t.dtype for k, t in items}, dtypes=dtypes, conv_key=conv_key, nodes=layout.nodes,
                item_hub=item_hub, hub=hub, order={n: j for j, n in enumerate(hub_order)}, merges=merges,
                lora=lora, written=written, quantization_config=layout.quantization_config)
    return plan, items


class _Layout(NamedTuple):
    """One mode's Hub layout, over every tensor the mode may gather (a tied tensor's aliases too:
    :func:`plan_items` drops them once the Hub tensors are known)."""

    items: Items  # the mode's tensors, in order (LoRA factors just before their base weight)
    dtypes: dict[str, torch.dtype]  # model key -> the dtype its Hub tensors are given in
    conv_key: dict[str, str]  # model key -> its key in the conversion (its Hub name when none)
    nodes: dict[str, Node] | None  # conversion key -> node over the Hub layout (None: names as they are)
    merges: dict[str, Merge]  # base weight key -> the LoRA layer merged into it
    written: dict[str, torch.dtype]  # Hub name -> its own dtype (quantized weights, scales)
    quantization_config: dict[str, Any] | None  # the release's config.json entry (None: unquantized)
    once: bool  # a tied tensor once (the model's own tensors); False: PEFT's file keys, as they are


def _layout(model: nn.Module, conversion: Any, dtype: torch.dtype | None, adapters: str | None,
            quantize: str | None, block_size: Any, quantize_if: Any) -> _Layout:
    """The Hub layout of ``adapters`` ``None`` (the model's tensors, converted and quantized as a
    save writes them), ``"only"`` (the active adapter under PEFT's names) or ``"merged"``."""
    if adapters is None:
        saved = quantized_layout(model, conversion, quantize=quantize, block_size=block_size,
                                 quantize_if=quantize_if, dtype=dtype)
        every = list(model.state_dict(keep_vars=True).items())
        return _Layout(every, _file_dtypes(every, dtype), {k: k for k, _ in every}, saved.nodes, {},
                       dict(saved.written), saved.quantization_config, once=True)
    if adapters == "only":
        from fsdptk._plans import peft as _peft

        names = _peft.adapter_file_names(model, _active_adapter(model))
        sd = model.state_dict(keep_vars=True)
        items = [(fqn, sd[fqn]) for fqn in names.values()]
        return _Layout(items, _file_dtypes(items, dtype), {fqn: key for key, fqn in names.items()}, None, {}, {},
                       None, once=False)
    return _merged(model, conversion, dtype)


def _file_dtypes(items: Items, dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    """Model key -> the dtype a save writes it in: ``dtype`` for a floating tensor (when given),
    else its own."""
    return {k: dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype for k, t in items}


def _hub_shapes(nodes: dict[str, Node] | None) -> dict[str, list[tuple[str, tuple[int, ...]]]] | None:
    """Conversion key -> the Hub tensors its node makes, each with the shape of the node's piece of
    it, in the node's order; ``None`` without a conversion (each key is its own Hub name)."""
    if nodes is None:
        return None
    out: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for ck, node in nodes.items():
        out[ck] = [(leaf, box_shape(box)) for leaf, box in node.leaves(full_box(node.shape))]
    return out


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


def _merged(model: nn.Module, conversion: Any, dtype: torch.dtype | None) -> _Layout:
    """``adapters="merged"``: the base weights under the base names (LoRA factors placed just
    before the weight they merge into) and the conversion of the base model's Hub layout, over
    every base key (a tied tensor's aliases too, as a save of the base model lays them out)."""
    from fsdptk._plans import peft as _peft

    adapter = _active_adapter(model)
    found = _peft.base_names(model)
    assert found is not None, "a PEFT model (checked by _active_adapter)"
    base_key, _ = found
    merges = lora_merges(model, adapter)
    sd = model.state_dict(keep_vars=True)
    dtypes = _file_dtypes(list(sd.items()), dtype)
    items: Items = []
    for key, t in sd.items():
        if key not in base_key:
            continue
        if key in merges:
            a, b = merges[key].a, merges[key].b
            items += [(a, sd[a]), (b, sd[b])]
            dtypes[a], dtypes[b] = sd[a].dtype, sd[b].dtype
        items.append((key, t))
    conv_key = {k: base_key[k] for k, _ in items if k in base_key}
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    shapes = {base_key[k]: (tuple(t.shape), t.dtype) for k, t in items if k in base_key}
    nodes = resolve_save(base, conversion, shapes)
    return _Layout(items, dtypes, conv_key, nodes, merges, {}, None, once=True)

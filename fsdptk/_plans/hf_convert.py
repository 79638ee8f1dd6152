"""transformers' own checkpoint conversions, planned per shard by the engine's conversion views.

transformers 5.x declares, per model family, how the checkpoints on the Hub map to its modules
(``transformers.conversion_mapping.get_model_conversion_mapping(model)``: a list of
``WeightRenaming`` and ``WeightConverter(source_patterns, target_patterns, operations)``), and
applies it in ``from_pretrained`` by reading every source tensor whole, then converting. Here the
same mapping is used as data: the keys are renamed by transformers' own
``core_model_loading.rename_source_key`` (so every renaming rule, scope and prefix behaves exactly
as in transformers), and each converter's operations are replayed on the engine's
:class:`~fsdptk._engine.sources.convert.Node` trees (``MergeModulelist`` -> ``Stack``,
``Concatenate`` -> ``Concat``, ``Chunk`` -> ``Chunk``, ``Transpose`` -> ``Transpose``), which read
only what each rank's box covers; ``Transpose(check_dims=True)`` is decided from the shapes (the
checkpoint's against the model's). A checkpoint that needs an operation without a per-box
translation (``Interleave``, ``Split``, ``PermuteForRope``, ...) is refused when the trees are
built, for loads and saves alike, naming the operation and the keys: before any tensor moves.

The save direction asks transformers for the checkpoint layout ``save_pretrained`` writes
(``core_model_loading.revert_weight_conversion`` on shape-only ``meta`` tensors), builds the same
trees over it, and writes each model tensor back through the trees' inverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from fsdptk._engine.sources import TensorMeta
from fsdptk._engine.sources.convert import (
    Chunk,
    Concat,
    ConversionProblem,
    Leaf,
    Node,
    Op,
    Stack,
    Transpose,
    apply_ops,
)

__all__ = ["built_class", "hub_nodes", "hub_file_metas", "hub_save_nodes", "is_hf_model"]


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (transformers already imported)."""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def built_class(module: nn.Module) -> type:
    """The class ``module`` was built as: FSDP2's ``fully_shard`` (and ``replicate``) swap a
    module's class for a dynamic subclass named after it (``FSDPLlamaForCausalLM``, whose
    ``__module__`` is torch's), so the class as built is the first of its MRO that is not an
    ``FSDPModule``.

    Examples:
        >>> built_class(torch.nn.Linear(2, 2)).__name__
        'Linear'
    """
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _as_built(module: nn.Module) -> nn.Module:
    """``module`` as transformers sees a model it built: where ``fully_shard`` swapped the class of
    a module in the tree (the root's, at least, after ``shard_model``), a stand-in of the class it
    was built as, sharing the module's attributes (a shallow copy of its ``__dict__``, its
    children's stand-ins in ``_modules``); ``module`` itself where nothing in its tree was swapped.

    transformers resolves a model's conversion mapping from ``type(submodule).__name__`` (mappings
    registered by class name, e.g. ``GPTNeoXForCausalLM``'s ``embed_out`` -> ``lm_head``) and skips
    a class whose ``__module__`` is not transformers' as custom code; FSDP2's ``FSDP<Name>`` has
    neither. The stand-in is only read (names, config, class attributes), never run, and the model
    is not changed (another thread may be using it).
    """
    children = {name: None if child is None else _as_built(child) for name, child in module._modules.items()}
    cls = built_class(module)
    if cls is type(module) and all(children[n] is c for n, c in module._modules.items()):
        return module
    stand: nn.Module = object.__new__(cls)
    state = dict(module.__dict__)
    state["_modules"] = children
    object.__setattr__(stand, "__dict__", state)
    return stand


def _mapping(model: nn.Module, *, legacy: bool) -> list[Any]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    transforms = list(get_model_conversion_mapping(cast(Any, _as_built(model)), add_legacy=legacy))
    if not legacy:  # as revert_weight_conversion does for a model not built by from_pretrained
        transforms = [t for t in transforms if not isinstance(t, PrefixChange)]
    return transforms


@dataclass(eq=False)
class _Group:
    """The checkpoint tensors one converter combines into one layer: ``{source pattern: [(key,
    node)]}`` in the checkpoint's order."""

    converter: Any
    layer: str
    model: Any
    inputs: dict[str, list[tuple[str, Node]]]

    def keys(self) -> list[str]:
        return [k for pairs in self.inputs.values() for k, _ in pairs]


def _translate(op: Any) -> Op | None:
    """transformers' op -> the engine's op, or None (no per-box translation; a ``Transpose`` with
    ``check_dims`` is decided from the shapes by the caller)."""
    from transformers import core_model_loading as cml

    kind = type(op)
    if kind is cml.MergeModulelist:
        return Stack(op.dim)
    if kind is cml.Concatenate:
        return Concat(op.dim)
    if kind is cml.Chunk:
        return Chunk(op.dim)
    if kind is cml.Transpose and not op.check_dims:
        return Transpose(op.dim0, op.dim1)
    return None


def _index_template(keys: list[tuple[int, str]]) -> str | None:
    """``'...experts.{}.up_proj.weight'`` from a pattern's (index, key) list: the dotted segment
    that holds the index."""
    if not keys:
        return None
    i0, k0 = keys[0]
    parts = k0.split(".")
    spots = [j for j, p in enumerate(parts) if p == str(i0)]
    if len(keys) > 1:
        other = keys[1][1].split(".")
        spots = [j for j in spots if j < len(other) and other[j] != parts[j]] or spots
    if not spots:
        return None
    parts[spots[-1]] = "{}"
    return ".".join(parts)


def hub_nodes(model: nn.Module, metas: Mapping[str, TensorMeta], *, legacy: bool = True,
              quant: Mapping[str, Any] | None = None, shapes: Mapping[str, tuple[int, ...]] | None = None,
              ) -> dict[str, Node] | None:
    """The checkpoint ``metas`` (key -> shape and dtype) under ``model``'s keys, as transformers'
    ``from_pretrained`` would convert it; ``None`` when transformers declares no conversion for
    the model (its keys are read as they are). ``quant``: the ``quantization_config`` of the
    checkpoint when it is not the model's own (a quantized save's layout). ``shapes``: the model's
    keys and shapes when not its own ``state_dict``'s (a PEFT model's base under the base keys).

    Raises:
        ConversionProblem: two checkpoint keys for one model key; tensors that do not stack (both
            shapes); a per-expert tensor missing (named); an operation fsdptk has no per-shard plan
            for (named, with the checkpoint keys it would combine); a quantized layout that does
            not fit (see :func:`quantized_leaves`).
    """
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    transforms = _mapping(model, legacy=legacy)
    leaves = quantized_leaves(model, metas, quant)
    if not transforms and all(isinstance(n, Leaf) for n in leaves.values()):
        return None
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    model_shapes = (dict(shapes) if shapes is not None
                    else {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()})
    prefix = getattr(model, "base_model_prefix", None) or None
    nodes: dict[str, Node] = {}
    origin: dict[str, str] = {}
    groups: dict[str, _Group] = {}
    for key in sorted(leaves, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, model_shapes)
        if pattern is None:
            if target in origin:
                raise ConversionProblem(f"checkpoint keys {origin[target]!r} and {key!r} both load into "
                                      f"{target!r}")
            origin[target] = key
            nodes[target] = leaves[key]
            continue
        conv = by_pattern[pattern]
        group = groups.setdefault(target, _Group(conv, target, model, {}))
        group.inputs.setdefault(pattern, []).append((key, leaves[key]))
    for group in groups.values():
        for target, node in _convert_group(group, model_shapes).items():
            if target in origin:
                raise ConversionProblem(f"checkpoint keys {origin[target]!r} and {node.files()[0]!r} both "
                                      f"load into {target!r}")
            origin[target] = node.files()[0]
            nodes[target] = node
    return nodes


def _convert_group(group: _Group, model_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Node]:
    """The group's target nodes.

    Raises:
        ConversionProblem: an operation fsdptk has no per-box plan for (named, with the keys).
    """
    conv = group.converter
    sources, targets = list(conv.source_patterns), list(conv.target_patterns)
    ops: list[Op] = []
    for op in conv.operations:
        got = _translate(op)
        if got is None:
            checked = _check_dims_plan(op, group, model_shapes, first=not ops)
            if checked == "keep":
                continue  # a tensor already in the model's layout: as it is
            if checked == "transpose":
                got = Transpose(op.dim0, op.dim1)
        if got is None:
            keys = group.keys()
            raise ConversionProblem(
                f"{group.layer!r}: transformers converts checkpoint keys {keys[:4]}"
                f"{f' (and {len(keys) - 4} more)' if len(keys) > 4 else ''} with {type(op).__name__}, "
                "an operation fsdptk has no per-shard plan for; pass conversion=None to read or write the "
                "model's own keys, or declare the rules with fsdptk.conversions (docs/layouts.md)")
        if type(op).__name__ == "Chunk" and op.num_shards_attribute is not None:
            targets = op.get_target_patterns(targets, config=group.model.config)
        ops.append(got)
    _check_experts(group, model_shapes, ops)
    inputs: dict[str, list[Node]] = {p: [node for _, node in group.inputs[p]] for p in sources if p in group.inputs}
    if not ops:  # every operation kept the layout: the one tensor, renamed
        (only,) = [n for ns in inputs.values() for n in ns]
        out: dict[str, Node] = {targets[0]: only}
    else:
        out = apply_ops(ops, inputs, sources, targets)
    full = group.layer.replace("*.", "0.") if "*." in group.layer else group.layer
    named: dict[str, Node] = {}
    for pattern, node in out.items():
        found = next((full.partition(k) for k in out if k in full), None)
        if found is None:
            named[pattern] = node
            continue
        pre, _, post = found
        named[pre + pattern + post] = node
    return named


def _check_experts(group: _Group, model_shapes: Mapping[str, tuple[int, ...]], ops: list[Op]) -> None:
    """Name a missing per-expert tensor (``...experts.3.up_proj.weight``) before the tensors are
    combined: every source pattern of a stacked target needs one tensor per index, as many as the
    model's tensor has along the stacked dim."""
    stack_dims = [op.dim for op in ops if isinstance(op, Stack)]
    if not stack_dims:
        return
    want = model_shapes.get(group.layer)
    counts = {p: len(keys) for p, keys in group.inputs.items()}
    expected = want[stack_dims[0]] if want is not None and len(want) > stack_dims[0] else max(counts.values())
    missing: list[str] = []
    for pattern in group.converter.source_patterns:
        keys = group.inputs.get(pattern, [])
        indexed = []
        for k, _ in keys:
            digits = [int(p) for p in k.split(".") if p.isdigit()]
            indexed.append((digits[-1] if digits else -1, k))
        have = {i for i, _ in indexed}
        template = _index_template(sorted(indexed)) or _index_template(
            sorted((i, k) for ks in group.inputs.values() for i, k in
                   [([int(p) for p in k.split(".") if p.isdigit()][-1], k) for k, _ in ks]))
        if template is None:
            continue
        if not keys:  # a whole pattern absent: name it from another pattern's keys
            other = next(iter(group.inputs.values()))[0][0]
            missing.append(f"{pattern!r} (e.g. next to {other!r})")
            continue
        missing += [template.format(i) for i in range(expected) if i not in have]
    if missing:
        raise ConversionProblem(
            f"{group.layer!r} is stacked from {expected} per-expert tensors of each of "
            f"{list(group.converter.source_patterns)}; the checkpoint lacks {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}")


def _check_dims_plan(op: Any, group: _Group, model_shapes: Mapping[str, tuple[int, ...]], *, first: bool
                     ) -> Literal["keep", "transpose"] | None:
    """transformers' ``Transpose(check_dims=True)`` planned from the shapes, as transformers runs
    it: ``"keep"`` when the checkpoint tensor already has the model's shape, else ``"transpose"``;
    ``None`` when ``op`` is another operation or the shapes cannot decide (not the first operation
    of a one-tensor group, or a layer the model lacks)."""
    if type(op).__name__ != "Transpose" or not getattr(op, "check_dims", False):
        return None
    nodes = [n for pairs in group.inputs.values() for _, n in pairs]
    want = model_shapes.get(group.layer)
    if not first or len(nodes) != 1 or want is None:
        return None
    return "keep" if tuple(nodes[0].shape) == tuple(want) else "transpose"


# ----------------------------------------------------------------------------------------------
# quantized releases: the checkpoint's (weight, scale) pairs as dequantizing leaves
def quantization(model: nn.Module) -> dict[str, Any] | None:
    """The model config's ``quantization_config`` as a dict (``None``: not a quantized release)."""
    config = getattr(model, "config", None)
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(vars(quant))
    return dict(quant)


def quantized_leaves(model: nn.Module, metas: Mapping[str, TensorMeta], quant: Mapping[str, Any] | None = None
                     ) -> dict[str, Node]:
    """Checkpoint key -> leaf, a quantized weight and its scales becoming one dequantizing leaf
    under the weight's name (FP8: ``<w>`` + ``<w>_scale_inv``; MXFP4: ``<w>_blocks`` +
    ``<w>_scales`` as ``<w>``), as the ``quantization_config`` says: ``quant``, or the model
    config's (a load of a quantized release). The leaves' ``split`` quantizes (a quantized save).

    Raises:
        ConversionProblem: an unknown ``quant_method``; a ``weight_block_size`` that is not two
            positive ints (the value named); a quantized weight without its scales, a weight
            under 2-D with block scales, or scales whose rank, grid or dtype do not fit the weight
            and the block (key, shapes and block named); MXFP4 blocks and scales that are not a
            uint8 pair of matching shapes.
    """
    quant = quantization(model) if quant is None else quant
    plain = {k: Leaf(k, tuple(m.shape), m.dtype) for k, m in metas.items()}
    if quant is None:
        return dict(plain)
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8_leaves(plain, quant)
    if method == "mxfp4":
        return _mxfp4_leaves(plain)
    raise ConversionProblem(
        f"the checkpoint's config.json has quantization_config quant_method {method!r}; fsdptk dequantizes "
        "'fp8' (block-scaled float8 with weight_scale_inv) and 'mxfp4' (gpt-oss blocks and scales) on read")


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _fp8_leaves(plain: dict[str, Leaf], quant: Mapping[str, Any]) -> dict[str, Node]:
    from fsdptk._engine.sources.quant import FP8Blocks, block_size_problem

    block = quant.get("weight_block_size")
    problem = None if block is None else block_size_problem(block)
    if problem is not None:
        raise ConversionProblem(f"config.json's quantization_config has weight_block_size {block!r}: {problem}, "
                                "e.g. [128, 128] (or no weight_block_size: one scale per tensor)")
    out: dict[str, Node] = {}
    scales = {k for k in plain if k.endswith("_scale_inv")}
    for key, leaf in plain.items():
        if key in scales or key.endswith(("activation_scale", ".input_scale")):
            continue  # consumed with their weight; static activation scales have no use dequantized
        scale_key = (key[:-len(".weight")] + ".weight_scale_inv") if key.endswith(".weight") else key + "_scale_inv"
        if scale_key in plain:
            if block is not None:
                grid = (block[0], block[1])
            elif len(leaf.shape) >= 2:  # one scale per tensor: the whole weight is one block
                grid = (max(leaf.shape[-2], 1), max(leaf.shape[-1], 1))
            else:  # FP8Blocks refuses a weight under 2-D, naming it
                grid = (1, 1)
            out[key] = FP8Blocks(leaf, plain[scale_key], grid, ue8m0=quant.get("scale_fmt") == "ue8m0")
        elif leaf.dtype in _FP8:
            raise ConversionProblem(
                f"{key!r} (shape {list(leaf.shape)}, {leaf.dtype}) is quantized but the checkpoint has no "
                f"{scale_key!r} (block {block}): its scales are missing")
        else:
            out[key] = leaf
    lone = sorted(k for k in scales if k.replace(".weight_scale_inv", ".weight").removesuffix("_scale_inv")
                  not in plain and k.removesuffix("_scale_inv") not in plain)
    if lone:
        raise ConversionProblem(f"scales without their weight in the checkpoint: {lone[:8]}")
    return out


def _mxfp4_leaves(plain: dict[str, Leaf]) -> dict[str, Node]:
    from fsdptk._engine.sources.quant import MXFP4Blocks

    out: dict[str, Node] = {}
    for key, leaf in plain.items():
        if key.endswith("_scales") and key.removesuffix("_scales") + "_blocks" in plain:
            continue
        if key.endswith("_blocks"):
            base = key.removesuffix("_blocks")
            if base + "_scales" not in plain:
                raise ConversionProblem(f"{key!r} (shape {list(leaf.shape)}) has no {base + '_scales'!r}: "
                                        "MXFP4 blocks need their scales")
            out[base] = MXFP4Blocks(leaf, plain[base + "_scales"], base)
            continue
        out[key] = leaf
    return out


def hub_file_metas(model: nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                   ) -> dict[str, TensorMeta] | None:
    """The checkpoint layout transformers' ``save_pretrained`` writes for ``model`` (key -> shape
    and dtype), from the model's shapes alone; ``None`` when nothing is converted.

    ``shapes`` maps each model key to save to its full shape and dtype.

    Raises:
        ConversionProblem: transformers' reverse operations cannot run on the shapes alone (the
            operation's own error quoted).
    """
    from transformers.core_model_loading import revert_weight_conversion

    if not _mapping(model, legacy=False):
        return None
    meta_sd = {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in shapes.items()}
    try:
        reverted = revert_weight_conversion(cast(Any, _as_built(model)), meta_sd)
    except Exception as e:  # noqa: BLE001 - an operation that cannot run on shapes alone
        raise ConversionProblem(
            f"transformers' save layout for {type(model).__name__} cannot be planned from the shapes "
            f"({type(e).__name__}: {e}); save with conversion=None (the model's own layout)") from e
    if reverted is meta_sd or set(reverted) == set(meta_sd):
        return None
    return {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in reverted.items()}


def hub_save_nodes(model: nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
                   metas: Mapping[str, TensorMeta] | None = None, quant: Mapping[str, Any] | None = None
                   ) -> dict[str, Node] | None:
    """Model key -> node over ``save_pretrained``'s layout, for writing the Hub layout; ``None``
    when the model's own keys are the Hub's. ``metas`` (with ``quant``, its
    ``quantization_config``): the layout to write instead, a quantized release of that layout.

    Raises:
        ConversionProblem: transformers' reverse mapping and its forward mapping disagree (a key or
            a shape), which would write a checkpoint transformers cannot load back.
    """
    metas = hub_file_metas(model, shapes) if metas is None else metas
    if metas is None:
        return None
    nodes = hub_nodes(model, metas, legacy=False, quant=quant) or {}
    for key, (shape, _) in shapes.items():
        node = nodes.get(key)
        if node is None or tuple(node.shape) != tuple(shape):
            raise ConversionProblem(
                f"{key!r} (shape {list(shape)}): transformers' save layout for "
                f"{type(model).__name__} does not convert back to it"
                + (f" (it reads back as shape {list(node.shape)})" if node is not None else "")
                + "; save with conversion=None (the model's own layout)")
    return {k: nodes[k] for k in shapes}


"""Activation checkpointing chosen by the same predicates as :func:`fsdptk.shard_model`.

Apply it BEFORE ``shard_model`` (as torchtitan does): FSDP's hooks then wrap the checkpointed
region, so the recomputation in backward runs with the unit's parameters already all-gathered.
``apply_activation_checkpointing`` refuses a model that is already sharded.

Two implementations:
    - ``mode="composable"`` (default): ``torch.distributed._composable.checkpoint``, hooks on the
      module itself. Module and parameter FQNs, ``state_dict`` keys and the module's type do not
      change, so every predicate and every checkpoint keeps working unchanged.
    - ``mode="wrapper"``: torch's ``checkpoint_wrapper`` (``CheckpointWrapper`` around the module).
      Parameter FQNs gain ``_checkpoint_wrapped_module.``; ``state_dict`` keys do not (the wrapper
      strips them), and fsdptk's predicates see clean names and the wrapped module, so
      ``shard_model`` matches the same modules. Use it when other code expects the wrapper.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from torch import nn

from fsdptk._core.compat import checkpoint_wrapper_api, composable_checkpoint, composable_registry
from fsdptk._core.dist import log_rank0
from fsdptk._plans.sharding import as_conditions, check_unsharded, is_ancestor, match_modules
from fsdptk.predicates import ShardCondition, describe_predicate

__all__ = ["apply_activation_checkpointing"]

_log = logging.getLogger(__name__)


def _matches(model: nn.Module, conditions: list[ShardCondition]) -> dict[str, tuple[nn.Module, str]]:
    """Clean name -> (outermost module, rule) for the top-most matched modules (not the root)."""
    outer, _, rule = match_modules(model, conditions, "checkpoint", "nothing was changed")
    found = {c: (outer[c], r) for c, r in rule.items()}
    # a region inside another checkpointed region would be recomputed twice: keep the outermost
    return {c: v for c, v in found.items() if not any(is_ancestor(a, c) for a in found)}


def _already_checkpointed(m: nn.Module) -> bool:
    wrapper_type, _ = checkpoint_wrapper_api()
    registry = composable_registry(m)
    return "checkpoint" in registry or isinstance(m, wrapper_type)


def apply_activation_checkpointing(
    model: nn.Module,
    condition: Sequence[ShardCondition] | ShardCondition,
    *,
    mode: Literal["composable", "wrapper"] = "composable",
    preserve_rng_state: bool = True,
) -> list[str]:
    """Recompute the activations of every module ``condition`` matches in backward.

    Call it before :func:`fsdptk.shard_model`. Only the outermost matched modules are checkpointed
    (a match nested in another one is skipped); the root is never matched.

    Args:
        model: the unsharded model (meta, CPU or accelerator; after tensor parallel if used).
        condition: a predicate ``(name, module) -> bool`` or a list of them (any matches), e.g.
            ``fsdptk.predicates.layers()``.
        mode: ``"composable"`` keeps FQNs unchanged (default); ``"wrapper"`` uses torch's
            ``checkpoint_wrapper`` (see the module docstring).
        preserve_rng_state: restore the RNG state for recomputation (dropout gives the same mask).

    Returns:
        list[str]: the FQNs of the checkpointed modules, in registration order.

    Raises:
        ValueError: when nothing matched, ``mode`` is unknown, the model is already sharded, or a
            matched module is already checkpointed (nothing is changed).
        ShardConditionError: when a condition raises (names it and the module; nothing changed).
        TypeError: ``model`` is not an ``nn.Module`` (names its type).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from fsdptk import apply_activation_checkpointing
        >>> from fsdptk.predicates import layers
        >>> model = nn.Sequential()
        >>> model.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        >>> apply_activation_checkpointing(model, layers())
        ['layers.0', 'layers.1']
        >>> sorted(model.state_dict())[:2]  # FQNs unchanged in composable mode
        ['layers.0.bias', 'layers.0.weight']
    """
    if mode not in ("composable", "wrapper"):
        raise ValueError(f"mode must be 'composable' or 'wrapper', got {mode!r}")
    check_unsharded(model, "apply activation checkpointing before shard_model")
    conditions = as_conditions(condition)
    found = _matches(model, conditions)
    if not found:
        tried = ", ".join(describe_predicate(c) for c in conditions)
        raise ValueError(f"no module matched the checkpoint conditions [{tried}]")
    done = [c for c, (m, _) in found.items() if _already_checkpointed(m)]
    if done:
        raise ValueError(f"modules {done} are already activation-checkpointed")

    if mode == "composable":
        checkpoint = composable_checkpoint()
        for module, _ in found.values():
            checkpoint(module, preserve_rng_state=preserve_rng_state)
    else:
        _wrap(model, found, preserve_rng_state)
    log_rank0(_log, "apply_activation_checkpointing: %d modules (%s mode, rules %s)",
              len(found), mode, sorted({rule for _, rule in found.values()}))
    return list(found)


def _wrap(model: nn.Module, found: dict[str, tuple[nn.Module, str]], preserve_rng: bool) -> None:
    _, checkpoint_wrapper = checkpoint_wrapper_api()
    targets = {id(m) for m, _ in found.values()}
    # replace children in their parents; parents are found through the live module tree
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in targets:
                wrapped = checkpoint_wrapper(child, preserve_rng_state=preserve_rng)
                setattr(parent, child_name, wrapped)

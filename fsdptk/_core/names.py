"""Canonical names: the one FQN cleaning rule and the one tied-tensor grouping of fsdptk.

- :func:`clean_fqn`: wrappers (activation checkpointing's ``checkpoint_wrapper``,
  ``torch.compile``, FSDP1) insert components into module and parameter names; the clean name is
  the one the user's unwrapped model has. Predicates, sharding plans, activation checkpointing and
  optimizer state all match by it.
- :func:`tensor_groups`: a model's persistent state, one entry per tensor object (tied parameters
  share one), in ``state_dict()`` order: the canonical key is the first, the others are aliases.
  Model state, optimizer state and checkpoint files use this one computation.
- :func:`param_owners`: the same grouping seen from the modules: each parameter object with every
  ``(module, attribute)`` that registers it. The sharding planner and the HF tensor-parallel plan
  keep tied parameters together by it.
"""

from __future__ import annotations

import torch
from torch import nn

# components that wrappers insert into FQNs: checkpoint_wrapper, torch.compile, FSDP1
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def clean_fqn(name: str) -> str:
    """Drop wrapper components (``_checkpoint_wrapped_module``, ``_orig_mod``, ...) from an FQN.

    Args:
        name: a dotted module or parameter name.

    Returns:
        str: the name the user's unwrapped model would have.

    Examples:
        >>> clean_fqn("layers.0._checkpoint_wrapped_module.attn.wq.weight")
        'layers.0.attn.wq.weight'
    """
    if not any(p in name for p in WRAPPER_PARTS):
        return name
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def tensor_groups(model: nn.Module) -> list[tuple[torch.Tensor, list[str]]]:
    """The persistent state grouped by tensor object, in ``state_dict()`` order.

    Each group is ``(tensor, keys)``, canonical key first (the tensor's first key); a tied
    parameter's keys list its aliases after it, every other group has one key.

    Args:
        model: any module (sharded or not).

    Returns:
        list[tuple[torch.Tensor, list[str]]]: one group per distinct tensor object.

    Examples:
        >>> import torch
        >>> m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        >>> m.b.weight = m.a.weight
        >>> [keys for _, keys in tensor_groups(m)]
        [['a.weight', 'b.weight'], ['a.bias'], ['b.bias']]
    """
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), (t, []))[1].append(key)
    return list(groups.values())


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The keys of tied tensors (groups of :func:`tensor_groups` with 2 or more keys).

    Args:
        model: any module.

    Returns:
        list[list[str]]: each tied tensor's keys, canonical key first.
    """
    return [keys for _, keys in tensor_groups(model) if len(keys) > 1]


def param_owners(model: nn.Module, *, remove_duplicate: bool = True,
                 ) -> list[tuple[nn.Parameter, list[tuple[str, str, nn.Module]]]]:
    """Every parameter object with the modules that register it, in registration order.

    A tied parameter (one object registered by several modules, or under several attributes) has
    several owners; every other parameter has one.

    Args:
        model: any module.
        remove_duplicate: as ``named_modules``'s: ``False`` lists a module registered under several
            names once per name.

    Returns:
        list: ``(parameter, [(module fqn, attribute, module), ...])``, one entry per parameter
        object; the FQNs are raw (pass them through :func:`clean_fqn` for the user's names).

    Examples:
        >>> import torch
        >>> m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        >>> m.b.weight = m.a.weight
        >>> [[f"{fqn}.{attr}" for fqn, attr, _ in owners] for _, owners in param_owners(m)]
        [['a.weight', 'b.weight'], ['a.bias'], ['b.bias']]
    """
    groups: dict[int, tuple[nn.Parameter, list[tuple[str, str, nn.Module]]]] = {}
    for fqn, module in model.named_modules(remove_duplicate=remove_duplicate):
        for attr, p in module._parameters.items():
            if p is not None:
                groups.setdefault(id(p), (p, []))[1].append((fqn, attr, module))
    return list(groups.values())

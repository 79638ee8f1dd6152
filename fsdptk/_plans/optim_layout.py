"""Optimizer state layout, without any communication: parameter FQNs, int-id -> FQN conversion,
param-group matching by FQN, validation of a full optimizer state dict, and the optimizer's own
(integer id, sharded) state dict that ``opt.load_state_dict`` finally receives.

Used by :mod:`fsdptk.optim`, which adds the moving of tensors (through :mod:`fsdptk._engine`).

Naming rule (:mod:`fsdptk._core.names`): a parameter's FQN is its first key in ``model.state_dict()``,
which is also its first name in ``model.named_parameters()`` order cleaned by
:func:`fsdptk._core.names.clean_fqn` (wrapper components such as activation checkpointing's
``_checkpoint_wrapped_module`` and ``torch.compile``'s ``_orig_mod`` removed), i.e. the key the
model state uses. A tied parameter (one ``Parameter`` object under several names) has ONE FQN, the first;
its other names are accepted as aliases on load.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdptk._core.names import clean_fqn, tensor_groups

STATE, PG, PARAMS, NAMES = "state", "param_groups", "params", "param_names"


def param_fqns(model: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """``id(param) -> canonical FQN`` and ``every known name (aliases too) -> canonical FQN``."""
    ids = {id(p) for p in model.parameters()}
    canon: dict[int, str] = {}
    names: dict[str, str] = {}
    for t, keys in tensor_groups(model):
        if id(t) in ids:
            canon[id(t)] = keys[0]
            names.update(dict.fromkeys(keys, keys[0]))
    for name, p in model.named_parameters(remove_duplicate=False):
        fqn = canon.setdefault(id(p), clean_fqn(name))
        names.setdefault(clean_fqn(name), fqn)
        names.setdefault(name, fqn)
    return canon, names


def optim_groups(model: nn.Module, opt: torch.optim.Optimizer) -> list[list[tuple[str, torch.Tensor]]]:
    """The optimizer's param groups as ``[(fqn, param), ...]`` lists.

    Raises:
        ValueError: a parameter of the optimizer is not a parameter of the model (names the group,
            shape and dtype), e.g. an optimizer created before the model was sharded.
    """
    canon, _ = param_fqns(model)
    groups = []
    for gi, group in enumerate(opt.param_groups):
        row = []
        for p in group[PARAMS]:
            fqn = canon.get(id(p))
            if fqn is None:
                raise ValueError(
                    f"param group {gi} of {type(opt).__name__} holds a parameter of shape {list(p.shape)} "
                    f"({p.dtype}) that is not a parameter of {type(model).__name__}: create the optimizer "
                    "over model.parameters() AFTER sharding the model (fully_shard replaces parameters)")
            row.append((fqn, p))
        groups.append(row)
    return groups


# ---------------------------------------------------------------------------------------------
# full optimizer state dict -> FQN layout


def _check_structure(osd: Any) -> None:
    if not isinstance(osd, Mapping) or STATE not in osd or PG not in osd:
        keys = sorted(map(str, osd)) if isinstance(osd, Mapping) else type(osd).__name__
        raise ValueError(f"an optimizer state dict needs 'state' and 'param_groups' entries, got {keys}")
    if not isinstance(osd[STATE], Mapping):
        raise ValueError(f"osd['state'] must be a mapping, got {type(osd[STATE]).__name__}")
    groups = osd[PG]
    if not isinstance(groups, Sequence) or not all(isinstance(g, Mapping) and PARAMS in g for g in groups):
        raise ValueError("osd['param_groups'] must be a list of dicts that each have a 'params' list")
    for key, value in osd[STATE].items():
        if not isinstance(value, Mapping):
            raise ValueError(f"osd['state'][{key!r}] must be a dict of state values, got {type(value).__name__}")


def _id_names(model: nn.Module, osd: Mapping[str, Any], param_names: Sequence[str] | None,
              ours: list[list[tuple[str, torch.Tensor]]] | None) -> dict[int, str]:
    groups = osd[PG]
    if param_names is None and all(NAMES in g for g in groups):  # a "named" torch optimizer
        return {pid: name for g in groups for pid, name in zip(g[PARAMS], g[NAMES])}
    if param_names is None and ours is not None and [len(g[PARAMS]) for g in groups] == [len(g) for g in ours]:
        # torch's own rule (Optimizer.load_state_dict): ids follow the optimizer's group order
        return {pid: fqn for g, mine in zip(groups, ours) for pid, (fqn, _) in zip(g[PARAMS], mine)}
    canon, _ = param_fqns(model)
    source = "param_names" if param_names is not None else "model.named_parameters() order"
    names = list(param_names) if param_names is not None else [canon[id(p)] for p in model.parameters()]
    ids = sorted({*(pid for g in groups for pid in g[PARAMS]), *osd[STATE].keys()})
    bad = [pid for pid in ids if not 0 <= pid < len(names)]
    if bad:
        raise ValueError(
            f"integer optimizer ids {bad[:10]} have no parameter: ids are mapped through {source}, which "
            f"has {len(names)} names; pass param_names=[fqn of id 0, fqn of id 1, ...] to say which "
            "parameter each id is (e.g. when the optimizer was built over a filtered parameter list)")
    return {pid: names[pid] for pid in ids}


def to_fqn_layout(model: nn.Module, osd: Mapping[str, Any], param_names: Sequence[str] | None = None,
                  ours: list[list[tuple[str, torch.Tensor]]] | None = None) -> dict[str, Any]:
    """A NEW dict in the FQN layout; per-parameter state dicts are the caller's objects (shared).

    Integer ids (a plain ``opt.state_dict()``) are mapped through, in this order of preference:
    the groups' ``param_names`` (a torch optimizer built over ``named_parameters()``), the
    ``param_names`` argument, the optimizer groups ``ours`` when every saved group has as many ids
    as the matching one of ``ours`` (torch's own positional rule), else the model's
    ``named_parameters()`` order. Alias names of tied parameters become the canonical FQN.
    """
    _check_structure(osd)
    keys = [*(pid for g in osd[PG] for pid in g[PARAMS]), *osd[STATE].keys()]
    kinds = {type(k) for k in keys}
    if kinds - {int, str} or len(kinds) > 1:
        raise ValueError("optimizer state keys must be all parameter FQNs (str) or all integer ids, "
                         f"got key types {sorted(t.__name__ for t in kinds)}")
    _, aliases = param_fqns(model)
    to_name: dict[Any, str] = _id_names(model, osd, param_names, ours) if kinds == {int} else {}

    def fqn(key: Any) -> str:
        name = to_name.get(key, key)
        return aliases.get(name, name)

    state: dict[str, Any] = {}
    for key, value in osd[STATE].items():
        state.setdefault(fqn(key), value)
    groups = []
    for g in osd[PG]:
        new = {k: v for k, v in g.items() if k != NAMES}
        new[PARAMS] = list(dict.fromkeys(fqn(k) for k in g[PARAMS]))
        groups.append(new)
    return {STATE: state, PG: groups}


# ---------------------------------------------------------------------------------------------
# matching a full (FQN layout) state against the optimizer


@dataclass
class LoadView:
    """What a load needs, decided where the full state is read (picklable, sent from rank 0).

    Attributes:
        hypers: per optimizer group, the saved hyper-parameters to restore (``None``: keep ours).
        tensors: ``(name, fqn, key)`` of each state tensor shaped like its parameter (engine moves).
        scalars: ``fqn -> {key: value}`` for every other state value (``step``, python numbers).
        order: ``fqn -> [key, ...]`` the saved key order of each loaded parameter's state.
        loaded: FQNs whose state comes from the saved state (listed in a matched saved group).
        missing: our optimizer's FQNs that no saved group lists.
        unexpected: saved FQNs that are not parameters of our optimizer.
        problems: errors (strings) found while validating.
    """

    hypers: list[dict[str, Any] | None] = field(default_factory=list)
    tensors: list[tuple[str, str, Any]] = field(default_factory=list)
    scalars: dict[str, dict[Any, Any]] = field(default_factory=dict)
    order: dict[str, list[Any]] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def digest(self) -> str:
        """Fingerprint of everything but ``problems`` (ranks that read their own copy compare it)."""
        rows = (self.hypers, self.tensors, sorted((f, repr(v)) for f, v in self.scalars.items()),
                self.order, self.loaded, self.missing, self.unexpected)
        return hashlib.sha1(repr(rows).encode()).hexdigest()


def _match_groups(ours: list[list[tuple[str, torch.Tensor]]], saved: list[Mapping[str, Any]],
                  view: LoadView) -> None:
    where = {f: si for si, g in enumerate(saved) for f in g[PARAMS]}
    for gi, group in enumerate(ours):
        found = sorted({where[f] for f, _ in group if f in where})
        if len(found) > 1:
            spread = {si: [f for f, _ in group if where.get(f) == si][:3] for si in found}
            view.problems.append(
                f"param group {gi} of the optimizer cannot be matched: its parameters come from saved "
                f"param groups {found} (e.g. {spread}), which may have different hyper-parameters; "
                "build the optimizer's groups so that each holds parameters of one saved group")
        view.hypers.append({k: v for k, v in saved[found[0]].items() if k not in (PARAMS, NAMES)}
                           if len(found) == 1 else None)
        for f, _ in group:
            (view.loaded if f in where else view.missing).append(f)


def _split_state(state: Mapping[str, Any], view: LoadView) -> None:
    for f in view.loaded:
        per_param = state.get(f, {})
        view.order[f] = list(per_param)
        for key, value in per_param.items():
            if isinstance(value, DTensor):
                view.problems.append(f"state[{f!r}][{key!r}] is a DTensor (a shard); a full optimizer "
                                     "state holds full tensors: use get_full_optimizer_state_dict")
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                view.tensors.append((f"state.{f}.{key}", f, key))
            else:
                view.scalars.setdefault(f, {})[key] = value


def plan_load(model: nn.Module, ours: list[list[tuple[str, torch.Tensor]]], full_sd: Mapping[str, Any],
              param_names: Sequence[str] | None) -> tuple[LoadView, Mapping[str, Any]]:
    """Validate ``full_sd`` against the optimizer's groups: (view, saved state by canonical FQN).

    Problems are collected in ``view.problems``, never raised, so that they can be agreed on.
    """
    view = LoadView()
    try:
        osd = to_fqn_layout(model, full_sd, param_names, ours)
        mine = {f for group in ours for f, _ in group}
        saved = dict.fromkeys([*(f for g in osd[PG] for f in g[PARAMS]), *osd[STATE]])
        view.unexpected = [f for f in saved if f not in mine]
        _match_groups(ours, osd[PG], view)
        _split_state(osd[STATE], view)
    except Exception as e:  # noqa: BLE001 - malformed input: reported on every rank by the caller
        return LoadView(problems=[str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"]), {}
    return view, osd[STATE]


# ---------------------------------------------------------------------------------------------
# building what the engine and opt.load_state_dict consume


def _fresh(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def local_osd(opt: torch.optim.Optimizer, ours: list[list[tuple[str, torch.Tensor]]], view: LoadView,
              local: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The optimizer's own (integer id, sharded) state dict for ``opt.load_state_dict``."""
    name_of = {(fqn, key): name for name, fqn, key in view.tensors}
    loaded = set(view.loaded)
    state: dict[int, dict[Any, Any]] = {}
    groups, pid = [], 0
    for group, live, hyper in zip(ours, opt.param_groups, view.hypers):
        g = copy.deepcopy(hyper) if hyper is not None else {k: v for k, v in live.items() if k != PARAMS}
        g.pop(NAMES, None)
        if NAMES in live:
            g[NAMES] = list(live[NAMES])
        g[PARAMS] = list(range(pid, pid + len(group)))
        groups.append(g)
        for fqn, p in group:
            if fqn in loaded:
                scalars = view.scalars.get(fqn, {})
                per_param = {k: local[name_of[(fqn, k)]] if (fqn, k) in name_of else _fresh(scalars[k])
                             for k in view.order[fqn]}
            else:  # missing (strict=False): keep the current state
                per_param = dict(opt.state.get(p, {}))
            if per_param:
                state[pid] = per_param
            pid += 1
    return {STATE: state, PG: groups}

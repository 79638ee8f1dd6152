"""Planning FSDP units without touching the model: which modules, which rule, ties, sizes.

Both :func:`fsdptk.shard_model` and the dry run :func:`describe_sharding` go through
:func:`make_plan`, so what the dry run prints is what ``shard_model`` applies. Planning evaluates
every condition on every module first and validates everything it can, so a bad input raises
before any module is sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdptk._core.names import clean_fqn, param_owners
from fsdptk.errors import ShardConditionError
from fsdptk.predicates import ShardCondition, describe_predicate

__all__ = ["ShardingPlan", "UnitPlan", "describe_sharding", "Plan", "Unit", "make_plan", "summarise"]


# ------------------------------------------------------------------------------------------
# public result types


@dataclass(frozen=True)
class UnitPlan:
    """One FSDP unit of a :class:`ShardingPlan`.

    Attributes:
        fqns: the (clean) FQNs of the unit's modules: one, several for a group of tied owners
            (``fully_shard([a, b])``), ``("",)`` for the root.
        rule: the ``repr`` of the condition that matched (``"root"`` for the root).
        num_params: number of parameter tensors this unit manages (a shared one counts once).
        numel: their total number of elements.
        nbytes: their total size in bytes (storage dtype; the all-gather size without mixed
            precision).
        nbytes_per_rank: bytes each rank stores after sharding, dim 0 padded to a multiple of the
            shard world size as FSDP2 does.
    """

    fqns: tuple[str, ...]
    rule: str
    num_params: int
    numel: int
    nbytes: int
    nbytes_per_rank: int

    @property
    def name(self) -> str:
        """The unit's display name: its FQNs joined by ``+``, ``<root>`` for the root."""
        return " + ".join(f or "<root>" for f in self.fqns)


@dataclass(frozen=True)
class ShardingPlan:
    """What ``shard_model`` does (or did) to a model: its units in forward order, root last.

    Attributes:
        units: the units, non-root ones in registration (forward) order, then the root.
        world_size: ranks each parameter is sharded over (the ``dp_shard`` size).
        notes: how shared parameters were handled (one line per decision).
    """

    units: tuple[UnitPlan, ...]
    world_size: int
    notes: tuple[str, ...] = ()

    @property
    def total_numel(self) -> int:
        """Elements over all units (shared parameters once)."""
        return sum(u.numel for u in self.units)

    @property
    def total_bytes(self) -> int:
        """Bytes of the full model's parameters (shared parameters once)."""
        return sum(u.nbytes for u in self.units)

    @property
    def total_bytes_per_rank(self) -> int:
        """Parameter bytes each rank stores after sharding (with padding)."""
        return sum(u.nbytes_per_rank for u in self.units)

    @property
    def max_unit_bytes(self) -> int:
        """The largest unit's full size: roughly the extra memory one all-gather needs."""
        return max((u.nbytes for u in self.units), default=0)

    def __str__(self) -> str:
        head = ("unit", "rule", "params", "numel", "bytes", "bytes/rank")
        rows = [
            (u.name, u.rule, str(u.num_params), f"{u.numel:,}", _fmt_bytes(u.nbytes),
             _fmt_bytes(u.nbytes_per_rank))
            for u in self.units
        ]
        total = ("total", f"{len(self.units)} units",
                 str(sum(u.num_params for u in self.units)), f"{self.total_numel:,}",
                 _fmt_bytes(self.total_bytes), _fmt_bytes(self.total_bytes_per_rank))
        widths = [max(len(r[i]) for r in [head, total, *rows]) for i in range(len(head))]

        def line(r: tuple[str, ...]) -> str:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1])]
            cells += [c.rjust(w) for c, w in zip(r[2:], widths[2:])]
            return "  ".join(cells).rstrip()

        rule = "-" * len(line(head))
        out = [f"Sharding plan: {len(self.units)} FSDP units over {self.world_size} rank(s)",
               line(head), rule, *map(line, rows), rule, line(total)]
        out.append(f"largest unit (one all-gather): {_fmt_bytes(self.max_unit_bytes)}")
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


def _fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------------------
# internal plan (holds the modules)


@dataclass
class Unit:
    fqns: list[str]  # clean names, sorted by registration order
    modules: list[nn.Module]  # outermost module of each name (the wrapper, if any)
    rule: str
    order: int  # registration index of the first module


@dataclass
class Plan:
    units: list[Unit]  # non-root, registration order
    root: Unit
    notes: list[str] = field(default_factory=list)
    params_of: dict[int, list[nn.Parameter]] = field(default_factory=dict)  # id(unit) -> params


def as_conditions(shard_conditions: Any) -> list[ShardCondition]:
    if callable(shard_conditions):
        return [shard_conditions]
    if isinstance(shard_conditions, (str, bytes)) or not isinstance(shard_conditions, Sequence):
        raise TypeError(
            "shard_conditions must be a list of callables (name, module) -> bool, got "
            f"{type(shard_conditions).__name__}"
        )
    conds = list(shard_conditions)
    if not conds:
        raise ValueError("shard_conditions is empty: give at least one condition")
    for i, c in enumerate(conds):
        if not callable(c):
            raise TypeError(f"shard_conditions[{i}] is not callable: {c!r}")
    return conds


def check_unsharded(model: Any, remedy: str) -> None:
    """TypeError unless ``model`` is an ``nn.Module``; ValueError naming its first FSDPModule.

    Args:
        model: the model to shard or to checkpoint.
        remedy: the end of the ValueError's message (``"shard a model once"``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"the model is already sharded: module {clean_fqn(name) or '<root>'!r} "
                f"({type(m).__name__}) is an FSDPModule; {remedy}"
            )


def _check_model(model: Any) -> None:
    check_unsharded(model, "shard a model once")
    scalars = [n for n, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"FSDP cannot shard scalar (0-dim) parameters: {[clean_fqn(n) for n in scalars]}; "
            "make them 1-D tensors of one element"
        )


def match_modules(model: nn.Module, conditions: Sequence[ShardCondition], what: str, unchanged: str,
                  ) -> tuple[dict[str, nn.Module], dict[str, nn.Module], dict[str, str]]:
    """Ask the conditions about every module by its clean name: the one matching loop of fsdptk.

    Wrapped modules (``checkpoint_wrapper``, ``torch.compile``) share their clean name with the
    module they wrap; a condition sees the clean name and the innermost (user's) module. The root
    is never matched; the first condition that matches a module names its rule.

    Args:
        model: the model.
        conditions: ``(name, module) -> bool`` predicates, in priority order.
        what: the conditions' role, for the error (``"shard"``, ``"checkpoint"``).
        unchanged: what the error says was left alone (``"nothing was sharded"``).

    Returns:
        tuple: clean name -> outermost module, clean name -> innermost module (both in
        registration order), and matched clean name -> the matching condition's description.

    Raises:
        ShardConditionError: a condition raised (names the condition, the module and its type).
    """
    outer: dict[str, nn.Module] = {}
    inner: dict[str, nn.Module] = {}
    for raw, m in model.named_modules():
        c = clean_fqn(raw)
        outer.setdefault(c, m)
        inner[c] = m
    rule: dict[str, str] = {}
    for c, m in inner.items():
        if c == "":
            continue
        for cond in conditions:
            try:
                hit = cond(c, m)
            except Exception as e:  # noqa: BLE001 - re-raised with context
                raise ShardConditionError(
                    f"{what} condition {describe_predicate(cond)} raised {type(e).__name__} "
                    f"on module {c!r} ({type(m).__name__}): {e}; {unchanged}"
                ) from e
            if hit:
                rule[c] = describe_predicate(cond)
                break
    return outer, inner, rule


def is_ancestor(a: str, b: str) -> bool:
    """Whether clean name ``a`` is a strict ancestor of ``b``."""
    return a != b and (a == "" or b.startswith(a + "."))


def _no_forward_container(m: nn.Module) -> bool:
    return isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward


class _Planner:
    """Union-find over matched module names, resolving parameters shared between units."""

    def __init__(self, model: nn.Module, conditions: list[ShardCondition]) -> None:
        self.model = model
        self.outer: dict[str, nn.Module] = {}  # clean name -> outermost module
        self.inner: dict[str, nn.Module] = {}  # clean name -> innermost (wrapped) module
        self.index: dict[str, int] = {}
        self.owners: dict[int, list[tuple[str, str]]] = {}  # id(param) -> [(clean mod, attr)]
        self.param: dict[int, nn.Parameter] = {}
        for p, owners in param_owners(model):
            self.owners[id(p)] = [(clean_fqn(raw), attr) for raw, attr, _ in owners]
            self.param[id(p)] = p
        self.outer, self.inner, self.rule = match_modules(model, conditions, "shard",
                                                          "nothing was sharded")
        self.index = {c: i for i, c in enumerate(self.outer)}
        if not self.rule:
            tried = ", ".join(describe_predicate(c) for c in conditions)
            sample = [c for c in self.inner if c][:8]
            raise ValueError(
                f"no module matched the shard conditions [{tried}]; module names look like "
                f"{sample}"
            )
        bad = [(c, type(self.outer[c]).__name__) for c in self.rule
               if _no_forward_container(self.outer[c])]
        if bad:
            raise ValueError(
                f"modules {bad} matched ({self.rule[bad[0][0]]}) but are containers without "
                "forward (ModuleList / ModuleDict), which FSDP cannot shard as a unit; match their "
                "items instead (e.g. fsdptk.predicates.layers())"
            )
        self.parent = {c: c for c in self.rule}  # union-find over matched names
        self.notes: list[str] = []

    # union-find
    def find(self, c: str) -> str:
        while self.parent[c] != c:
            self.parent[c] = self.parent[self.parent[c]]
            c = self.parent[c]
        return c

    def unit_of(self, c: str) -> str:
        """Group representative of the unit managing module ``c`` (``""`` = root)."""
        while c not in self.parent:
            if c == "":
                return ""
            c = c.rsplit(".", 1)[0] if "." in c else ""
        return self.find(c)

    def members(self, rep: str) -> list[str]:
        return [c for c in self.parent if self.find(c) == rep]

    def unit_ancestors(self, c: str) -> set[str]:
        return {self.find(a) for a in self.parent if is_ancestor(a, c)}

    def resolve_ties(self) -> None:
        shared = {pid: o for pid, o in self.owners.items() if len({c for c, _ in o}) > 1}
        while True:
            conflict = None
            for pid, owners in shared.items():
                reps = {self.unit_of(c) for c, _ in owners}
                if len(reps) > 1:
                    conflict = (pid, owners, reps)
                    break
            if conflict is None:
                return
            self._resolve(*conflict)

    def _resolve(self, pid: int, owners: list[tuple[str, str]], reps: set[str]) -> None:
        names = ", ".join(f"{c}.{a}" if c else a for c, a in owners)
        members = sorted((m for r in reps if r for m in self.members(r)), key=self._order)
        nested = "" in reps or any(is_ancestor(a, b) for a in members for b in members)
        ancestors = {frozenset(self.unit_ancestors(m) - reps) for m in members}
        if not nested and len(ancestors) == 1:
            for r in reps:
                self.parent[self.find(r)] = self.find(members[0])
            self.notes.append(
                f"{' + '.join(members)} grouped into one unit: they share the parameter {names}"
            )
            return
        # leave the parameter to the lowest common ancestor module's unit
        lca = ""
        owner_names = [c for c, _ in owners]
        for c in self.outer:
            if all(o == c or is_ancestor(c, o) for o in owner_names) and len(c) >= len(lca):
                lca = c
        dropped = sorted(
            (m for r in reps if r and any(is_ancestor(lca, x) for x in self.members(r))
             for m in self.members(r)),
            key=self._order,
        )
        for m in dropped:
            del self.parent[m]
            self.rule.pop(m, None)
        self.notes.append(
            f"not sharding {', '.join(dropped)} separately: the parameter {names} is shared, so "
            f"it stays with the unit of {lca or '<root>'!r}"
        )

    def _order(self, fqn: str) -> int:
        return self.index.get(fqn, -1)

    def plan(self) -> Plan:
        self.resolve_ties()
        groups: dict[str, list[str]] = {}
        for c in sorted(self.parent, key=self._order):
            groups.setdefault(self.find(c), []).append(c)
        units = []
        for names in sorted(groups.values(), key=lambda g: self.index[g[0]]):
            rules = dict.fromkeys(self.rule[n] for n in names)
            units.append(Unit(names, [self.outer[n] for n in names], " | ".join(rules),
                               self.index[names[0]]))
        root = Unit([""], [self.model], "root", 0)
        plan = Plan(units, root, self.notes)
        by_rep = {self.find(u.fqns[0]): u for u in units}
        for pid, owners in self.owners.items():
            unit = by_rep.get(self.unit_of(owners[0][0]), root)
            plan.params_of.setdefault(id(unit), []).append(self.param[pid])
        return plan


def make_plan(model: nn.Module, shard_conditions: Any) -> Plan:
    conditions = as_conditions(shard_conditions)
    _check_model(model)
    return _Planner(model, conditions).plan()


def _local_shape(p: torch.Tensor) -> torch.Size:
    to_local: Callable[[], torch.Tensor] | None = getattr(p, "to_local", None)
    return to_local().shape if to_local is not None else p.shape


def _shard_numel(shape: torch.Size, world_size: int) -> int:
    """Elements per rank after FSDP2's dim-0 sharding, padded (torch.chunk's chunk 0 is the max)."""
    chunks = torch.chunk(torch.empty(shape, device="meta"), world_size, dim=0)
    return chunks[0].numel()


def summarise(plan: Plan, world_size: int) -> ShardingPlan:
    out = []
    for unit in [*plan.units, plan.root]:
        params = plan.params_of.get(id(unit), [])
        numel = sum(p.numel() for p in params)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        per_rank = sum(
            _shard_numel(_local_shape(p), world_size) * p.element_size() for p in params
        )
        out.append(UnitPlan(tuple(unit.fqns), unit.rule, len(params), numel, nbytes, per_rank))
    return ShardingPlan(tuple(out), world_size, tuple(plan.notes))


def describe_sharding(
    model: nn.Module,
    shard_conditions: Sequence[ShardCondition] | ShardCondition,
    *,
    world_size: int,
) -> ShardingPlan:
    """Dry run of :func:`fsdptk.shard_model`: the units it would create, with sizes per rank.

    Needs no process group and works on a ``meta`` model, so it can size a job before asking for
    accelerators. The units, rules and tie handling are exactly those ``shard_model`` applies.

    Args:
        model: the unsharded model (any device, ``meta`` included).
        shard_conditions: the conditions ``shard_model`` gets (a list, or one callable).
        world_size: ranks each parameter is sharded over: the world size for FSDP, the
            ``dp_shard`` degree for HSDP.

    Returns:
        ShardingPlan: per unit its FQN(s), the matching rule, parameter count, bytes and
        per-rank bytes after sharding (dim 0 padded to a multiple of ``world_size``), plus totals;
        ``print(plan)`` shows a table.

    Raises:
        ValueError: when ``world_size`` < 1, no module matches, a matched module cannot be a unit,
            or the model is already sharded.
        ShardConditionError: when a condition raises (names the condition and the module).
        TypeError: when ``model`` or ``shard_conditions`` have the wrong type.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from fsdptk import describe_sharding
        >>> from fsdptk.predicates import layers
        >>> with torch.device("meta"):
        ...     model = nn.Sequential()
        ...     model.layers = nn.ModuleList([nn.Linear(5, 5) for _ in range(2)])
        >>> plan = describe_sharding(model, [layers()], world_size=4)
        >>> [(u.name, u.nbytes, u.nbytes_per_rank) for u in plan.units]
        [('layers.0', 120, 48), ('layers.1', 120, 48), ('<root>', 0, 0)]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return summarise(make_plan(model, shard_conditions), world_size)

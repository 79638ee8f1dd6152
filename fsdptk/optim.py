"""Optimizer state: a sharded optimizer <-> a full optimizer state keyed by parameter FQN.

The full state has the layout of PyTorch DCP's ``get_optimizer_state_dict(model, opt,
options=StateDictOptions(full_state_dict=True))``::

    {"state": {fqn: {"step": tensor(10.), "exp_avg": full tensor, ...}},
     "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}

Gathering streams state tensors to rank 0 bucket by bucket and loading sends each rank only its
shard bytes, both through :mod:`fsdptk._engine` (the engine model state uses). Unlike DCP and
torchtune there is no fake optimizer step: parameters without state (frozen, or an optimizer that
has not stepped yet) simply have no entry in ``"state"``. Loading matches parameters and param
groups by FQN, never by position, and also accepts a plain single-process ``opt.state_dict()``
(integer ids). See ``docs/optimizer.md`` for the FQN rule (tied parameters: the first name).
"""

from __future__ import annotations

import copy
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from fsdptk import _engine
from fsdptk._core.arguments import arguments_view
from fsdptk._core.calls import renamed_keywords
from fsdptk._core.compat import IncompatibleKeys as _IncompatibleKeys
from fsdptk._core.compat import local_tensor
from fsdptk._core.dist import agreed, check_comm_device, check_rank_zero, check_type, is_rank0
from fsdptk._engine import ShapesSource, TensorMeta, bucket_size, check_source, layout_of, merge_checks
from fsdptk._engine.sources import NestedSource
from fsdptk._plans.optim_layout import (
    PARAMS,
    PG,
    STATE,
    LoadView,
    local_osd,
    optim_groups,
    param_fqns,
    plan_load,
    to_fqn_layout,
)
from fsdptk.errors import StateDictMismatchError

__all__ = [
    "get_full_optimizer_state_dict",
    "iter_full_optimizer_state",
    "get_optimizer_param_groups",
    "load_from_full_optimizer_state_dict",
    "to_fqn_optimizer_state_dict",
]

# check_source's verdict: (problems, missing, unexpected, metas), merged by merge_checks
Verdict = tuple[list[tuple[str, str]], list[str], list[str], dict[str, TensorMeta]]

# ---------------------------------------------------------------------------------------------
# gather


def _check_args(model: Any, opt: Any, name: str = "opt") -> None:
    """TypeErrors naming the argument (``name``: ``opt`` in torchtune's names, else ``optimizer``)."""
    check_type(model, nn.Module, "model", "a torch.nn.Module")
    check_type(opt, torch.optim.Optimizer, name, "a torch.optim.Optimizer")


def _local_layout(model: nn.Module, opt: torch.optim.Optimizer, bucket_bytes: int | None, name: str = "opt"
                  ) -> tuple[list[tuple[str, Any, Any]], list[dict[str, Any]], int, Exception | None]:
    """:func:`_gather_layout` and the bucket size, or this rank's error: no collective, the error
    is agreed in the engine's one metadata exchange (``_iter_state(..., failed=error)``)."""
    try:
        _check_args(model, opt, name)
        size = bucket_size(bucket_bytes)
        entries, groups = _gather_layout(model, opt, name)
    except Exception as e:  # noqa: BLE001 - raised on every rank by collect's exchange
        return [], [], 1, e
    return entries, groups, size, None


def _gather_layout(model: nn.Module, opt: torch.optim.Optimizer, name: str = "opt"
                   ) -> tuple[list[tuple[str, Any, Any]], list[dict[str, Any]]]:
    """``[(fqn, key, live value), ...]`` in ``opt.state_dict()`` order, and the FQN param groups."""
    _check_args(model, opt, name)
    ours = optim_groups(model, opt)
    osd = opt.state_dict()
    pid_fqn = {pid: fqn for saved, group in zip(osd[PG], ours)
               for pid, (fqn, _) in zip(saved[PARAMS], group)}
    entries = [(pid_fqn[pid], key, value) for pid, per_param in osd[STATE].items()
               for key, value in per_param.items()]
    groups = [{k: ([pid_fqn[i] for i in v] if k == PARAMS else copy.deepcopy(v)) for k, v in g.items()}
              for g in osd[PG]]
    return entries, groups


@renamed_keywords(opt="optimizer")
def get_optimizer_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups with parameter FQNs in ``"params"`` (no communication).

    The ``"param_groups"`` part of :func:`get_full_optimizer_state_dict`, for checkpoint writers
    that stream the state with :func:`iter_full_optimizer_state`. Identical on every rank.

    Args:
        model: the (sharded) model the optimizer's parameters belong to.
        optimizer: the optimizer.

    Returns:
        list[dict]: one dict per group: its hyper-parameters (copies) and ``"params": [fqn, ...]``.

    Raises:
        ValueError: a parameter of the optimizer is not a parameter of the model.
        TypeError: ``model`` or ``optimizer`` has the wrong type (named), or the optimizer is
            passed as ``opt=`` (the old name; the message says how to call it).

    Examples:
        >>> import torch
        >>> from fsdptk import get_optimizer_param_groups
        >>> model = torch.nn.Linear(2, 3)
        >>> opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.0}], lr=0.1)
        >>> [(g["lr"], g["params"]) for g in get_optimizer_param_groups(model, opt)]
        [(0.1, ['weight']), (0.0, ['bias'])]
    """
    return _gather_layout(model, optimizer, "optimizer")[1]


@renamed_keywords(opt="optimizer")
def iter_full_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    bucket_bytes: int | None = None,
) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Stream the full optimizer state to rank 0 as buckets of ``(fqn, per-parameter state)``.

    The streaming form of :func:`get_full_optimizer_state_dict` for checkpoint writers: write each
    bucket and drop it, so no rank ever holds more than one bucket of full state tensors (plus the
    state of one parameter that straddles two buckets). State tensors (DTensors on any mesh, or
    plain tensors) are gathered with :func:`fsdptk._engine.collect` (point to point to rank 0, one
    replica per HSDP group); plain tensors (``step``) and python values are taken from rank 0.
    Each parameter's state is yielded once, complete, in ``optimizer.state_dict()`` order;
    parameters without state are not yielded. Pair it with :func:`get_optimizer_param_groups`.

    Args:
        model: the (sharded) model; the same structure on every rank.
        optimizer: its optimizer.
        bucket_bytes: full-tensor bytes per gather bucket (``None``: the engine's default, 16 MiB).

    Returns:
        Iterator[list[tuple[str, dict]]]: on rank 0 one list per bucket (possibly empty) of
        ``(fqn, {key: full CPU tensor or value})``; ``[]`` per bucket on the other ranks. Every
        rank must exhaust the iterator (it runs collectives). When the code consuming it fails on
        one rank, pass the error in with ``iterator.throw(exc)``: every rank then raises it. A
        consumer that leaves the stream early on one rank (its code raises, it breaks out of its
        loop, or it calls ``close()``: the iterator is closed, at the latest when it is dropped)
        still takes part in the stream's next agreement, so every other rank raises a
        RuntimeError naming that rank within a bucket, never at a process-group timeout; the
        leaving rank goes on with its own error, or none.

    Raises:
        ValueError: on every rank, when the optimizer holds a parameter the model lacks, a state
            tensor is on ``meta`` or the ranks' states differ in keys, shapes or dtypes.
        TypeError: on every rank, when ``model`` or ``optimizer`` has the wrong type (named); at
            the call, when the optimizer is passed as ``opt=`` (the old name).
        Exception: any rank's failure while gathering (or the caller's, passed in with
            ``iterator.throw(exc)``), on every rank, naming that rank.

    Examples:
        >>> import torch
        >>> from fsdptk import iter_full_optimizer_state
        >>> model = torch.nn.Linear(2, 3)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> [(fqn, sorted(st)) for bucket in iter_full_optimizer_state(model, opt) for fqn, st in bucket]
        [('weight', ['exp_avg', 'exp_avg_sq', 'step']), ('bias', ['exp_avg', 'exp_avg_sq', 'step'])]
    """
    entries, _, size, error = _local_layout(model, optimizer, bucket_bytes, "optimizer")
    yield from _iter_state(entries, size, failed=error, call="iter_full_optimizer_state", bucket_arg=bucket_bytes)


def _iter_state(entries: list[tuple[str, Any, Any]], bucket_bytes: int, retained: bool = False,
                failed: Exception | None = None, *, call: str, bucket_arg: int | None,
                ) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """:func:`iter_full_optimizer_state`; ``retained``: the caller keeps every bucket; ``failed``:
    this rank's pre-flight error, raised on every rank by the engine's metadata exchange; ``call``
    and ``bucket_arg`` (the caller's ``bucket_bytes`` as passed): agreed across ranks first."""
    arguments = arguments_view(call, bucket_bytes=bucket_arg)  # agreed in the engine's one exchange
    names = [f"{STATE}.{fqn}.{key}" for fqn, key, _ in entries]
    items = [(n, v) for n, (_, _, v) in zip(names, entries) if isinstance(v, torch.Tensor)]
    last = {fqn: i for i, (fqn, _, _) in enumerate(entries)}  # index of each fqn's last entry
    rank0 = is_rank0()
    cursor, current = 0, {}

    def advance(arrived: dict[str, torch.Tensor]) -> list[tuple[str, dict[str, Any]]]:
        nonlocal cursor, current
        done = []
        while cursor < len(entries):
            fqn, key, value = entries[cursor]
            if isinstance(value, torch.Tensor):
                if names[cursor] not in arrived:
                    break
                value = arrived.pop(names[cursor])
            else:
                value = copy.deepcopy(value)
            current[key] = value
            if last[fqn] == cursor:
                done.append((fqn, current))
                current = {}
            cursor += 1
        return done

    arrived: dict[str, torch.Tensor] = {}
    buckets = cast(Generator[list[tuple[str, torch.Tensor]], None, None],  # collect/distribute are generators (annotated Iterator in the engine)
                   _engine.collect(items, bucket_bytes=bucket_bytes, retained=retained, failed=failed,
                                                  arguments=arguments))
    try:
        for bucket in buckets:
            try:
                arrived.update(bucket)
                done = advance(arrived) if rank0 else []
            except Exception as e:  # noqa: BLE001 - agreed by the engine: every rank raises it
                buckets.throw(e)
            try:
                yield done
            except Exception as e:  # noqa: BLE001 - the caller's .throw(e), agreed likewise
                buckets.throw(e)
    except GeneratorExit:  # the consumer left (close(), or a break or an error dropped the iterator)
        buckets.close()  # the engine's next agreement, now: every other rank raises, naming this rank
        raise
    if rank0 and cursor < len(entries):  # trailing non-tensor values
        yield advance(arrived)


def get_full_optimizer_state_dict(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    is_rank_zero: bool,
    device: torch.device | None = None,
    *,
    bucket_bytes: int | None = None,
) -> dict[str, Any]:
    """Gather the full optimizer state, keyed by parameter FQN, on rank 0 (``{}`` elsewhere).

    The layout is DCP's full optimizer state dict: ``{"state": {fqn: {key: value}},
    "param_groups": [{..., "params": [fqn, ...]}]}``. State tensors shaped like their parameter are
    gathered as full CPU tensors (bucket by bucket, to rank 0 only: other ranks never hold more
    than one bucket); ``step`` and python values are copied from rank 0. No fake optimizer step:
    parameters without state (frozen ones, or before the first ``opt.step()``) have no ``"state"``
    entry but are listed in their group. A tied parameter appears once, under its first FQN.

    Args:
        model: the (sharded) model the optimizer's parameters belong to (1-D FSDP, HSDP,
            FSDP + TP, CPU offload or unsharded).
        opt: the optimizer (any ``torch.optim`` optimizer whose state values are tensors shaped
            like their parameter, scalars, or python values).
        is_rank_zero: whether this is global rank 0 (the dict is returned where this is True and
            the rank is 0; a value that disagrees with the real rank warns once).
        device: the device the gather communicates on, ``None`` for the process group's (as
            :func:`fsdptk.gather_cpu_state_dict`: one of another type than the backend's warns
            that it is not used); results are always on CPU.
        bucket_bytes: full-tensor bytes per gather bucket (``None``: the engine's default, 16 MiB).

    Returns:
        dict: the full state on rank 0 (fresh CPU tensors, not shared with the optimizer); ``{}``
        on the other ranks.

    Raises:
        ValueError: on every rank, when the optimizer holds a parameter the model lacks (e.g. it
            was created before sharding), the ranks' states differ, or ``bucket_bytes`` is not a
            positive int.
        TypeError: on every rank, when ``model`` or ``opt`` has the wrong type (named).
        Exception: any rank's failure while gathering, on every rank, naming that rank.

    Warns:
        UserWarning: ``is_rank_zero`` disagrees with the global rank, or ``device`` is not the
            type the process group communicates on (once per call site).

    Examples:
        >>> import torch
        >>> from fsdptk import get_full_optimizer_state_dict
        >>> model = torch.nn.Linear(2, 3)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> osd = get_full_optimizer_state_dict(model, opt, is_rank_zero=True)
        >>> list(osd["state"]), osd["param_groups"][0]["params"], osd["state"]["bias"]["momentum_buffer"]
        (['weight', 'bias'], ['weight', 'bias'], tensor([1., 1., 1.]))
    """
    check_comm_device("get_full_optimizer_state_dict", device)
    keep = check_rank_zero("get_full_optimizer_state_dict", is_rank_zero)
    entries, groups, size, error = _local_layout(model, opt, bucket_bytes)
    state: dict[str, dict[str, Any]] = {}
    for bucket in _iter_state(entries, size, retained=True, failed=error, call="get_full_optimizer_state_dict",
                              bucket_arg=bucket_bytes):
        state.update(bucket)
    if not keep:
        return {}
    return {STATE: state, PG: groups}


# ---------------------------------------------------------------------------------------------
# load


@renamed_keywords(opt="optimizer")
def to_fqn_optimizer_state_dict(
    model: nn.Module,
    osd: Mapping[str, Any],
    *,
    param_names: Sequence[str] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Convert a plain single-process ``opt.state_dict()`` (integer ids) to the FQN layout.

    Which parameter an integer id names, in this order of preference:

    1. the groups' own ``"param_names"`` (torch adds them when an optimizer is built over
       ``model.named_parameters()``);
    2. ``param_names``: ``param_names[i]`` is the FQN of id ``i``;
    3. ``optimizer``, when every saved group has as many ids as the same group of ``optimizer``:
       ids follow its groups in order, which is torch's own ``Optimizer.load_state_dict`` rule
       (right when ``optimizer`` is built by the same code as the saved one, e.g. decay / no-decay
       groups);
    4. ``model.named_parameters()`` order: id ``i`` is the ``i``-th parameter (right for an
       optimizer built as ``Opt(model.parameters())``).

    An FQN-keyed input is returned with tied-parameter aliases renamed to their first FQN. No
    communication; the result is a new dict whose per-parameter state dicts are the input's.

    Args:
        model: the model (sharded or not: only parameter names and order are used).
        osd: ``opt.state_dict()`` of a plain optimizer, or an FQN-keyed state dict.
        param_names: the FQN of each integer id, for an optimizer built over a filtered or
            reordered parameter list (e.g. only the trainable parameters).
        optimizer: the optimizer the state is meant for (rule 3).

    Returns:
        dict: ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``.

    Raises:
        ValueError: malformed input, mixed id and FQN keys, or an id with no parameter (names the
            ids and the number of names available).
        TypeError: the optimizer is passed as ``opt=`` (the old name; the message says how to call
            it).

    Examples:
        >>> import torch
        >>> from fsdptk import to_fqn_optimizer_state_dict
        >>> model = torch.nn.Linear(2, 3)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> to_fqn_optimizer_state_dict(model, opt.state_dict())["param_groups"][0]["params"]
        ['weight', 'bias']
    """
    return to_fqn_layout(model, osd, param_names,
                         optim_groups(model, optimizer) if optimizer is not None else None)


class ReaderView(NamedTuple):
    """What a rank that reads ``full_sd`` contributes to the optimizer load's one metadata
    exchange (the ``extra`` of :func:`fsdptk._engine.agree`; ``None`` from a rank that reads nothing)."""

    view: LoadView | None  # the whole view: rank 0's when broadcasting, else not sent
    digest: str  # fingerprint of the view (ranks reading their own copy compare it)
    problems: list[str]  # what is wrong with the saved state, by key
    checked: Verdict  # the engine's verdict on the state tensors (check_source)


def _reader_view(model: nn.Module, ours: list[list[tuple[str, torch.Tensor]]], full_sd: Mapping[str, Any],
                 param_names: Sequence[str] | None, broadcast_from_rank0: bool,
                 ) -> tuple[LoadView, NestedSource, ReaderView]:
    """A reading rank's view of ``full_sd``, its saved state tensors as the engine's source (built
    once, here: the per-parameter dicts are the caller's, released by the load), and what it
    contributes to the agreement.

    The contribution (the ``extra`` of the engine's one metadata exchange): rank 0's whole view when
    broadcasting, else a fingerprint of this rank's view; with it the engine's verdict on each
    state tensor shaped like its parameter (``(problems, metas)``: shape mismatches by name, and
    each tensor's shape and dtype), found here because only reading ranks know those tensors.
    """
    view, saved = plan_load(model, ours, full_sd, param_names)
    params = {fqn: p for group in ours for fqn, p in group}
    layouts: dict[str, Any] = {}
    entries = [(name, layouts.setdefault(fqn, layout_of(params[fqn]))) for name, fqn, _ in view.tensors]
    source = NestedSource(saved, view.tensors)
    checked = check_source(entries, source, False)
    return view, source, ReaderView(view if broadcast_from_rank0 else None, view.digest(), list(view.problems),
                                    checked)


def _agree_view(view: LoadView | None, extras: list[ReaderView | None], broadcast_from_rank0: bool,
                ) -> tuple[LoadView, list[Verdict | None]]:
    """Every rank's view (rank 0's when broadcasting) or the same error, from the agreed extras.

    Returns the view and the engine's verdicts on the state tensors: rank 0's alone when
    broadcasting, else one per rank.
    """
    verdicts: list[Verdict | None]
    if broadcast_from_rank0:
        rank0 = extras[0]
        assert rank0 is not None and rank0.view is not None  # rank 0 reads
        view, problems, verdicts = rank0.view, list(rank0.problems), [rank0.checked]
    else:  # every rank reads its own copy
        mine = [e for e in extras if e is not None]
        problems = list(dict.fromkeys(p for e in mine for p in e.problems))
        differ = [r for r, e in enumerate(mine) if e.digest != mine[0].digest]
        if differ and not problems:
            problems.append(f"the full optimizer states differ between rank 0 and ranks {differ}; pass "
                            "broadcast_from_rank0=True to read rank 0's only")
        verdicts = [e.checked for e in mine]
    if problems:
        shown = "\n  - ".join(problems[:20])
        raise ValueError(f"cannot load the optimizer state: {len(problems)} problem(s):\n  - {shown}")
    assert view is not None  # a reading rank's own view (every rank reads when not broadcasting)
    return view, verdicts


def _state_plan(plan: _engine.LoadPlan, view: LoadView, verdicts: list[Any],
                broadcast_from_rank0: bool) -> _engine.LoadPlan:
    """The engine's plan for the state tensors, from its plan for the parameters (no collective).

    The metadata exchange was over the parameters (the same targets on every rank, so that it can
    also carry rank 0's view to ranks that do not know the state's keys yet); each state tensor
    ``state.<fqn>.<key>`` then moves like its parameter. Its shape and dtype are the reading ranks'
    verdicts (``verdicts``, from the engine's ``check_source``), merged by the engine's own rule.

    Raises:
        ValueError: a state tensor's shape differs from its parameter's (key and both shapes), or
            the ranks' state tensors differ in shape or dtype; on every rank.
    """
    _, _, metas = merge_checks(verdicts, broadcast_from_rank0)
    return plan.moving_like([(name, fqn) for name, fqn, _ in view.tensors], metas)


def _check_strict(view: LoadView, aliases: Mapping[str, str]) -> None:
    lines = [f"no saved param group lists the optimizer's parameter(s) {view.missing}"] if view.missing else []
    for f in view.unexpected:
        why = "is not in the optimizer's param groups" if f in aliases else "is not a parameter of the model"
        lines.append(f"saved parameter {f!r} {why}")
    if lines:
        raise StateDictMismatchError("cannot load the optimizer state (strict=True; pass strict=False to "
                                     "skip these):\n  - " + "\n  - ".join(lines),
                                     missing_keys=view.missing, unexpected_keys=view.unexpected)


def _state_device(ours: list[list[tuple[str, torch.Tensor]]], device: torch.device) -> torch.device:
    """The parameters' own device when they share one (CPU offload: CPU), else ``device``.

    A DTensor's local tensor decides (where its bytes are): FSDP2's CPU offload can leave a
    DTensor whose metadata device differs from its local tensor's."""
    devices = {local_tensor(p).device for group in ours for _, p in group}
    if len(devices) == 1 and next(iter(devices)).type != "meta":
        return next(iter(devices))
    return device


def load_from_full_optimizer_state_dict(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    full_sd: Mapping[str, Any],
    device: torch.device | str,
    *,
    broadcast_from_rank0: bool = False,
    strict: bool = True,
    release_sd: bool = False,
    param_names: Sequence[str] | None = None,
    bucket_bytes: int | None = None,
) -> _IncompatibleKeys:
    """Load a full optimizer state into a (sharded) optimizer, each rank keeping only its shards.

    Parameters and param groups are matched by FQN, never by position: each of the optimizer's
    groups takes the hyper-parameters (``lr``, ``betas``, ``initial_lr``, ...) of the saved group
    that lists its parameters, whatever the order of groups or of parameters within them. The
    state may be the FQN layout (:func:`get_full_optimizer_state_dict`, DCP's full optimizer
    state dict) or a plain single-process ``opt.state_dict()`` with integer ids, converted by
    :func:`to_fqn_optimizer_state_dict` with ``opt`` (ids follow ``opt``'s groups when the group
    sizes agree, as torch's own ``load_state_dict`` does, else ``model.named_parameters()`` order;
    ``param_names`` overrides both). Everything is validated, identically on every rank,
    before any tensor moves or the optimizer changes; then state tensors are split into shards by
    :mod:`fsdptk._engine` and handed to ``opt.load_state_dict`` (which applies torch's own dtype
    and device rules: floating state takes the parameter's dtype).

    Args:
        model: the (sharded) model the optimizer's parameters belong to.
        opt: the optimizer to restore, created over the model's (sharded) parameters.
        full_sd: the full state (CPU tensors). With ``broadcast_from_rank0`` only rank 0's is read
            and the other ranks may pass ``{}``.
        device: where state tensors go when the parameters do not share one device (otherwise
            state goes to the parameters' device, so CPU-offloaded parameters get CPU state).
        broadcast_from_rank0: only rank 0 reads ``full_sd``; each rank receives only its shard
            bytes (scattered bucket by bucket) and the small metadata (one object collective).
        strict: raise when an optimizer parameter is in no saved group, or a saved parameter is not
            in the optimizer. With ``strict=False`` such optimizer parameters keep their current
            state and hyper-parameters, and such saved entries are ignored.
        release_sd: delete each state tensor from ``full_sd["state"][fqn]`` as soon as it has
            been used, so memory shrinks as the load proceeds. This MUTATES ``full_sd``; by
            default (``False``) the caller's dict is left untouched.
        param_names: for an integer-id state, the FQN of each id (see
            :func:`to_fqn_optimizer_state_dict`).
        bucket_bytes: full-tensor bytes per scatter bucket (``None``: the engine's default, 16 MiB).

    Returns:
        torch.nn.modules.module._IncompatibleKeys: ``missing_keys`` (optimizer parameters no saved
        group lists) and ``unexpected_keys`` (saved parameters not in the optimizer).

    Raises:
        StateDictMismatchError: with ``strict=True``, on every rank before anything changes: a
            saved parameter the optimizer lacks or an optimizer parameter no saved group lists
            (``missing_keys`` / ``unexpected_keys``; a ``RuntimeError`` and a ``ValueError``).
        ValueError: on every rank, before anything changes: a malformed state, a state tensor
            whose shape differs from its parameter's (key and both shapes), an optimizer group
            whose parameters come from several saved groups, states that differ between ranks.
        TypeError: on every rank, when a state value that must be a tensor is not one, or an
            argument has the wrong type (``model``, ``opt``, ``full_sd``: named with its type).
        Exception: a failure on any rank while the state moves, on every rank, naming that rank;
            the optimizer is changed only once every rank has all of its state.

    Examples:
        >>> import torch
        >>> from fsdptk import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict
        >>> model = torch.nn.Linear(2, 3)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> osd = get_full_optimizer_state_dict(model, opt, is_rank_zero=True)
        >>> opt2 = torch.optim.AdamW(model.parameters(), lr=0.5)
        >>> load_from_full_optimizer_state_dict(model, opt2, osd, "cpu")
        <All keys matched successfully>
        >>> b = model.bias
        >>> opt2.param_groups[0]["lr"], torch.equal(opt2.state[b]["exp_avg"], opt.state[b]["exp_avg"])
        (0.001, True)
    """
    reads = is_rank0() or not broadcast_from_rank0
    error: Exception | None = None
    try:  # a bad argument or input on any rank is raised on every rank by the exchange below
        _check_args(model, opt)
        if reads:
            check_type(full_sd, Mapping, "full_sd", "a Mapping (a full optimizer state dict)")
        dev = torch.device(device)
        nbytes = bucket_size(bucket_bytes)
        ours = optim_groups(model, opt)
        params = {fqn: p for group in ours for fqn, p in group}
        view, source, mine = (_reader_view(model, ours, full_sd, param_names, broadcast_from_rank0) if reads
                              else (None, NestedSource({}, []), None))  # a rank that reads nothing
        shapes = ShapesSource({fqn: TensorMeta(tuple(p.shape), p.dtype) for fqn, p in params.items()})
    except Exception as e:  # noqa: BLE001 - agreed by the engine's exchange just below
        error, params, shapes, mine = e, {}, ShapesSource({}), None
        dev, nbytes = torch.device("cpu"), 1
    # ONE object exchange before any tensor moves: the engine agrees on the parameters' layouts
    # (the same targets on every rank) and carries each reading rank's view of the state, or its
    # argument error, with them
    plan = _engine.agree(list(params.items()), shapes, src_rank0=broadcast_from_rank0, cast=False, extra=mine,
                         arguments=arguments_view("load_from_full_optimizer_state_dict",
                                                  broadcast_from_rank0=broadcast_from_rank0, strict=strict,
                                                  bucket_bytes=bucket_bytes),
                         failed=error)
    view, verdicts = _agree_view(view, plan.extras or [], broadcast_from_rank0)
    if strict:
        _check_strict(view, param_fqns(model)[1])
    plan = _state_plan(plan, view, verdicts, broadcast_from_rank0)
    # validation is over on every rank: from here on state moves (agreed per bucket by the engine)
    local = dict(_engine.distribute(plan, source, device=_state_device(ours, dev), release=release_sd,
                                    bucket_bytes=nbytes))
    with agreed():  # the optimizer changes only once every rank has built its new state
        new_osd = local_osd(opt, ours, view, local)
    opt.load_state_dict(new_osd)
    return _IncompatibleKeys(list(view.missing), list(view.unexpected))

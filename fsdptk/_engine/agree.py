"""Agreement: the metadata of a load agreed on every rank before any tensor moves, and the
per-bucket status agreement that turns a failure on any rank into the same error on every rank.

Failure protocol (``docs/failure_model.md``): a failure on any rank, in any phase, becomes the same
exception on every rank. The metadata agreement (:func:`agree`, one object all-gather) carries each
rank's local error; after it every bucket has exactly one status agreement (:class:`Status`: one
``all_reduce`` of three int64s: the lowest failing rank, and a checksum of the replicated tensors
read since the last agreement), placed before any byte of that bucket moves, plus one after the
last bucket. A rank that fails (a read, a pack, an unpack, the post of a message, the caller's
code thrown in with ``generator.throw``) stops working and goes to the next agreement, where every
rank raises the lowest failing rank's error (one object all-gather of the messages, only then); a
post that raises still posts every message of the bucket the peers wait for
(:meth:`~fsdptk._engine.wire.InFlight.post_all`), so they reach that agreement too. Outputs are
yielded only after their bucket's agreement, and the final agreement runs before the generator
ends, so a caller that assigns after the loop never assigns on one rank what another rank failed
to load.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fsdptk._core.arguments import ArgumentsView, check_arguments
from fsdptk._core.dist import (
    all_gather_object,
    comm_device,
    comm_errors,
    comm_group,
    error_payload,
    raise_lowest,
    waiter,
)
from fsdptk._core.dist import raise_problems as _raise
from fsdptk._core.dist import world as _world
from fsdptk._engine.layouts import Layout, PlainLayout, layout_of
from fsdptk._engine.sources import Source, SourceProblem, TensorMeta, as_source
from fsdptk._engine.wire import Refused


class RankLayout(NamedTuple):
    """One rank's piece of one target, as rank 0 needs it to pack that rank's bytes."""

    local: Any  # the layout's box (or NF4 slice) of the full tensor this rank holds
    parts: Any  # the layout's wire parts: how that box travels


class SourceCheck(NamedTuple):
    """A reading rank's verdict on its source (:func:`check_source`), exchanged between ranks."""

    problems: list[tuple[str, str]]  # (exception type name, message naming the key)
    missing: list[str]  # target fqns the source lacks
    unexpected: list[str]  # source keys that are not targets
    metas: dict[str, TensorMeta]  # fqn -> the source tensor's shape and dtype


class _LoadView(NamedTuple):
    """What each rank sends in :func:`agree`'s one object exchange."""

    fingerprint: str | None  # of its targets (fqns, shapes, dtypes, layout kinds)
    check: SourceCheck | None  # its verdict on its source (``None``: it does not read one)
    layouts: list[RankLayout] | None  # per target, its piece (rank-0 scatters only)
    error: Any  # error_payload of its local failure, or None
    extra: Any  # the caller's own pre-flight view
    arguments: ArgumentsView | None  # the call's per-rank arguments that change the exchange


@dataclass(frozen=True)
class LoadPlan:
    """The agreed metadata of one load, returned by :func:`agree` and consumed by ``distribute``.

    Attributes:
        keys: fqns present in both targets and source, in target order (what ``distribute`` yields).
        missing: target fqns absent from the source.
        unexpected: source keys that are not targets (rank 0's source when ``src_rank0``).
        metas: fqn -> :class:`TensorMeta` of the source tensor, for every key in ``keys``.
        src_rank0: whether only rank 0 reads the source.
        cast: whether outputs take the target dtype (else the source dtype).
        entries: ``(fqn, layout)`` of every key, in ``keys`` order.
        layouts: per rank, per entry, that rank's :class:`RankLayout` (rank-0 scatters with more
            than one rank only; ``None`` otherwise).
        extras: per rank, the ``extra`` each rank passed to :func:`agree`.
    """

    keys: list[str]
    missing: list[str]
    unexpected: list[str]
    metas: dict[str, TensorMeta]
    src_rank0: bool
    cast: bool
    entries: list[tuple[str, Layout]]
    layouts: list[list[RankLayout]] | None = None
    extras: list[Any] | None = None

    @classmethod
    def replicated(cls, targets: Sequence[tuple[str, torch.Tensor]], metas: Mapping[str, TensorMeta]) -> LoadPlan:
        """A rank-0 scatter plan for plain (replicated) targets, with no collective.

        For tensors whose shapes and dtypes every rank already agreed in an earlier exchange
        (``metas``: rank 0's source tensors): a plain target's piece is the whole tensor on every
        rank, so every rank's layout is known without exchanging it.

        Raises:
            ValueError: a target is not a plain tensor (a DTensor or NF4 needs :func:`agree`).

        Examples:
            >>> import torch
            >>> t = torch.empty(3, device="meta")
            >>> LoadPlan.replicated([("b", t)], {"b": TensorMeta((3,), torch.float32)}).keys
            ['b']
        """
        entries = [_entry(fqn, t) for fqn, t in targets]
        bad = [fqn for fqn, lay in entries if type(lay) is not PlainLayout]
        if bad:
            raise ValueError(f"LoadPlan.replicated takes plain tensors only; {bad} are sharded or quantised")
        world = _world()[0]
        mine = [RankLayout(lay.local, lay.parts) for _, lay in entries]
        return cls(keys=[fqn for fqn, _ in entries], missing=[], unexpected=[],
                   metas={fqn: metas[fqn] for fqn, _ in entries}, src_rank0=True, cast=True,
                   entries=entries, layouts=[list(mine) for _ in range(world)] if world > 1 else None)

    def moving_like(self, rows: Sequence[tuple[str, str]], metas: Mapping[str, TensorMeta]) -> LoadPlan:
        """A plan for other source tensors, each moving exactly like one of this plan's keys.

        No collective: every rank derives it from this (agreed) plan and the agreed ``metas``.
        Used where the tensors to move are not known on every rank before the one metadata
        exchange (an optimizer's state, keyed by the parameter it belongs to): the exchange is
        made over the targets, and each ``(name, key)`` of ``rows`` then takes ``key``'s layout on
        every rank, and ``metas[name]`` as its source's shape and dtype.

        Examples:
            >>> import torch
            >>> plan = agree([("w", torch.empty(2, 3, device="meta"))], {"w": torch.ones(2, 3)})
            >>> plan.moving_like([("w.m", "w"), ("w.v", "w")], {"w.m": plan.metas["w"], "w.v": plan.metas["w"]}).keys
            ['w.m', 'w.v']
        """
        index = {fqn: i for i, fqn in enumerate(self.keys)}
        picks = [(name, index[key]) for name, key in rows]
        return LoadPlan(
            keys=[name for name, _ in picks], missing=[], unexpected=[],
            metas={name: metas[name] for name, _ in picks}, src_rank0=self.src_rank0, cast=self.cast,
            entries=[(name, self.entries[i][1]) for name, i in picks],
            layouts=None if self.layouts is None else [[mine[i] for _, i in picks] for mine in self.layouts],
            extras=self.extras)

    def out_dtype(self, fqn: str, layout: Layout) -> torch.dtype:
        """The dtype of ``fqn``'s output: the target's (cast, or NF4) or the source's."""
        if self.cast or layout.quantized:
            return layout.target.dtype
        return self.metas[fqn].dtype


def fingerprint(rows: Iterable[tuple[Any, ...]]) -> str:
    return hashlib.sha1(repr(list(rows)).encode()).hexdigest()


def _entry(fqn: str, t: Any) -> tuple[str, Layout]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"target {fqn!r} is a {type(t).__name__}, not a tensor")
    return fqn, layout_of(t)


def check_source(entries: Sequence[tuple[str, Layout]], source: Mapping[str, Any] | Source, cast: bool,
                 ) -> SourceCheck:
    """A reading rank's local verdict on its source (:class:`SourceCheck`).

    ``problems`` are ``(exception type name, message)`` pairs naming the key, both shapes or both
    dtypes; :func:`merge_checks` turns every rank's verdict into the agreed one. :func:`agree`
    exchanges this verdict itself; a caller that must exchange it in its own ``extra`` (because
    only the reading ranks know which tensors there are) calls it directly.

    Examples:
        >>> import torch
        >>> from fsdptk._engine.layouts import layout_of
        >>> check_source([("w", layout_of(torch.empty(2, 3)))], {"w": torch.ones(3, 2)}, True).problems
        [('ValueError', "'w': shape mismatch: the source has [3, 2], the model has [2, 3]")]
    """
    source = as_source(source)
    problems: list[tuple[str, str]] = []
    names = {fqn for fqn, _ in entries}
    unexpected = [k for k in source.keys() if k not in names]  # noqa: SIM118 - a Source has keys(), no __iter__
    missing: list[str] = []
    metas: dict[str, TensorMeta] = {}
    for fqn, layout in entries:
        if fqn not in source:
            missing.append(fqn)
            continue
        try:
            meta = source.meta(fqn)
        except SourceProblem as p:
            problems.append((p.kind, str(p)))
            continue
        metas[fqn] = meta
        if meta.shape != layout.shape:
            problems.append(("ValueError", f"{fqn!r}: shape mismatch: the source has "
                             f"{list(meta.shape)}, the model has {list(layout.shape)}"))
        src_float = meta.dtype.is_floating_point or meta.dtype.is_complex
        target = layout.target
        tgt_float = target.dtype.is_floating_point or target.dtype.is_complex
        if (cast or layout.quantized) and src_float and not tgt_float:
            problems.append(("ValueError", f"{fqn!r}: dtype mismatch: cannot load the source's "
                             f"{meta.dtype} into the model's {target.dtype}"))
    return SourceCheck(problems=problems, missing=missing, unexpected=unexpected, metas=metas)


def merge_checks(checks: Sequence[SourceCheck | None], src_rank0: bool,
                 ) -> tuple[list[str], list[str], dict[str, TensorMeta]]:
    """The agreed verdict from every rank's :func:`check_source` (``None`` for a rank that did not
    read): ``(missing, unexpected, metas)``, or the same error on every rank.

    With ``src_rank0`` rank 0's verdict is the verdict; otherwise every rank's problems count
    (tagged with the rank) and sources that differ between ranks (keys, shapes or dtypes) are an
    error.

    Raises:
        ValueError: shape or dtype problems (keys, shapes, dtypes, ranks), or sources that differ.
        TypeError: when the only problems are non-tensor values (key and type).

    Examples:
        >>> import torch
        >>> from fsdptk._engine.layouts import layout_of
        >>> merge_checks([check_source([("w", layout_of(torch.empty(2)))], {"w": torch.ones(2)}, True)], True)[0]
        []
    """
    world = len(checks)
    first = checks[0]
    if first is None:
        raise ValueError("merge_checks: rank 0 has no verdict on its source (rank 0 always reads)")
    problems = list(first.problems)
    if not src_rank0:  # every rank read its own source: all problems count, the sources must match
        problems = []
        for r, check in enumerate(checks):
            if check is None:
                raise ValueError(f"merge_checks: rank {r} has no verdict on its source")
            tag = "" if world == 1 else f"rank {r}: "
            problems += [(k, tag + m) for k, m in check.problems]
        problems = list(dict.fromkeys(problems))
        if not problems:
            diff = [r for r, check in enumerate(checks) if check is not None and
                    (check.missing, check.unexpected, check.metas) != (first.missing, first.unexpected, first.metas)]
            if diff:
                problems.append(("ValueError", f"the sources differ (keys, shapes or dtypes) between "
                                 f"rank 0 and ranks {diff}; pass src_rank0=True to read rank 0's only"))
    missing, unexpected, metas = first.missing, first.unexpected, first.metas
    _raise(problems, "cannot load the state")
    return missing, unexpected, metas


def agree(
    targets: Sequence[tuple[str, torch.Tensor]],
    source: Mapping[str, Any] | Source,
    *,
    src_rank0: bool = False,
    cast: bool = True,
    extra: Any = None,
    arguments: ArgumentsView | None = None,
    failed: BaseException | None = None,
) -> LoadPlan:
    """Agree on every rank which keys move, with which shapes and dtypes, before any tensor moves.

    One object collective (``all_gather_object``) carries each rank's view: the fingerprint of its
    targets, its verdict on the source (or only rank 0's when ``src_rank0``) and, when ``src_rank0``,
    its shard layout, so rank 0 can pack exactly each rank's bytes later.

    Args:
        targets: ordered ``(fqn, target)`` pairs, the same on every rank. A target is a DTensor
            (any mesh/placements; the local tensor may be on ``meta``), a plain tensor (replicated),
            an ``NF4Tensor`` or a DTensor wrapping one.
        source: full tensors by fqn: a :class:`~fsdptk._engine.sources.Source`, a dict or any
            Mapping (lazy ones too; one with ``get_slice(key)`` returning a safetensors-style slice
            is read via its metadata and, in ``distribute``, shard-on-read). Only rank 0's is read
            when ``src_rank0``.
        src_rank0: only rank 0 holds the source (others may pass ``{}``).
        cast: outputs take the target's dtype (a floating source into an integer target is an
            error); ``False`` keeps the source dtype (no dtype check).
        extra: the caller's own pre-flight view (any picklable value), carried in the same object
            exchange so that a call needs no second one; every rank's is in ``plan.extras``.
        arguments: the calling function's per-rank arguments that change what the ranks exchange
            (:func:`fsdptk._core.arguments.arguments_view`), carried in the same exchange and
            compared first: ranks that differ get one ValueError naming each argument and every
            rank's value, before any other verdict.
        failed: the caller's own pre-flight error on this rank (a bad argument), carried in the
            same exchange: every rank then raises the lowest failing rank's error, and a caller
            needs no agreement of its own before this one. ``targets`` and ``source`` are not
            looked at on a rank that passes it.

    Returns:
        LoadPlan: ``keys`` (in target order), ``missing``, ``unexpected``, ``metas``, ``extras``.

    Raises:
        ValueError: on every rank, naming the arguments the ranks disagree on (each rank's
            value); listing each shape mismatch (key and both shapes), each float
            into integer target (key and both dtypes), targets or sources that differ between ranks.
        TypeError: on every rank, when the only problems are non-tensor values (key and type).
        Exception: ``failed`` (the lowest failing rank's), on every rank.

    Examples:
        >>> import torch
        >>> from fsdptk._engine import agree
        >>> plan = agree([("w", torch.empty(2, 3, device="meta"))], {"w": torch.ones(2, 3), "x": torch.ones(1)})
        >>> plan.keys, plan.missing, plan.unexpected
        (['w'], [], ['x'])
    """
    world, rank = _world()
    entries: list[tuple[str, Layout]] = []
    fp, check, layout, error = None, None, None, failed
    try:  # local work: a failure here (a lazy source raising, a bad target) is agreed below
        if failed is not None:
            raise failed
        source = as_source(source)
        entries = [_entry(fqn, t) for fqn, t in targets]
        counts = Counter(f for f, _ in entries)
        dupes = [f for f, n in counts.items() if n > 1]
        if dupes:
            raise ValueError(f"duplicate target fqns: {dupes}")
        fp = fingerprint((f, lay.shape, str(lay.target.dtype), type(lay).__name__) for f, lay in entries)
        reads = rank == 0 or not src_rank0
        check = check_source(entries, source, cast) if reads else None
        layout = ([RankLayout(lay.local, lay.parts) for _, lay in entries] if src_rank0 and world > 1
                  else None)
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = e
    views = all_gather_object(_LoadView(fingerprint=fp, check=check, layouts=layout,
                                        error=error_payload(error), extra=extra, arguments=arguments))
    if any(v.arguments is not None for v in views):  # first: a disagreement explains the rest
        check_arguments([v.arguments or ArgumentsView(call="(no arguments sent)", values=()) for v in views])
    raise_lowest([v.error for v in views], error)
    diff = [r for r, v in enumerate(views) if v.fingerprint != views[0].fingerprint]
    if diff:
        raise ValueError(f"the targets (fqns, shapes, dtypes) differ between rank 0 and ranks {diff}")
    missing, unexpected, metas = merge_checks([v.check for v in views], src_rank0)
    keep = [(f, lay) for f, lay in entries if f in metas]
    layouts = None
    if src_rank0 and world > 1:
        index = {f: i for i, (f, _) in enumerate(entries)}
        layouts = []
        for v in views:
            assert v.layouts is not None, "every rank sends its layout for a rank-0 scatter"
            layouts.append([v.layouts[index[f]] for f, _ in keep])
    return LoadPlan(keys=[f for f, _ in keep], missing=missing, unexpected=unexpected, metas=metas,
                    src_rank0=src_rank0, cast=cast, entries=keep, layouts=layouts,
                    extras=[v.extra for v in views])


# ---------------------------------------------------------------------------------------------
# status agreement (the failure protocol of distribute and collect; see the module docstring)

_SUM_BITS = 60  # checksums fit an int64 with room to negate


def _checksum(tensors: Iterable[torch.Tensor]) -> int:
    """A cheap content checksum: the sum of the tensors' 32-bit words (16-bit, 8-bit for odd sizes).

    Any changed value changes it; a permutation of the same values does not (not needed here: it
    tells apart what different ranks loaded, not an adversary).
    """
    total = 0
    for t in tensors:
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if b.storage_offset() % 4:  # word views need aligned storage: the same sum either way
            b = b.clone()
        n = b.numel()
        words = b.view(torch.int32) if n % 4 == 0 else b.view(torch.int16) if n % 2 == 0 else b
        total = total * 1000003 + n + int(torch.sum(words, dtype=torch.int64))
    return total & ((1 << _SUM_BITS) - 1)


class Status:
    """One rank's side of the status agreements of one engine call.

    ``error`` is this rank's first failure (its own, or the caller's thrown in with
    ``generator.throw``); ``sums`` the checksums of the replicated (non-DTensor) tensors this rank
    read since the last agreement, kept only when every rank reads its own source. ``waiter``
    waits for every transfer and agreement of the call (with gloo in a helper thread, so that a
    peer lost mid-transfer raises within seconds instead of at the process group's timeout; see
    :mod:`fsdptk._core.peers`); :func:`guarded` closes it.
    """

    def __init__(self, what: str, check_replicas: bool = False) -> None:
        self.what = what
        self.error: BaseException | None = None
        self.check_replicas = check_replicas
        self.sums: list[tuple[str, int]] = []
        self.waiter = waiter()  # every wait of the call: a lost peer cannot hang it (gloo)

    def fail(self, error: BaseException, context: str | None = None) -> None:
        """Record ``error`` (the first one only); ``context`` (e.g. the key) becomes a note."""
        if self.error is None:
            if context:
                error.add_note(f"fsdptk {self.what}: {context} on rank {_world()[1]}")
            self.error = error

    def fail_post(self, refused: Refused | None) -> None:
        """Record a post of a bucket's message that raised (``InFlight.post_all`` still posted
        every message of the bucket, so the peers reach the next agreement, where it is raised)."""
        if refused is not None:
            self.fail(refused.error, f"posting a message of a bucket for rank {refused.peer}")

    def replica(self, fqn: str, tensors: Iterable[torch.Tensor]) -> None:
        """Remember the checksum of a replicated tensor this rank read from its own source."""
        if self.check_replicas:
            self.sums.append((fqn, _checksum(tensors)))

    def agree(self) -> None:
        """Collective: raise the lowest failing rank's error, or differing replicas, on every rank."""
        world, rank = _world()
        if world == 1:
            if self.error is not None:
                raise self.error
            return
        h = int(hashlib.sha1(repr(self.sums).encode()).hexdigest(), 16) & ((1 << _SUM_BITS) - 1)
        t = torch.tensor([world - rank if self.error is not None else 0, h, -h], dtype=torch.int64,
                         device=comm_device())
        with comm_errors(self.what):  # waited like a transfer: a lost peer cannot hang it
            self.waiter.wait([dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm_group(), async_op=True)])
        failed, high, low = (int(v) for v in t.tolist())
        if failed:
            raise_lowest(all_gather_object(error_payload(self.error)), self.error)
        if high != -low:
            self._raise_replicas_differ()
        self.sums = []

    def _raise_replicas_differ(self) -> None:
        views = [dict(v) for v in all_gather_object(self.sums)]
        bad: dict[str, list[int]] = {}
        for r, view in enumerate(views[1:], start=1):
            for fqn, s in view.items():
                if views[0].get(fqn) != s:
                    bad.setdefault(fqn, []).append(r)
        shown = "; ".join(f"{fqn!r}: ranks {ranks} differ from rank 0" for fqn, ranks in bad.items())
        raise ValueError(
            f"cannot load the state: {len(bad)} replicated (non-DTensor) tensor(s) would hold "
            f"different values on different ranks ({shown}). Each rank read its own source: give "
            "every rank the same values, or pass broadcast_from_rank0=True so that every rank gets "
            "rank 0's."
        )

    def abandon(self) -> None:
        """The caller dropped the generator mid-way: still take part in the next agreement."""
        if self.error is None:
            self.error = RuntimeError(
                f"fsdptk {self.what}: rank {_world()[1]} stopped iterating before the end (the code "
                "consuming the generator raised there, or broke out of its loop); that rank's own "
                "error has the cause")
        try:
            self.agree()
        except Exception:  # noqa: BLE001 - this rank is already leaving with its own error
            pass


def hand_over(items: Iterable[Any], status: Status) -> Iterator[Any]:
    """Yield ``items`` to the caller; an exception thrown in (``generator.throw``) is recorded."""
    for item in items:
        try:
            yield item
        except Exception as e:  # noqa: BLE001 - the caller's failure, agreed at the next boundary
            status.fail(e, "the caller's code failed")
            return


def guarded(body: Iterator[Any], status: Status) -> Iterator[Any]:
    """Run an engine generator ``body`` so that a caller who abandons it still agrees."""
    try:
        yield from body
    except GeneratorExit:
        status.abandon()
        raise
    finally:
        status.waiter.close()

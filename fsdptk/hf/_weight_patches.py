"""Only what changed: :meth:`fsdptk.hf.HubWeightSource.iter_patches` and the baseline it compares
against (``weight_source(..., track_changes=True)``).

The baseline is kept where the weights are. Each rank that sends a box of a model tensor to its
owner in a gather (one holder per distinct box: :func:`fsdptk._engine.choose_senders`) keeps its
pieces of the Hub tensors in that box, cast to the wire dtype: what the engine last received. A
patch pass compares each such piece with the current weights cast the same way, bit for bit, maps
the changed positions to flat indices of the whole Hub tensor (the conversion's nodes say where a
box of a model tensor lands in each Hub tensor: :func:`fsdptk._plans.hub_pieces.box_pieces`), and
sends the owner only those indices (int32) and values. The owner merges the pieces of a name into
one ascending patch.

Tensors that no holder can cut into Hub pieces on its own (a LoRA layer merged into its base
weight, a conversion that is not a rename, stack, concatenation or transposition, NF4) are
"gathered": the owner gets them whole through the full pass's gather and compares them with its
own baseline of the whole Hub tensor (it owns that name).

Abandoned passes. The engine applies any prefix of a pass (vLLM's receiver has no rollback), so a
pass changes the baseline in place (every holder already has the pass's values), and the positions
that pass could have changed at the engine (those it sent, or, for a full pass, those whose bits
differed from the old baseline) are remembered as ``uncertain`` until a pass completes on every
rank: the next patch pass sends them whatever their bits. Completing a pass forgets them.

Memory. Comparing is done in chunks (:func:`chunks`) of at most ``bucket_bytes`` for a chunk in the
wire dtype and its one-byte mask, whatever the piece's size: each chunk of the current weights is
cast on its own (a view where no cast is needed), compared with the matching slice of the baseline,
which is then updated in place. What a comparison keeps beyond a chunk is its positions (int32, 4
bytes per element to send). The one whole copy left: a piece that
:func:`~fsdptk._plans.hub_pieces.box_pieces` cuts with ``index_select`` (a concatenation whose box
along that dim is a strided shard's scattered indices) is copied in the model's dtype first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch

from fsdptk._core.compat import local_tensor
from fsdptk._core.dist import all_gather_object, comm_device, comm_errors, error_payload, raise_lowest
from fsdptk._engine.agree import Status
from fsdptk._engine.layouts import Box, box_shape
from fsdptk._engine.wire import DEFAULT_BUCKET_BYTES, DIRECT_MIN_BYTES, InFlight, Post, aligned, pack, unpack
from fsdptk._plans.hub_items import Items, Plan
from fsdptk._plans.hub_pieces import box_pieces
from fsdptk._plans.source_plan import Ownership, Part

__all__ = ["Tracker", "PatchCounts", "patch_bytes", "positions", "changed_positions", "chunks", "chunk_elements",
           "hub_flat", "merge_parts"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PatchCounts(NamedTuple):
    """What each rank sends in a patch pass's one exchange, before anything moves."""

    error: Any  # error_payload of its failure so far (a NaN, a changed shape), or None
    counts: dict[str, int]  # Hub name -> the number of elements this rank sends for it (> 0 only)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of the same size (compared bit for bit: NaN == NaN, -0 != +0)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()])


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The flat positions (int64, ascending) where the 1-D bool ``mask`` is set.

    ``nonzero`` costs about the same whatever the density (on a CPU, about ten times a count), and
    a step of a small learning rate sets very few: so count first, and where under one element in
    64 is set, look for the set ones among 8-byte words (an eighth of the elements), then inside
    those words only.

    Examples:
        >>> import torch
        >>> m = torch.zeros(1000, dtype=torch.bool); m[[3, 64, 999]] = True
        >>> positions(m).tolist()
        [3, 64, 999]
    """
    n = mask.numel()
    count = int(mask.count_nonzero())
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    body = n - n % 8
    if count * 64 >= n or body == 0 or mask.storage_offset() % 8:
        return mask.nonzero().squeeze(1)
    words = mask[:body].view(torch.int64)  # 8 bools per word
    hit = words.nonzero().squeeze(1)
    inner = mask[:body].view(-1, 8)[hit].nonzero()
    out = hit[inner[:, 0]] * 8 + inner[:, 1]
    if body < n:
        out = torch.cat([out, mask[body:].nonzero().squeeze(1) + body])
    return out


def changed_positions(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The flat positions (int64, ascending) where the 1-D tensors ``new`` and ``base`` (the same
    dtype and length) differ bit for bit.

    Compared 8 bytes at a time (4 bf16 elements per word): the mask and the search over it are a
    quarter of an element-wise one; only the words that differ are compared element by element
    (where over one word in 16 differs, the whole comparison is made element by element instead).

    Examples:
        >>> import torch
        >>> a = torch.zeros(11, dtype=torch.bfloat16); b = a.clone(); b[[1, 6, 10]] = 1
        >>> changed_positions(b, a).tolist(), changed_positions(a, a).tolist()
        ([1, 6, 10], [])
    """
    size = new.element_size()
    per = 8 // size if size < 8 else 1
    n = new.numel()
    body = n - n % per
    if per == 1 or body == 0 or (new.storage_offset() * size) % 8 or (base.storage_offset() * size) % 8:
        return positions(_bits(new) != _bits(base))
    words = new[:body].view(torch.int64) != base[:body].view(torch.int64)
    if int(words.count_nonzero()) * 16 > words.numel():  # dense: element by element is cheaper
        return positions(_bits(new) != _bits(base))
    hit = positions(words)  # the words that differ
    if hit.numel():
        inner = (_bits(new[:body].view(-1, per)[hit]) != _bits(base[:body].view(-1, per)[hit])).nonzero()
        out = hit[inner[:, 0]] * per + inner[:, 1]
    else:
        out = hit
    if body < n:
        out = torch.cat([out, (_bits(new[body:]) != _bits(base[body:])).nonzero().squeeze(1) + body])
    return out


def chunk_elements(chunk_bytes: int, dtype: torch.dtype) -> int:
    """How many elements a chunk of the comparison holds: its copy in the wire ``dtype`` and its
    one-byte-per-element mask within ``chunk_bytes`` (at least one element).

    Examples:
        >>> import torch
        >>> chunk_elements(16 * 2**20, torch.bfloat16)  # a bucket of the default 16 MiB, bf16 on the wire
        5592405
        >>> chunk_elements(2, torch.float32)
        1
    """
    return max(1, chunk_bytes // (dtype.itemsize + 1))


def chunks(t: torch.Tensor, elements: int, offset: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """``(flat offset, view)`` of consecutive runs of ``t``'s elements in C order, each of at most
    ``elements`` elements, that together cover ``t`` once (views: nothing is copied). A contiguous
    ``t`` is cut flat, at multiples of 8 elements (8-byte words of the baseline slices stay
    aligned); any other in whole rows of dim 0 (a multiple of 8 rows where a chunk holds 8 or
    more), a row larger than ``elements`` cut the same way, recursively.

    Examples:
        >>> import torch
        >>> t = torch.arange(12).view(3, 4)
        >>> [(off, c.tolist()) for off, c in chunks(t, 5)]  # contiguous: flat
        [(0, [0, 1, 2, 3, 4]), (5, [5, 6, 7, 8, 9]), (10, [10, 11])]
        >>> [(off, c.tolist()) for off, c in chunks(t.t(), 6)]  # a transposed view: whole rows
        [(0, [[0, 4, 8], [1, 5, 9]]), (6, [[2, 6, 10], [3, 7, 11]])]
        >>> [(off, c.tolist()) for off, c in chunks(t.t(), 2)]  # a row larger than a chunk: cut too
        [(0, [0, 4]), (2, [8]), (3, [1, 5]), (5, [9]), (6, [2, 6]), (8, [10]), (9, [3, 7]), (11, [11])]
    """
    n = t.numel()
    if n <= elements:
        yield offset, t
        return
    if t.is_contiguous():
        flat = t.view(-1)
        step = elements - elements % 8 if elements >= 8 else elements
        for s in range(0, n, step):
            yield offset + s, flat[s:s + step]
        return
    row = n // t.shape[0]
    if row > elements:
        for r in range(t.shape[0]):
            yield from chunks(t[r], elements, offset + r * row)
        return
    rows = elements // row
    if rows >= 8:
        rows -= rows % 8
    for r in range(0, t.shape[0], rows):
        yield offset + r * row, t[r:r + rows]


def _wire_flat(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``part`` in ``dtype``, flat and contiguous: a view where it already is, else one copy of
    the part alone (the cast and the reordering in one ``copy_``)."""
    if part.dtype == dtype and part.is_contiguous():
        return part.view(-1)
    out = torch.empty(part.shape, dtype=dtype)
    out.copy_(part)
    return out.view(-1)


def hub_flat(local: torch.Tensor, box: Box, shape: tuple[int, ...]) -> torch.Tensor:
    """Flat C-order indices into a tensor of ``shape`` of the positions ``local`` (flat C-order
    indices into the piece at ``box``): int32 where the tensor has fewer than 2**31 elements (every
    tensor a patch pass sends: larger ones are refused when the source is made), int64 otherwise.

    Examples:
        >>> import torch
        >>> hub_flat(torch.tensor([0, 3]), (slice(1, 3), (0, 2)), (4, 3)).tolist()  # rows 1-2, cols 0, 2
        [3, 8]
        >>> hub_flat(torch.tensor([0, 4]), (slice(2, 4), slice(0, 3)), (4, 3)).tolist()  # whole rows: a shift
        [6, 10]
    """
    itype = torch.int32 if math.prod(shape) < 2**31 else torch.int64  # half the bytes and the time
    sizes = box_shape(box)
    if not sizes:
        return local.to(itype)
    if _whole_rows(box, shape):
        row = math.prod(shape[1:])  # a run of whole rows (FSDP's Shard(0), an expert's whole matrix)
        return local.to(itype, copy=True).add_(box[0].start * row)
    out = torch.zeros_like(local, dtype=itype)
    rest = local.to(itype, copy=True)
    stride = 1
    for d in range(len(sizes) - 1, -1, -1):
        coord = rest % sizes[d] if d else rest
        if d:
            rest = rest.div_(sizes[d], rounding_mode="floor")
        b = box[d]
        hub = coord + b.start if isinstance(b, slice) else torch.tensor(b, dtype=itype)[coord]
        out += hub * stride
        stride *= shape[d]
    return out


def merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One name's ``(indices, values)`` from its holders' parts: strictly ascending int32 indices,
    contiguous, and their values (the parts are disjoint)."""
    if len(parts) == 1:
        idx, vals = parts[0]
    else:
        idx, vals = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        order = torch.argsort(idx)
        idx, vals = idx[order], vals[order]
    return idx.to(torch.int32).contiguous(), vals.contiguous()


def patch_bytes(count: int, dtype: torch.dtype) -> int:
    """Bytes of one piece's changes in a message: its int32 indices, then its values."""
    return aligned(4 * count) + aligned(count * dtype.itemsize)


@dataclass
class _Diff:
    """One piece's comparison: the positions to send (local flat indices, ascending)."""

    sel: torch.Tensor
    nan: int  # how many of them are NaN now
    integer: bool  # the piece is not floating (cannot be patched: NaN is the "unchanged" sentinel)


class Tracker:
    """One source's baseline on this rank, and the agreed plan of who compares what.

    The plan (:class:`fsdptk._plans.source_plan.TrackPlan`: the parts each holder compares, the
    names compared whole on their owner) is made on every rank from what every rank agreed, so
    every rank has the same without communication; here each rank keeps its own parts' baseline.
    ``chunk_bytes`` (the source's ``bucket_bytes``) bounds each chunk of a comparison
    (:func:`chunk_elements`).
    """

    def __init__(self, plan: Plan, layout: Ownership, rank: int, chunk_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        track = layout.track
        assert track is not None, "planned with track_changes=True"
        self.plan, self.rank, self.owners = plan, rank, layout.owners
        self.chunk_bytes = chunk_bytes
        self.own_boxes = layout.boxes
        self.gathered: set[str] = track.gathered
        self.parts: dict[str, list[Part]] = track.parts
        self.mine = {name: [p for p in ps if p.sender == rank] for name, ps in self.parts.items()}
        self.mine = {name: ps for name, ps in self.mine.items() if ps}
        self.base: dict[tuple[str, int], torch.Tensor] = {}  # (Hub name, item) -> this rank's piece
        self.full: dict[str, torch.Tensor] = {}  # gathered Hub name this rank owns -> the whole tensor
        self.uncertain: dict[tuple[str, int] | str, torch.Tensor] = {}  # key -> local flat indices
        self.valid = False  # a pass completed on every rank since the source was made
        self.pending: dict[tuple[str, int] | str, torch.Tensor] = {}  # this pass's positions sent / changed

    def begin(self) -> None:
        """A pass starts: nothing of it recorded yet."""
        self.pending = {}

    # -- this rank's pieces ----------------------------------------------------------------------
    def _views(self, items: Items) -> Iterator[tuple[tuple[str, int], torch.Tensor, torch.dtype]]:
        """``((Hub name, item), view, wire dtype)`` of each piece this rank keeps: views of its
        shards (cast chunk by chunk as they are compared)."""
        plan = self.plan
        wanted: dict[int, set[str]] = {}
        for name, ps in self.mine.items():
            for p in ps:
                wanted.setdefault(p.item, set()).add(name)
        for i in sorted(wanted):
            key, t = items[i]
            local = local_tensor(t).detach()
            node = plan.nodes.get(plan.conv_key[key]) if plan.nodes is not None else None
            own_box = self.own_boxes[i]
            assert own_box is not None, "a sender holds its box"
            pieces = box_pieces(node, own_box, local) if node is not None else [(plan.conv_key[key], own_box, local)]
            for name, _, piece in pieces:
                if name in wanted[i]:
                    yield (name, i), piece, plan.dtypes[key]

    def diff(self, items: Items, *, patch: bool) -> dict[tuple[str, int], _Diff]:
        """Compare every piece this rank keeps with the current weights, update the baseline in
        place and return what each piece sends (``patch``: the pass sends patches, so NaNs and
        integer tensors are counted; a full pass only records the positions it may change)."""
        out: dict[tuple[str, int], _Diff] = {}
        for key, view, dtype in self._views(items):
            out[key] = self._compare(key, view, dtype, patch)
        return out

    def _compare(self, key: tuple[str, int] | str, new: torch.Tensor, dtype: torch.dtype, patch: bool) -> _Diff:
        """One piece (``(name, item)``) or gathered tensor (its name), ``new`` in any dtype and
        layout, compared in ``dtype``: the positions to send (changed bits, and those left
        uncertain by an abandoned pass), recorded for this pass; the baseline updated to ``new``
        in place. Chunk by chunk (:func:`chunks`): a copy of one chunk at a time, never of the
        whole piece."""
        base = self.base.get(key) if isinstance(key, tuple) else self.full.get(key)
        floating = dtype.is_floating_point
        elements = chunk_elements(self.chunk_bytes // 2, dtype)  # half a bucket: the other half for positions
        if base is None:  # the first pass: the baseline is made; nothing to compare with yet
            base = torch.empty(new.shape, dtype=dtype)
            flat = base.view(-1)
            for off, part in chunks(new, elements):
                flat[off:off + part.numel()].view(part.shape).copy_(part)
            if isinstance(key, tuple):
                self.base[key] = base
            else:
                self.full[key] = base
            return _Diff(torch.empty(0, dtype=torch.int32), 0, not floating)
        flat_base = base.view(-1)
        uncertain = self.uncertain.get(key)
        found: list[torch.Tensor] = []
        nan = 0
        for off, part in chunks(new, elements):
            m = part.numel()
            if m == 0:
                continue
            cur, old = _wire_flat(part, dtype), flat_base[off:off + m]
            todo = None
            if uncertain is not None:  # after an abandoned pass (rare): those in this chunk
                lo, hi = torch.searchsorted(uncertain, torch.tensor([off, off + m], dtype=uncertain.dtype)).tolist()
                todo = uncertain[lo:hi] if hi > lo else None
            if todo is None:
                changed = changed_positions(cur, old)
                sel = changed
            else:  # one mask of both
                ne = _bits(cur) != _bits(old)
                changed = positions(ne)
                ne[todo.to(torch.int64) - off] = True
                sel = positions(ne)
                del ne
            if changed.numel():
                if changed.numel() * 256 > m:  # a scattered write costs more than a copy
                    old.copy_(cur)
                else:
                    old[changed] = cur[changed]
            del cur
            if sel.numel():
                if patch and floating:
                    nan += int(torch.isnan(old[sel]).sum())
                found.append(sel.to(torch.int32).add_(off))  # a piece has fewer than 2**31 elements
        sel = found[0] if len(found) == 1 else torch.cat(found) if found else torch.empty(0, dtype=torch.int32)
        del found
        if sel.numel():
            self.pending[key] = sel
        return _Diff(sel, nan, not floating)

    def values(self, key: tuple[str, int] | str, sel: torch.Tensor) -> torch.Tensor:
        """The baseline's (now current) values at ``sel``."""
        base = self.base[key] if isinstance(key, tuple) else self.full[key]
        return base.view(-1)[sel]

    def compare_full(self, name: str, t: torch.Tensor, patch: bool) -> _Diff:
        """A gathered Hub tensor this rank owns, whole: compared with (and kept as) its baseline."""
        return self._compare(name, t, t.dtype, patch)

    def finish(self, completed: bool) -> None:
        """After a pass: ``completed`` on every rank: the engine holds the baseline, nothing is
        uncertain any more; else the positions the pass may have changed stay uncertain."""
        sent, self.pending = self.pending, {}
        if completed:
            self.valid = True
            self.uncertain.clear()
            return
        if not self.valid:  # no baseline yet: the next completed pass sends everything anyway
            return
        for key, sel in sent.items():
            if sel.numel():
                old = self.uncertain.get(key)
                self.uncertain[key] = sel if old is None else torch.unique(torch.cat([old, sel]))


# ----------------------------------------------------------------------------------------------
# the patch pass
Stream = Callable[[list[int], set[str]], Iterator[list[tuple[str, torch.Tensor]]]]


def patch_pass(tracker: Tracker, items: Callable[[], Items], stream: Stream, make_patch: Callable[..., Any],
               bucket_bytes: int) -> Iterator[Any]:
    """One pass of :meth:`fsdptk.hf.HubWeightSource.iter_patches` (collective; see there).

    Args:
        tracker: the source's baseline and plan.
        items: the model's current ``(key, tensor)`` items.
        stream: ``(items to gather, Hub names)`` -> the full pass's buckets of those names (the
            gathered names, compared on their owners).
        make_patch: ``(name, indices, values, full_shape)`` -> the record (vLLM's ``SparseWeightPatch``
            or fsdptk's).
        bucket_bytes: patch bytes per bucket (indices and values of every holder's pieces).
    """
    tracker.begin()
    completed = False
    try:
        yield from _patches(tracker, items, stream, make_patch, bucket_bytes)
        completed = True
    finally:
        tracker.finish(completed)


def _patches(tracker: Tracker, items: Callable[[], Items], stream: Stream, make_patch: Callable[..., Any],
             bucket_bytes: int) -> Iterator[Any]:
    plan = tracker.plan
    error: BaseException | None = None
    diffs: dict[tuple[str, int], _Diff] = {}
    try:
        diffs = tracker.diff(items(), patch=True)
        _refuse_unpatchable(diffs)
    except Exception as e:  # noqa: BLE001 - agreed just below, on every rank
        error = e
    counts: dict[str, int] = {}
    for (name, _), d in diffs.items():
        if d.sel.numel():
            counts[name] = counts.get(name, 0) + int(d.sel.numel())
    views: list[PatchCounts] = all_gather_object(PatchCounts(error=error_payload(error), counts=counts))
    raise_lowest([v.error for v in views], error)
    status = Status("weight_source.iter_patches")
    try:
        for kind, names in _segments(plan, tracker, views):
            if kind == "gathered":
                status.agree()  # a boundary every rank passes before the gathered names' own gather
                yield from _gathered(tracker, names, stream, make_patch)
            else:
                for bucket in _buckets(names, views, tracker, bucket_bytes):
                    yield from _local_bucket(tracker, bucket, views, diffs, make_patch, status)
        status.agree()
    finally:
        status.waiter.close()


def _refuse_unpatchable(diffs: dict[tuple[str, int], _Diff]) -> None:
    """NaN values or integer tensors among the positions to send: one error naming each tensor."""
    nans: dict[str, int] = {}
    integers: list[str] = []
    for (name, _), d in diffs.items():
        if d.nan:
            nans[name] = nans.get(name, 0) + d.nan
        if d.integer and d.sel.numel() and name not in integers:
            integers.append(name)
    problems = [f"{name!r}: {n} changed element{'s' if n > 1 else ''} NaN now" for name, n in nans.items()]
    problems += [f"{name!r}: an integer tensor changed (a patch needs a floating dtype)" for name in integers]
    if problems:
        raise ValueError("weight_source.iter_patches: cannot patch what vLLM's receiver reads as 'unchanged' "
                         "(NaN marks an unchanged element there) or cannot mark: " + "; ".join(problems)
                         + "; fix the weights, or resync with iter_full")


def _segments(plan: Plan, tracker: Tracker, views: list[PatchCounts]) -> list[tuple[str, list[str]]]:
    """The Hub names to patch in metadata order, as runs of local names (with changes somewhere)
    and runs of gathered names."""
    total: dict[str, int] = {}
    for v in views:
        for name, n in v.counts.items():
            total[name] = total.get(name, 0) + n
    out: list[tuple[str, list[str]]] = []
    for name, _, _ in plan.hub:
        kind = "gathered" if name in tracker.gathered else "local"
        if kind == "local" and not total.get(name):
            continue
        if not out or out[-1][0] != kind:
            out.append((kind, []))
        out[-1][1].append(name)
    return out


def _buckets(names: list[str], views: list[PatchCounts], tracker: Tracker, bucket_bytes: int) -> list[list[str]]:
    """Consecutive names of at most ``bucket_bytes`` of patches (a larger one alone)."""
    dtypes = {name: dtype for name, dtype, _ in tracker.plan.hub}
    out: list[list[str]] = []
    size = 0
    for name in names:
        n = sum(patch_bytes(v.counts.get(name, 0), dtypes[name]) for v in views)
        if not out or (out[-1] and size + n > bucket_bytes):
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def _local_bucket(tracker: Tracker, names: list[str], views: list[PatchCounts],
                  diffs: dict[tuple[str, int], _Diff], make_patch: Callable[..., Any], status: Status) -> Iterator[Any]:
    """One bucket of names compared on their holders: every holder's changes to every owner (one
    batch, receives first), then the owner's patches, in metadata order."""
    plan = tracker.plan
    shapes = {name: shape for name, _, shape in plan.hub}
    dtypes = {name: dtype for name, dtype, _ in plan.hub}
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    posts: list[Post] = []
    recvs: list[tuple[int, list[str], torch.Tensor]] = []
    if status.error is None:
        try:  # in a function of its own: nothing of it stays referenced while the patches are yielded
            _prepare_bucket(tracker, names, views, diffs, posts, recvs, parts)
        except Exception as e:  # noqa: BLE001 - agreed just below
            status.fail(e, "preparing a bucket of patches")
    status.agree()
    flight = InFlight(status.waiter)
    try:
        with comm_errors(status.what):
            refused = flight.post_all(posts)
            flight.wait()
    finally:
        flight.drain_quietly()
    status.fail_post(refused)
    del flight  # and what it posted
    try:
        _received_parts(recvs, views, dtypes, parts)
        posts.clear()
        recvs.clear()  # the received buffers live on in their views only: each freed with its last
    except Exception as e:  # noqa: BLE001 - agreed at the next agreement
        status.fail(e, "assembling patches")
    for n in names:  # one patch assembled at a time, on the owner: never a bucket of merged copies
        if status.error is not None:
            return  # raised at the next agreement, on every rank
        if n not in parts:
            continue
        try:
            idx, vals = merge_parts(parts.pop(n))
            patch = make_patch(n, idx, vals, tuple(shapes[n]))
            del idx, vals
        except Exception as e:  # noqa: BLE001 - agreed at the next agreement
            status.fail(e, "assembling patches")
            return
        try:
            yield patch
        except GeneratorExit:  # the consumer left: still the next agreement, then out
            status.abandon()
            raise
        except Exception as e:  # noqa: BLE001 - the caller's .throw(e): agreed at the next agreement
            status.fail(e, "the caller's code failed")
            return
        del patch


def _prepare_bucket(tracker: Tracker, names: list[str], views: list[PatchCounts],
                    diffs: dict[tuple[str, int], _Diff], posts: list[Post],
                    recvs: list[tuple[int, list[str], torch.Tensor]],
                    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """This rank's side of one bucket: its changes packed for each owner (``posts``), a buffer per
    holder that sends to it (``posts`` and ``recvs``), its own changes to the names it owns
    (``parts``)."""
    plan, rank = tracker.plan, tracker.rank
    shapes = {name: shape for name, _, shape in plan.hub}
    dtypes = {name: dtype for name, dtype, _ in plan.hub}
    device = comm_device() if len(views) > 1 else torch.device("cpu")
    direct = _direct_names(tracker, names, views) if device.type == "cpu" else {}
    mine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in names:
        for p in tracker.mine.get(name, []):
            d = diffs.get((name, p.item))
            if d is not None and d.sel.numel():
                mine[name] = (hub_flat(d.sel, p.box, shapes[name]), tracker.values((name, p.item), d.sel))
    whole: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # a direct name's patch, received in place
    for n, order in direct.items():
        if rank in tracker.owners[n]:
            total = sum(c for _, c in order)
            whole[n] = (torch.empty(total, dtype=torch.int32), torch.empty(total, dtype=dtypes[n]))
            parts[n] = [whole[n]]
    for peer in range(len(views)):
        if peer == rank:
            continue
        out = [n for n in names if n in mine and peer in tracker.owners[n] and n not in direct]
        if out:
            buf = torch.empty(sum(patch_bytes(views[rank].counts[n], dtypes[n]) for n in out),
                              dtype=torch.uint8, device=device)
            off = 0
            for n in out:
                off = pack(buf, off, mine[n][0])
                off = pack(buf, off, mine[n][1])
            posts.append(Post(False, peer, buf))
        inc = [n for n in names if views[peer].counts.get(n) and rank in tracker.owners[n] and n not in direct]
        if inc:
            buf = torch.empty(sum(patch_bytes(views[peer].counts[n], dtypes[n]) for n in inc),
                              dtype=torch.uint8, device=device)
            posts.append(Post(True, peer, buf))
            recvs.append((peer, inc, buf))
        for n, order in direct.items():  # after the packed message, in name order, on both ends
            if n in mine and peer in tracker.owners[n]:
                posts += [Post(False, peer, mine[n][0]), Post(False, peer, mine[n][1])]
            if n in whole:
                at = _offsets(order)
                if peer in at:
                    o, c = at[peer]
                    posts += [Post(True, peer, whole[n][0][o:o + c]), Post(True, peer, whole[n][1][o:o + c])]
    for n, part in mine.items():
        if n in whole:
            at = _offsets(direct[n])
            o, c = at[rank]
            whole[n][0][o:o + c].copy_(part[0])
            whole[n][1][o:o + c].copy_(part[1])
        elif rank in tracker.owners[n]:
            parts.setdefault(n, []).append(part)


def _direct_names(tracker: Tracker, names: list[str], views: list[PatchCounts]) -> dict[str, list[tuple[int, int]]]:
    """The names of a bucket whose holders' changes travel as messages of their own, received in
    place into the patch's two tensors (no buffer, no merging copy): those of at least
    ``DIRECT_MIN_BYTES`` of changes whose holders each keep one run of whole rows (FSDP's
    ``Shard(0)``, an expert's matrices), so their parts in the holders' row order are already
    ascending. Each such name -> ``(holder, count)`` of the holders with changes, in that order.
    Every rank derives the same from the agreed plan and counts."""
    shapes = {name: shape for name, _, shape in tracker.plan.hub}
    dtypes = {name: dtype for name, dtype, _ in tracker.plan.hub}
    out: dict[str, list[tuple[int, int]]] = {}
    for n in names:
        counts = [(p, views[p.sender].counts.get(n, 0)) for p in tracker.parts.get(n, [])]
        total = sum(c for _, c in counts)
        if total == 0 or patch_bytes(total, dtypes[n]) < DIRECT_MIN_BYTES:
            continue
        senders = [p.sender for p, _ in counts]
        if len(set(senders)) != len(senders) or not all(_whole_rows(p.box, shapes[n]) for p, _ in counts):
            continue
        out[n] = [(p.sender, c) for p, c in sorted(counts, key=lambda pc: pc[0].box[0].start) if c]
    return out


def _whole_rows(box: Box, shape: tuple[int, ...]) -> bool:
    """Whether ``box`` is a run of whole rows of a tensor of ``shape`` (one slice of dim 0)."""
    return bool(box) and isinstance(box[0], slice) and all(
        isinstance(b, slice) and b.start == 0 and b.stop == n for b, n in zip(box[1:], shape[1:]))


def _offsets(order: list[tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Each holder's ``(offset, count)`` in a direct name's patch."""
    out, off = {}, 0
    for sender, c in order:
        out[sender] = (off, c)
        off += c
    return out


def _received_parts(recvs: list[tuple[int, list[str], torch.Tensor]], views: list[PatchCounts],
                    dtypes: dict[str, torch.dtype], parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """Each received buffer's ``(indices, values)`` per name into ``parts`` (views: nothing copied)."""
    for peer, inc, buf in recvs:
        off = 0
        for n in inc:
            c = views[peer].counts[n]
            idx, off = unpack(buf, off, (c,), torch.int32, torch.device("cpu"))
            vals, off = unpack(buf, off, (c,), dtypes[n], torch.device("cpu"))
            parts.setdefault(n, []).append((idx, vals))


def _gathered(tracker: Tracker, names: list[str], stream: Stream, make_patch: Callable[..., Any]) -> Iterator[Any]:
    """A run of gathered names: whole to their owners by the full pass's gather, compared there."""
    plan = tracker.plan
    wanted = set(names)
    keep = [i for i, k in enumerate(plan.keys) if wanted & set(plan.item_hub[k])]
    shapes = {name: shape for name, _, shape in plan.hub}
    gen = cast(Generator[list[tuple[str, torch.Tensor]], None, None], stream(keep, wanted))
    try:
        for bucket in gen:
            patches: list[Any] = []
            try:
                for name, t in bucket:
                    d = tracker.compare_full(name, t, True)
                    _refuse_unpatchable({(name, -1): d})
                    if d.sel.numel():
                        patches.append(make_patch(name, d.sel.clone(), t.reshape(-1)[d.sel],
                                                  tuple(shapes[name])))
            except Exception as e:  # noqa: BLE001 - agreed by the gather
                gen.throw(e)
            del bucket
            while patches:
                patch = patches.pop(0)
                try:
                    yield patch
                except Exception as e:  # noqa: BLE001 - the caller's .throw(e): agreed by the gather
                    gen.throw(e)
                del patch
    except GeneratorExit:  # the consumer left: the gather's next agreement names this rank
        gen.close()
        raise

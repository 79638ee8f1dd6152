"""The tensor-moving engine shared by model state, optimizer state and checkpoint files.

Two primitives over an ordered list of ``(fqn, target)`` pairs, where a target is a sharded
``DTensor`` (any mesh and placements DTensor produces, ``_StridedShard`` included), a plain tensor
(replicated: an unsharded submodule's parameter, a buffer) or an NF4 tensor (plain or inside a
DTensor). Targets may live on ``meta``: outputs are then allocated on the requested device.

* :func:`agree` + :func:`distribute`: full tensors -> this rank's shards. Metadata (keys, shapes,
  dtypes) is agreed on every rank first with ONE object collective, so every error is raised on
  every rank. Then either each rank slices its own piece of a source it can read (no tensor moves;
  a source with ``get_slice`` is read shard-on-read), or rank 0 packs every rank's slices of a
  bucket of tensors into one flat byte buffer per rank and scatters it.
* :func:`collect`: local shards -> full CPU tensors on rank 0 only, bucket by bucket, with
  point-to-point sends of exactly the bytes each shard owner holds (one replica per HSDP group).

All placement math comes from DTensor (``_get_shard_size_and_offsets``, the function behind
``compute_local_shape_and_global_offset``); only NF4 uses torchao's own dim-0 split. Everything runs
on the default process group. See ``docs/state_dict.md``.

Failure protocol (``docs/failure_model.md``): a failure on any rank, in any phase, becomes the same
exception on every rank. The metadata agreement carries each rank's local error; after it every
bucket has exactly one status agreement (one ``all_reduce`` of three int64s: the lowest failing
rank, and a checksum of the replicated tensors read since the last agreement), placed before any
byte of that bucket moves, plus one after the last bucket. A rank that fails (a read, a pack, an
unpack, the caller's code thrown in with ``generator.throw``) stops working and goes to the next
agreement, where every rank raises the lowest failing rank's error (one object all-gather of the
messages, only then). Without ``src_rank0`` no tensor moves and the agreement is the data phase's
only collective: it runs once per ``_LOCAL_AGREE_BUCKETS`` buckets. Outputs are yielded only after their bucket's agreement, and the final
agreement runs before the generator ends, so a caller that assigns after the loop never assigns
on one rank what another rank failed to load.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard

from fsdptk import nf4 as _nf4
from fsdptk.runtime import (
    _comm_device,
    all_gather_object,
    comm_errors,
    error_payload,
    raise_lowest,
)
from fsdptk.runtime import get_world_size_and_rank as _world

__all__ = ["agree", "distribute", "collect", "LoadPlan", "TensorMeta", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024  # small enough that packing overlaps sending
# without src_rank0 no tensor moves, so the status agreement is the only collective of the data
# phase: it runs once per this many buckets (16 MiB buckets: every 256 MiB of full tensors)
_LOCAL_AGREE_BUCKETS = 16
_ALIGN = 16  # byte alignment of every piece inside a flat buffer (any dtype can be viewed)

# A box is one rank's piece of a full tensor: per dim either a ``slice(start, stop)`` or a tuple of
# indices (only _StridedShard produces non-contiguous index sets).
Box = tuple[Any, ...]


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a source tensor, as agreed on every rank."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _Entry:
    fqn: str
    target: torch.Tensor
    kind: str  # "dtensor" | "plain" | "nf4" | "dnf4"
    shape: tuple[int, ...]
    local: Any  # Box for dtensor/plain; NF4 chunk path [(num, index), ...] for nf4/dnf4
    parts: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)


@dataclass
class LoadPlan:
    """The agreed metadata of one load, returned by :func:`agree` and consumed by :func:`distribute`.

    Attributes:
        keys: fqns present in both targets and source, in target order (what ``distribute`` yields).
        missing: target fqns absent from the source.
        unexpected: source keys that are not targets (rank 0's source when ``src_rank0``).
        metas: fqn -> :class:`TensorMeta` of the source tensor, for every key in ``keys``.
        src_rank0: whether only rank 0 reads the source.
        cast: whether outputs take the target dtype (else the source dtype).
    """

    keys: list[str]
    missing: list[str]
    unexpected: list[str]
    metas: dict[str, TensorMeta]
    src_rank0: bool
    cast: bool
    _entries: list[_Entry]
    _layouts: list[list[Any]] | None = None  # per rank: per entry (local, parts); src_rank0 only


# ---------------------------------------------------------------------------------------------
# process group and placement helpers


def _kind(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return "dnf4" if _nf4.is_nf4(t._local_tensor) else "dtensor"
    return "nf4" if _nf4.is_nf4(t) else "plain"


def _dtensor_box(t: DTensor) -> Box:
    """This rank's box of ``t`` from DTensor's own placement math (Shard, _StridedShard, Replicate)."""
    mesh, shape = t.device_mesh, tuple(t.shape)
    coord = mesh.get_coordinate()
    if coord is None:
        return tuple(slice(0, 0) for _ in shape)
    offsets: dict[int, torch.Tensor] = {}
    local = list(shape)
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, (Shard, _StridedShard)):
            raise ValueError(f"unsupported placement {p} (mesh dim {mesh_dim}) for a full<->shard move")
        d = p.dim + len(shape) if p.dim < 0 else p.dim
        size, idx = _get_shard_size_and_offsets(
            local[d], mesh.size(mesh_dim), coord[mesh_dim], p, offsets.get(d), shape[d], False
        )
        local[d] = size
        offsets[d] = idx if size else torch.empty(0, dtype=torch.long)
    box: list[Any] = []
    for d, n in enumerate(shape):
        idx = offsets.get(d)
        if idx is None:
            box.append(slice(0, n))
        elif idx.numel() == 0:
            box.append(slice(0, 0))
        elif bool((idx == torch.arange(int(idx[0]), int(idx[0]) + idx.numel())).all()):
            box.append(slice(int(idx[0]), int(idx[0]) + idx.numel()))
        else:
            box.append(tuple(int(i) for i in idx.tolist()))
    return tuple(box)


def _is_sender(t: DTensor) -> bool:
    """One replica sends: coordinate 0 on every Replicate mesh dim."""
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, t.placements) if isinstance(p, Replicate))


def _nf4_path(t: DTensor) -> list[tuple[int, int]]:
    coord = t.device_mesh.get_coordinate() or [0] * t.device_mesh.ndim
    path = []
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is not Shard or p.dim != 0:
            raise ValueError(f"NF4 tensors support only Shard(0) and Replicate placements, got {p}")
        path.append((t.device_mesh.size(mesh_dim), coord[mesh_dim]))
    return path



def _full_box(shape: Sequence[int]) -> Box:
    return tuple(slice(0, n) for n in shape)


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b.stop - b.start if isinstance(b, slice) else len(b) for b in box)


def _extract(full: Any, box: Box) -> Any:
    """``full``'s piece at ``box``; ``full`` is a tensor or a safetensors-style slice object.

    Only the covering range is read from a slice object (shard-on-read); strided dims are then
    picked with ``index_select``.
    """
    slices = tuple(b if isinstance(b, slice) else slice(min(b), max(b) + 1) for b in box)
    piece = full[slices] if slices else full[...]
    for d, b in enumerate(box):
        if not isinstance(b, slice):
            piece = piece.index_select(d, torch.tensor(b, dtype=torch.long) - min(b))
    return piece


def _place(full: torch.Tensor, box: Box, piece: torch.Tensor) -> None:
    """Write ``piece`` into ``full`` at ``box`` (the inverse of :func:`_extract`)."""
    dims = [d for d, b in enumerate(box) if not isinstance(b, slice)]
    view = full[tuple(b if isinstance(b, slice) else slice(None) for b in box)]
    if not dims:
        view.copy_(piece)
    elif len(dims) == 1:
        view.index_copy_(dims[0], torch.tensor(box[dims[0]], dtype=torch.long), piece)
    else:  # several strided dims (not produced by FSDP2 + TP, kept for completeness): peel one
        d = dims[0]
        rest = tuple(slice(0, view.shape[i]) if i == d else b for i, b in enumerate(box))
        for j, g in enumerate(box[d]):
            sub = tuple(b for i, b in enumerate(rest) if i != d)
            _place(view.select(d, g), sub, piece.select(d, j))


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _pack(buf: torch.Tensor, off: int, t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    if n:
        buf[off : off + n].view(t.dtype).view(t.shape).copy_(t)
    return off + _aligned(n)


def _unpack(buf: torch.Tensor, off: int, shape: Sequence[int], dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, int]:
    n = _nbytes(shape, dtype)
    if n == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=device), off
    t = buf[off : off + n].view(dtype).view(tuple(shape))
    if t.device != device:
        t = t.to(device)
    return t, off + _aligned(n)


def _buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Greedy consecutive buckets of indices; a tensor larger than a bucket travels alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if cur and total + n > bucket_bytes:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        out.append(cur)
    return out


def _fingerprint(rows: Iterable[tuple[Any, ...]]) -> str:
    return hashlib.sha1(repr(list(rows)).encode()).hexdigest()


def _release(source: Any, key: str) -> None:
    if hasattr(source, "__delitem__"):
        try:
            del source[key]
        except (KeyError, TypeError, NotImplementedError):
            pass


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _raise(problems: list[tuple[str, str]], what: str) -> None:
    if not problems:
        return
    lines = [m for _, m in problems]
    shown = "\n  - ".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
    cls = TypeError if all(k == "TypeError" for k, _ in problems) else ValueError
    raise cls(f"{what}: {len(lines)} problem(s):\n  - {shown}")


# ---------------------------------------------------------------------------------------------
# agree


def _entry(fqn: str, t: Any) -> _Entry:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"target {fqn!r} is a {type(t).__name__}, not a tensor")
    kind = _kind(t)
    shape = tuple(t.shape)
    if kind == "dtensor":
        return _Entry(fqn, t, kind, shape, _dtensor_box(t))
    if kind == "plain":
        return _Entry(fqn, t, kind, shape, _full_box(shape))
    like = t._local_tensor if kind == "dnf4" else t
    parts = [(tuple(p.shape), p.dtype) for p in _nf4.inner_tensors(like)]
    return _Entry(fqn, t, kind, shape, _nf4_path(t) if kind == "dnf4" else [], parts)


def _source_meta(source: Mapping[str, Any], key: str) -> TensorMeta | tuple[str, str]:
    getter = getattr(source, "get_slice", None)
    if callable(getter):
        sl = getter(key)
        dtype = sl.get_dtype()
        dtype = _ST_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if not isinstance(dtype, torch.dtype):
            return ("TypeError", f"{key!r}: unknown dtype {sl.get_dtype()!r} in the source")
        return TensorMeta(tuple(int(s) for s in sl.get_shape()), dtype)
    value = source[key]
    if isinstance(value, DTensor):
        return ("TypeError", f"{key!r}: the source holds a DTensor; expected a full (plain) tensor")
    if not isinstance(value, torch.Tensor):
        return ("TypeError", f"{key!r}: expected a tensor, got {type(value).__name__} ({value!r:.60})")
    return TensorMeta(tuple(value.shape), value.dtype)


def _check_source(entries: list[_Entry], source: Mapping[str, Any], cast: bool) -> tuple[Any, ...]:
    """Validate the source against the targets locally: (problems, missing, unexpected, metas)."""
    problems: list[tuple[str, str]] = []
    names = {e.fqn for e in entries}
    unexpected = [k for k in source.keys() if k not in names]
    missing: list[str] = []
    metas: dict[str, TensorMeta] = {}
    for e in entries:
        if e.fqn not in source:
            missing.append(e.fqn)
            continue
        meta = _source_meta(source, e.fqn)
        if not isinstance(meta, TensorMeta):
            problems.append(meta)
            continue
        metas[e.fqn] = meta
        if meta.shape != e.shape:
            problems.append(("ValueError", f"{e.fqn!r}: shape mismatch: the source has "
                             f"{list(meta.shape)}, the model has {list(e.shape)}"))
        src_float = meta.dtype.is_floating_point or meta.dtype.is_complex
        tgt_float = e.target.dtype.is_floating_point or e.target.dtype.is_complex
        if (cast or e.kind in ("nf4", "dnf4")) and src_float and not tgt_float:
            problems.append(("ValueError", f"{e.fqn!r}: dtype mismatch: cannot load the source's "
                             f"{meta.dtype} into the model's {e.target.dtype}"))
    return problems, missing, unexpected, metas


def agree(
    targets: Sequence[tuple[str, torch.Tensor]],
    source: Mapping[str, Any],
    *,
    src_rank0: bool = False,
    cast: bool = True,
) -> LoadPlan:
    """Agree on every rank which keys move, with which shapes and dtypes, before any tensor moves.

    One object collective (``all_gather_object``) carries each rank's view: the fingerprint of its
    targets, its verdict on the source (or only rank 0's when ``src_rank0``) and, when ``src_rank0``,
    its shard layout, so rank 0 can pack exactly each rank's bytes later.

    Args:
        targets: ordered ``(fqn, target)`` pairs, the same on every rank. A target is a DTensor
            (any mesh/placements; the local tensor may be on ``meta``), a plain tensor (replicated),
            an ``NF4Tensor`` or a DTensor wrapping one.
        source: full tensors by fqn: a dict or any Mapping (lazy ones too; one with
            ``get_slice(key)`` returning a safetensors-style slice is read via its metadata and, in
            :func:`distribute`, shard-on-read). Only rank 0's is read when ``src_rank0``.
        src_rank0: only rank 0 holds the source (others may pass ``{}``).
        cast: outputs take the target's dtype (a floating source into an integer target is an
            error); ``False`` keeps the source dtype (no dtype check).

    Returns:
        LoadPlan: ``keys`` (in target order), ``missing``, ``unexpected``, ``metas``.

    Raises:
        ValueError: on every rank, listing each shape mismatch (key and both shapes), each float
            into integer target (key and both dtypes), targets or sources that differ between ranks.
        TypeError: on every rank, when the only problems are non-tensor values (key and type).

    Example:
        >>> import torch
        >>> from fsdptk._engine import agree
        >>> plan = agree([("w", torch.empty(2, 3, device="meta"))], {"w": torch.ones(2, 3), "x": torch.ones(1)})
        >>> plan.keys, plan.missing, plan.unexpected
        (['w'], [], ['x'])
    """
    world, rank = _world()
    entries: list[_Entry] = []
    fp, check, layout, error = None, None, None, None
    try:  # local work: a failure here (a lazy source raising, a bad target) is agreed below
        entries = [_entry(fqn, t) for fqn, t in targets]
        seen: set[str] = set()
        dupes = [e.fqn for e in entries if e.fqn in seen or seen.add(e.fqn)]  # type: ignore[func-returns-value]
        if dupes:
            raise ValueError(f"duplicate target fqns: {dupes}")
        fp = _fingerprint((e.fqn, e.shape, str(e.target.dtype), e.kind) for e in entries)
        reads = rank == 0 or not src_rank0
        check = _check_source(entries, source, cast) if reads else None
        layout = [(e.local, e.parts) for e in entries] if src_rank0 and world > 1 else None
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = e
    payloads = all_gather_object((fp, check, layout, error_payload(error)))
    raise_lowest([p[3] for p in payloads], error)
    diff = [r for r, p in enumerate(payloads) if p[0] != payloads[0][0]]
    if diff:
        raise ValueError(f"the targets (fqns, shapes, dtypes) differ between rank 0 and ranks {diff}")
    if src_rank0:
        problems, missing, unexpected, metas = payloads[0][1]
    else:
        problems = []
        for r, p in enumerate(payloads):
            tag = "" if world == 1 else f"rank {r}: "
            problems += [(k, tag + m) for k, m in p[1][0]]
        problems = list(dict.fromkeys(problems))
        _, missing, unexpected, metas = payloads[0][1]
        if not problems:
            diff = [r for r, p in enumerate(payloads) if p[1][1:] != payloads[0][1][1:]]
            if diff:
                problems.append(("ValueError", f"the sources differ (keys, shapes or dtypes) between "
                                 f"rank 0 and ranks {diff}; pass src_rank0=True to read rank 0's only"))
    _raise(problems, "cannot load the state")
    keep = [e for e in entries if e.fqn in metas]
    layouts = None
    if src_rank0 and world > 1:
        index = {e.fqn: i for i, e in enumerate(entries)}
        layouts = [[p[2][index[e.fqn]] for e in keep] for p in payloads]
    return LoadPlan([e.fqn for e in keep], missing, unexpected, metas, src_rank0, cast, keep, layouts)


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


class _Status:
    """One rank's side of the status agreements of one engine call.

    ``error`` is this rank's first failure (its own, or the caller's thrown in with
    ``generator.throw``); ``sums`` the checksums of the replicated (non-DTensor) tensors this rank
    read since the last agreement, kept only when every rank reads its own source.
    """

    def __init__(self, what: str, check_replicas: bool = False) -> None:
        self.what = what
        self.error: BaseException | None = None
        self.check_replicas = check_replicas
        self.sums: list[tuple[str, int]] = []

    def fail(self, error: BaseException, context: str | None = None) -> None:
        """Record ``error`` (the first one only); ``context`` (e.g. the key) becomes a note."""
        if self.error is None:
            if context:
                error.add_note(f"fsdptk {self.what}: {context} on rank {_world()[1]}")
            self.error = error

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
                         device=_comm_device())
        with comm_errors(self.what):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
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


def _hand_over(items: Iterable[Any], status: _Status) -> Iterator[Any]:
    """Yield ``items`` to the caller; an exception thrown in (``generator.throw``) is recorded."""
    for item in items:
        try:
            yield item
        except Exception as e:  # noqa: BLE001 - the caller's failure, agreed at the next boundary
            status.fail(e, "the caller's code failed")
            return


def _guarded(body: Iterator[Any], status: _Status) -> Iterator[Any]:
    """Run an engine generator ``body`` so that a caller who abandons it still agrees."""
    try:
        yield from body
    except GeneratorExit:
        status.abandon()
        raise


# ---------------------------------------------------------------------------------------------
# distribute


def _out_dtype(plan: LoadPlan, e: _Entry) -> torch.dtype:
    if plan.cast or e.kind in ("nf4", "dnf4"):
        return e.target.dtype
    return plan.metas[e.fqn].dtype


def _wrap(e: _Entry, local: torch.Tensor) -> torch.Tensor:
    if e.kind in ("dtensor", "dnf4"):
        # not DTensor.from_local: it moves a CPU local to the mesh's device type, so a CPU-offload
        # load (local on CPU, mesh on cuda) would land on the GPU, and FSDP2 then copies it back
        # into pinned memory, leaving a DTensor whose .device (cuda) disagrees with its local
        # tensor (cpu). Built directly (as FSDP2 and torchtune's `.cpu()` do), the DTensor is
        # where its local tensor is.
        spec = e.target._spec
        spec = replace(spec, tensor_meta=spec.tensor_meta._replace(dtype=local.dtype))
        return DTensor(local, spec, requires_grad=local.requires_grad)  # type: ignore[call-arg]
    return local


def _nf4_like(e: _Entry) -> torch.Tensor:
    return e.target._local_tensor if e.kind == "dnf4" else e.target


def _local_piece(plan: LoadPlan, e: _Entry, source: Mapping[str, Any], device: torch.device,
                 release: bool) -> torch.Tensor:
    dtype = _out_dtype(plan, e)
    if e.kind == "dtensor":
        getter = getattr(source, "get_slice", None)
        raw = _extract(getter(e.fqn) if callable(getter) else source[e.fqn], e.local)
        return torch.empty(raw.shape, dtype=dtype, device=device).copy_(raw)
    full = source[e.fqn]
    if e.kind == "plain":
        if release and full.dtype == dtype and full.device == device and full.is_contiguous():
            return full.detach()  # the caller gave the entry up: no copy
        return torch.empty(full.shape, dtype=dtype, device=device).copy_(full)
    q = _nf4.quantize_like(full.to(device), _nf4_like(e))
    return _nf4.chunk(q, e.local)


def distribute(
    plan: LoadPlan,
    source: Mapping[str, Any],
    *,
    device: torch.device | str,
    release: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn full tensors into this rank's shards, yielding ``(fqn, value)`` in ``plan.keys`` order.

    ``value`` is of the target's kind: a DTensor with the target's mesh and placements (local shard
    on ``device``), a plain full tensor on ``device``, an ``NF4Tensor``, or a DTensor wrapping this
    rank's NF4 chunk (the FULL tensor is quantised with the target's block sizes, then chunked).

    Without ``src_rank0`` each rank slices its own piece of the source it can read: no tensor
    moves; a source with ``get_slice`` is read shard-on-read (only the local box). With
    ``src_rank0`` rank 0 reads one tensor at a time, packs each rank's bytes of a bucket into one
    flat buffer per rank and scatters. Either way every rank must exhaust the generator (it runs
    collectives): the status of every bucket is agreed before its bytes move (see the module
    docstring), so a failure on any rank raises the same error on every rank, and a value is
    yielded only once every rank has read its bucket. If the caller's own code fails on one rank
    while consuming, ``generator.throw(exc)`` makes the other ranks raise ``exc`` too (a caller
    that just drops the generator still lets them raise, with a generic message).

    Replicated (non-DTensor) targets read by every rank from its own source (no ``src_rank0``)
    are compared across ranks by a checksum carried in the bucket agreements (no extra
    collective): different values raise a ValueError naming the keys instead of leaving the ranks
    silently different. With ``src_rank0`` they are rank 0's values on every rank.

    Args:
        plan: from :func:`agree` (same ``source`` and ``src_rank0``).
        source: the source passed to :func:`agree`.
        device: where the outputs are allocated (``meta`` targets are materialised here).
        release: drop each source entry (``del source[key]``, when the Mapping supports it) right
            after use, so the caller's memory shrinks as the load proceeds. This MUTATES ``source``.
        bucket_bytes: target size (full-tensor bytes) of one scatter; bounds rank 0's extra memory.
            Without ``src_rank0`` the status is agreed every 16 buckets (nothing is sent).

    Returns:
        Iterator[tuple[str, torch.Tensor]]: ``(fqn, value)`` pairs (plain tensors, not Parameters).

    Raises:
        ValueError: when torchao cannot quantise or split an NF4 tensor (names the shape), or
            replicated targets would differ between ranks (names the keys and ranks); on every rank.
        Exception: a read failing on any rank (the source raising, a file gone), on every rank:
            the lowest failing rank's error, named after that rank and the key it was reading.
        RuntimeError: the communication itself failed (a rank died), naming the operation.

    Example:
        >>> import torch
        >>> from fsdptk._engine import agree, distribute
        >>> src = {"w": torch.ones(2, 3)}
        >>> plan = agree([("w", torch.empty(2, 3, dtype=torch.bfloat16, device="meta"))], src)
        >>> [(k, v.dtype) for k, v in distribute(plan, src, device="cpu")]
        [('w', torch.bfloat16)]
    """
    device = torch.device(device)
    world, rank = _world()
    if plan.src_rank0 and world > 1:
        status = _Status("load (scatter from rank 0)")
        body = _distribute_scatter(plan, source, device, release, bucket_bytes, world, rank, status)
    else:
        status = _Status("load", check_replicas=world > 1 and not plan.src_rank0)
        body = _distribute_local(plan, source, device, release, bucket_bytes, status)
    yield from _guarded(body, status)


def _distribute_local(plan: LoadPlan, source: Mapping[str, Any], device: torch.device, release: bool,
                      bucket_bytes: int, status: _Status) -> Iterator[tuple[str, torch.Tensor]]:
    """Each rank slices its own pieces; no tensor moves, only the status is agreed per bucket."""
    entries = plan._entries
    sizes = [_nbytes(e.shape, _out_dtype(plan, e)) for e in entries]
    for bucket in _buckets(sizes, bucket_bytes * _LOCAL_AGREE_BUCKETS):
        out = []
        for i in bucket if status.error is None else ():
            e = entries[i]
            try:
                local = _local_piece(plan, e, source, device, release)
                if e.kind in ("plain", "nf4"):
                    status.replica(e.fqn, _nf4.inner_tensors(local) if e.kind == "nf4" else [local])
                if release:
                    _release(source, e.fqn)
            except Exception as exc:  # noqa: BLE001 - agreed just below
                status.fail(exc, f"reading {e.fqn!r}")
                break
            out.append((e.fqn, _wrap(e, local)))
        status.agree()
        yield from _hand_over(out, status)
        del out
    status.agree()


def _layout_parts(plan: LoadPlan, e: _Entry, layout: tuple[Any, Any]) -> list[tuple[Any, torch.dtype]]:
    local, parts = layout
    if e.kind in ("nf4", "dnf4"):
        return parts
    return [(_box_shape(local), _out_dtype(plan, e))]


def _rank0_pieces(plan: LoadPlan, i: int, source: Mapping[str, Any], world: int,
                  comm: torch.device) -> list[list[torch.Tensor]]:
    """Rank 0: read one full tensor and cut every rank's pieces out of it."""
    e = plan._entries[i]
    layouts = plan._layouts or []
    full = source[e.fqn]
    if e.kind in ("nf4", "dnf4"):
        q = _nf4.quantize_like(full.to(comm), _nf4_like(e))
        return [_nf4.inner_tensors(_nf4.chunk(q, layouts[r][i][0])) for r in range(world)]
    full = full.to(_out_dtype(plan, e))
    return [[_extract(full, layouts[r][i][0])] for r in range(world)]


def _distribute_scatter(plan: LoadPlan, source: Mapping[str, Any], device: torch.device, release: bool,
                        bucket_bytes: int, world: int, rank: int, status: _Status,
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0 sends each rank exactly its bytes of a bucket (one flat buffer per rank, point to
    point: a scatter without padding); rank 0's own pieces never touch a buffer. Everything that
    can fail (rank 0's reads and packing, the receive buffers) happens before the bucket's status
    agreement; a receiver's unpacking failure is agreed at the next one."""
    comm = _comm_device()
    entries = plan._entries
    layouts = plan._layouts or []
    parts = [[_layout_parts(plan, e, layouts[r][i]) for i, e in enumerate(entries)] for r in range(world)]
    full_sizes = [_nbytes(e.shape, _out_dtype(plan, e)) for e in entries]
    for bucket in _buckets(full_sizes, bucket_bytes):
        sizes = [sum(_aligned(_nbytes(s, d)) for i in bucket for s, d in parts[r][i]) for r in range(world)]
        bufs: dict[int, torch.Tensor] = {}
        out: list[tuple[str, torch.Tensor]] = []
        if status.error is None:
            try:
                if rank == 0:
                    bufs, out = _scatter_pack(plan, bucket, source, sizes, world, comm, device, release,
                                              status)
                elif sizes[rank]:
                    bufs = {rank: torch.empty(sizes[rank], dtype=torch.uint8, device=comm)}
            except Exception as exc:  # noqa: BLE001 - agreed just below
                status.fail(exc)
        status.agree()
        with comm_errors(status.what):
            if rank == 0:
                works = [dist.isend(buf, dst=r) for r, buf in bufs.items()]
                for w in works:
                    w.wait()
            elif sizes[rank]:
                dist.recv(bufs[rank], src=0)
        if rank != 0 and status.error is None:
            try:
                out = _scatter_unpack(plan, bucket, parts[rank], bufs.get(rank), device)
            except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
                status.fail(exc, f"unpacking a bucket of {[entries[i].fqn for i in bucket]}")
        del bufs
        yield from _hand_over(out, status)
        del out
    status.agree()


def _scatter_pack(plan: LoadPlan, bucket: list[int], source: Mapping[str, Any], sizes: list[int],
                  world: int, comm: torch.device, device: torch.device, release: bool, status: _Status,
                  ) -> tuple[dict[int, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """Rank 0: read a bucket, pack every other rank's bytes, keep its own pieces as outputs."""
    entries = plan._entries
    bufs = {r: torch.empty(sizes[r], dtype=torch.uint8, device=comm) for r in range(1, world) if sizes[r]}
    offs = dict.fromkeys(bufs, 0)
    out = []
    for i in bucket:
        e = entries[i]
        try:
            pieces = _rank0_pieces(plan, i, source, world, comm)
        except Exception as exc:
            status.fail(exc, f"reading {e.fqn!r}")
            raise
        if release:
            _release(source, e.fqn)
        own = [torch.empty(p.shape, dtype=p.dtype, device=device).copy_(p) for p in pieces[0]]
        out.append((e.fqn, _wrap(e, _assemble(e, own))))
        for r in bufs:
            for piece in pieces[r]:
                offs[r] = _pack(bufs[r], offs[r], piece)
        del pieces
    return bufs, out


def _scatter_unpack(plan: LoadPlan, bucket: list[int], parts: list[Any], buf: torch.Tensor | None,
                    device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """A receiver: its outputs of a bucket, viewed out of (or copied from) the received buffer."""
    out, off = [], 0
    for i in bucket:
        e = plan._entries[i]
        tensors = []
        for shape, dtype in parts[i]:
            t, off = _unpack(buf, off, shape, dtype, device)  # type: ignore[arg-type]
            tensors.append(t)
        out.append((e.fqn, _wrap(e, _assemble(e, tensors))))
    return out


def _assemble(e: _Entry, tensors: list[torch.Tensor]) -> torch.Tensor:
    return _nf4.from_inner_tensors(tensors, _nf4_like(e)) if e.kind in ("nf4", "dnf4") else tensors[0]


# ---------------------------------------------------------------------------------------------
# collect


def _collect_view(t: Any, rank: int) -> tuple[str, Box | None, str | None]:
    """(kind, this rank's box if it sends, problem) for one item."""
    if not isinstance(t, torch.Tensor):
        return "", None, f"expected a tensor, got {type(t).__name__}"
    kind = _kind(t)
    local = t._local_tensor if isinstance(t, DTensor) else t
    if local.is_meta:
        return kind, None, f"is on the meta device (shape {list(t.shape)}); load or initialise it first"
    if kind in ("dtensor", "dnf4"):
        if kind == "dnf4":
            _nf4_path(t)  # validates the placements
        return kind, (_dtensor_box(t) if _is_sender(t) else None), None
    return kind, (_full_box(t.shape) if rank == 0 else None), None


def _plain_local(t: torch.Tensor) -> torch.Tensor:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return _nf4.dequantize(local) if _nf4.is_nf4(local) else local.detach()


def collect(
    items: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Turn local shards into full CPU tensors on rank 0, one bucket at a time.

    Each shard owner (one replica per replicate group) sends exactly its bytes of a bucket as one
    flat buffer to rank 0 (point to point: a gather, never an all-gather; no barrier); plain
    tensors are taken from rank 0 with no communication. Rank 0 yields the bucket's full tensors
    (CPU, original dtype, NF4 dequantised, fresh memory not shared with the model); the other ranks
    yield ``[]`` per bucket. Memory beyond the shards: one bucket (rank 0: full tensors plus the
    received buffers; other ranks: their packed pieces). Consistency of the items is checked first
    with one object collective, so a mismatch is an error on every rank, not a hang; then the
    status of every bucket is agreed before its bytes move (see the module docstring): a failure
    on any rank raises the same error on every rank. A caller whose own code fails on one rank
    while consuming (a file write) calls ``generator.throw(exc)`` so the other ranks raise ``exc``.

    Args:
        items: ``(fqn, tensor)`` pairs in the same order on every rank: DTensors (any mesh,
            ``_StridedShard`` included), plain tensors, NF4 tensors or DTensors wrapping NF4.
        bucket_bytes: full-tensor bytes per bucket.

    Returns:
        Iterator[list[tuple[str, torch.Tensor]]]: buckets; every rank must exhaust the generator.

    Raises:
        ValueError: on every rank, when items differ between ranks or a tensor is on ``meta``.
        Exception: any rank's failure (reading a shard, the caller's thrown-in error), on every
            rank: the lowest failing rank's error, named after that rank.
        RuntimeError: the communication itself failed (a rank died), naming the operation.

    Example:
        >>> import torch
        >>> from fsdptk._engine import collect
        >>> [[(k, v.shape) for k, v in b] for b in collect([("w", torch.ones(2, 3))])]
        [[('w', torch.Size([2, 3]))]]
    """
    world, rank = _world()
    views: list[tuple[str, Box | None, str | None]] = []
    problems: list[tuple[str, str]] = []
    fp, error = None, None
    try:  # local work: a failure here is agreed below, with the metadata
        items = list(items)
        views = [_collect_view(t, rank) for _, t in items]
        problems = [("ValueError", f"{fqn!r} {p}") for (fqn, _), (_, _, p) in zip(items, views) if p]
        fp = _fingerprint((fqn, tuple(t.shape), str(t.dtype), v[0]) for (fqn, t), v in zip(items, views))
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = e
    payloads = all_gather_object((fp, [v[1] for v in views], problems, error_payload(error)))
    raise_lowest([p[3] for p in payloads], error)
    diff = [r for r, p in enumerate(payloads) if p[0] != payloads[0][0]]
    all_problems = [(k, (f"rank {r}: " if world > 1 else "") + m) for r, p in enumerate(payloads) for k, m in p[2]]
    if diff:
        all_problems.append(("ValueError", f"the items (fqns, shapes, dtypes) differ between rank 0 and ranks {diff}"))
    _raise(all_problems, "cannot gather the state")
    status = _Status("gather")
    yield from _guarded(_collect_buckets(items, [p[1] for p in payloads], bucket_bytes, status), status)  # type: ignore[arg-type]


def _collect_buckets(items: list[tuple[str, torch.Tensor]], boxes: list[list[Box | None]],
                     bucket_bytes: int, status: _Status) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The data phase of :func:`collect`: per bucket, pack, agree, then move the bytes."""
    world, rank = _world()
    comm = _comm_device() if world > 1 else torch.device("cpu")
    sizes = [_nbytes(t.shape, t.dtype) for _, t in items]
    for bucket in _buckets(sizes, bucket_bytes):
        bufs: dict[int, torch.Tensor] = {}
        fulls: dict[int, torch.Tensor] = {}
        if status.error is None:
            try:
                if rank == 0:
                    fulls = {i: torch.empty(tuple(items[i][1].shape), dtype=items[i][1].dtype) for i in bucket}
                    bufs = _collect_recv_buffers(items, bucket, boxes, world, comm)
                else:
                    bufs = _collect_pack(items, bucket, boxes[rank], comm, rank, status)
            except Exception as exc:  # noqa: BLE001 - agreed just below
                status.fail(exc)
        status.agree()
        if rank == 0:
            out = _collect_rank0(items, bucket, boxes, fulls, bufs, status)
            if status.error is None:
                yield from _hand_over([out], status)
            del out, fulls
            continue
        if bufs:
            with comm_errors(status.what):
                dist.send(bufs[rank], dst=0)
        del bufs
        yield from _hand_over([[]], status)
    status.agree()


def _collect_pack(items: list[tuple[str, torch.Tensor]], bucket: list[int], boxes: list[Box | None],
                  comm: torch.device, rank: int, status: _Status) -> dict[int, torch.Tensor]:
    """A sender: its bytes of a bucket in one flat buffer (``{}`` when it owns none of them)."""
    mine = [i for i in bucket if boxes[i] is not None]
    total = sum(_aligned(_nbytes(_box_shape(boxes[i]), items[i][1].dtype)) for i in mine)
    if total == 0:
        return {}
    buf = torch.empty(total, dtype=torch.uint8, device=comm)
    off = 0
    for i in mine:
        try:
            off = _pack(buf, off, _plain_local(items[i][1]))
        except Exception as exc:
            status.fail(exc, f"reading its shard of {items[i][0]!r}")
            raise
    return {rank: buf}


def _collect_recv_buffers(items: list[tuple[str, torch.Tensor]], bucket: list[int],
                          boxes: list[list[Box | None]], world: int, comm: torch.device,
                          ) -> dict[int, torch.Tensor]:
    bufs = {}
    for r in range(1, world):
        total = sum(_aligned(_nbytes(_box_shape(boxes[r][i]), items[i][1].dtype))
                    for i in bucket if boxes[r][i] is not None)
        if total:
            bufs[r] = torch.empty(total, dtype=torch.uint8, device=comm)
    return bufs


def _collect_rank0(items: list[tuple[str, torch.Tensor]], bucket: list[int], boxes: list[list[Box | None]],
                   fulls: dict[int, torch.Tensor], bufs: dict[int, torch.Tensor], status: _Status,
                   ) -> list[tuple[str, torch.Tensor]]:
    """Rank 0: receive a bucket into its buffers while placing its own pieces, then unpack.

    A failure while placing is recorded (agreed at the next boundary); the receives complete
    either way, so the other ranks' sends never wait."""
    with comm_errors(status.what):
        works = [dist.irecv(buf, src=r) for r, buf in bufs.items()]
    name = None
    try:
        for i in bucket:  # rank 0's own pieces while the others' bytes arrive
            if boxes[0][i] is not None:
                name = items[i][0]
                _place(fulls[i], boxes[0][i], _plain_local(items[i][1]).cpu())
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"reading its shard of {name!r}")
    with comm_errors(status.what):
        for w in works:
            w.wait()
    if status.error is not None:
        return []
    try:
        for r, buf in bufs.items():
            off = 0
            for i in bucket:
                if boxes[r][i] is not None:
                    name = items[i][0]
                    piece, off = _unpack(buf, off, _box_shape(boxes[r][i]), items[i][1].dtype,
                                         torch.device("cpu"))
                    _place(fulls[i], boxes[r][i], piece)
    except Exception as exc:  # noqa: BLE001 - agreed at the next boundary
        status.fail(exc, f"assembling {name!r}")
        return []
    return [(items[i][0], fulls[i]) for i in bucket]

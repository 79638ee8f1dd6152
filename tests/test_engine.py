"""fsdptk._engine: agree / distribute / collect against DTensor's own placement math."""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import pairwise
from types import MappingProxyType
from typing import NamedTuple

import torch
import torch.distributed as dist
from _compare import tensor_diffs
from _patching import wrapped_send_local
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptk.testing import RemoteError


def _placement(kind: str, dim: int):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if kind == "R":
        return Replicate()
    if kind == "S":
        return Shard(dim)
    return _StridedShard(dim, split_factor=2)


class _Recorder(dict):
    """A safetensors-style source: ``get_slice`` objects that record every box read."""

    def __init__(self, data):
        super().__init__(data)
        self.reads: list[tuple[str, int]] = []

    def get_slice(self, key):
        rec, full = self, dict.__getitem__(self, key)

        class _Slice:
            def get_shape(self):
                return list(full.shape)

            def get_dtype(self):
                return {torch.float32: "F32", torch.bfloat16: "BF16"}[full.dtype]

            def __getitem__(self, idx):
                out = full[idx]
                rec.reads.append((key, out.numel()))
                return out

        return _Slice()


def _covering_numel(box) -> int:
    n = 1
    for b in box:
        n *= (b.stop - b.start) if isinstance(b, slice) else (max(b) - min(b) + 1)
    return n


def _engine_case(cases, mode, bucket, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from fsdptk._engine import agree, collect, distribute
    from fsdptk._engine.layouts import dtensor_box as _dtensor_box

    mesh = init_device_mesh("cpu", (2, 2))
    gen = torch.Generator().manual_seed(seed)
    fulls, targets = {}, []
    for i, (shape, kinds, dtype) in enumerate(cases):
        full = torch.randn(shape, generator=gen).to(getattr(torch, dtype))
        pl = [_placement(k, d) for k, d in kinds]
        fulls[f"t{i}"] = full
        targets.append((f"t{i}", distribute_tensor(full, mesh, pl, src_data_rank=None)))
    rank = dist.get_rank()
    if mode == "rank0":
        src = dict(fulls) if rank == 0 else {}
    elif mode == "slices":
        src = _Recorder(fulls)
    else:
        src = dict(fulls)
    meta_targets = [(k, t.to("meta")) for k, t in targets]  # a model built on meta
    plan = agree(meta_targets, src, src_rank0=mode == "rank0")
    out = dict(distribute(plan, src, device="cpu", bucket_bytes=bucket, release=mode == "rank0"))
    local_diffs = tensor_diffs(out, dict(targets))
    # shard-on-read: only this rank's box (its covering range for _StridedShard) is read
    read_ok = mode != "slices" or sum(n for _, n in src.reads) == sum(
        _covering_numel(_dtensor_box(t)) for _, t in targets)
    got = {}
    for b in collect(list(out.items()), bucket_bytes=bucket):
        got.update(b)
    full_diffs = tensor_diffs(got, {} if rank else fulls)
    released = mode != "rank0" or src == {}
    return local_diffs, read_ok, full_diffs, released


_kind = st.sampled_from(["R", "S", "SS"])


@st.composite
def _tensor_case(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    kinds = []
    for _ in range(2):
        k = draw(_kind)
        kinds.append((k, draw(st.integers(0, ndim - 1))))
    if kinds[0][0] == "SS" and not (kinds[1][0] == "S" and kinds[1][1] == kinds[0][1]):
        kinds[0] = ("S", kinds[0][1])  # _StridedShard only as FSDP over TP on the same dim
    if kinds[1][0] == "SS":
        kinds[1] = ("S", kinds[1][1])
    return shape, kinds, draw(st.sampled_from(["float32", "bfloat16"]))


@settings(max_examples=15, deadline=None)
@given(cases=st.lists(_tensor_case(), min_size=1, max_size=4), mode=st.sampled_from(["local", "rank0", "slices"]),
       bucket=st.sampled_from([16, 300, 1 << 20]), seed=st.integers(0, 1000))
def test_distribute_collect_match_dtensor(world, cases, mode, bucket, seed):
    assert world(4).run(_engine_case, cases, mode, bucket, seed) == [([], True, [], True)] * 4


# ---------------------------------------------------------------------------------------------
# the wire: zero-copy pieces (sent from / received into their final memory) beside packed ones,
# pipelined two buckets deep


def _wire_case(cases, mesh_kind, mode, bucket, seed, direct_min, nf4, lazy=False):
    """Load then gather with pieces of at least ``direct_min`` bytes travelling alone; ``lazy``
    hides the dict behind a read-only Mapping (not assumed to hold its values, so buckets count
    the full tensors rank 0 reads) and gathers with ``retained`` (buckets count packed pieces).

    Returns, per rank: (locals exact, fulls exact, zero-copy evidence, packs done)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fsdptk._engine.gather as gather
    import fsdptk._engine.scatter as scatter
    import fsdptk._engine.wire as wire
    from fsdptk._engine import agree, collect, distribute
    from fsdptk.nf4 import dequantize, to_nf4

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2) if mesh_kind == "2d" else (4,))
    gen = torch.Generator().manual_seed(seed)
    fulls, targets, expect = {}, [], {}
    for i, (shape, kinds, dtype, target_dtype) in enumerate(cases):
        full = torch.randn(shape, generator=gen).to(getattr(torch, dtype))
        tgt = full.to(getattr(torch, target_dtype))  # a different target dtype: the load casts
        pl = [_placement(k, d) for k, d in kinds] if mesh_kind == "2d" else [_placement(kinds[0][0], kinds[0][1])]
        if pl[0].__class__.__name__ == "_StridedShard" and mesh_kind != "2d":
            pl = [Shard(kinds[0][1])]
        fulls[f"t{i}"], expect[f"t{i}"] = full, tgt
        targets.append((f"t{i}", distribute_tensor(tgt, mesh, pl, src_data_rank=None)))
    if nf4:  # a plain NF4 tensor: its inner tensors always travel packed (DTensor-wrapped NF4
        # under FSDP2 and HSDP goes through the same layouts: tests/test_nf4.py)
        w = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
        q = to_nf4(w, 64, 8)
        fulls["q"], expect["q"] = w, dequantize(q)
        targets.append(("q", q))
    src = (dict(fulls) if rank == 0 else {}) if mode == "rank0" else dict(fulls)
    if lazy:
        src = MappingProxyType(src)
    old, packs = wire.DIRECT_MIN_BYTES, [0]
    inner_s, inner_g = scatter.pack, gather.pack

    def counted(inner):
        def pack(*args):
            packs[0] += 1
            return inner(*args)
        return pack

    wire.DIRECT_MIN_BYTES = direct_min
    scatter.pack, gather.pack = counted(inner_s), counted(inner_g)
    try:
        plan = agree([(k, t.to("meta")) for k, t in targets], src, src_rank0=mode == "rank0")
        out = dict(distribute(plan, src, device="cpu", bucket_bytes=bucket))
        load_packs, packs[0] = packs[0], 0
        got = {}
        for b in collect(list(out.items()), bucket_bytes=bucket, retained=lazy):
            got.update(b)
        gather_packs = packs[0]
    finally:
        wire.DIRECT_MIN_BYTES = old
        scatter.pack, gather.pack = inner_s, inner_g

    from fsdptk._core.compat import local_tensor as _local  # (to_local drops the NF4 subclass)

    local_ok = True
    for k, t in targets:
        o = out[k]
        if k == "q":
            local_ok &= torch.equal(dequantize(_local(o)), dequantize(_local(t)))
        else:
            local_ok &= (torch.equal(_local(o), _local(t)) and o.dtype == t.dtype
                         and o.placements == t.placements)
    # a receiver's large piece is its own final tensor, not a view into a shared bucket buffer
    alone_ok = all(
        _local(o).untyped_storage().nbytes() == _local(o).numel() * _local(o).element_size()
        for k, o in out.items()
        if rank and mode == "rank0" and k != "q" and _local(o).numel()
        and _local(o).numel() * _local(o).element_size() >= direct_min)
    full_diffs = tensor_diffs(got, {} if rank else expect)
    return local_ok, full_diffs, alone_ok, load_packs, gather_packs


@st.composite
def _wire_tensor_case(draw):
    shape, kinds, dtype = draw(_tensor_case())
    target = draw(st.sampled_from([dtype, "float32", "bfloat16"]))
    return shape, kinds, dtype, target


@settings(max_examples=12, deadline=None)
@given(cases=st.lists(_wire_tensor_case(), min_size=1, max_size=4), mesh_kind=st.sampled_from(["2d", "1d"]),
       mode=st.sampled_from(["rank0", "local"]), bucket=st.sampled_from([1, 200, 1 << 20]),
       seed=st.integers(0, 1000), direct_min=st.sampled_from([1, 64, 1 << 30]), nf4=st.booleans(),
       lazy=st.booleans())
def test_zero_copy_and_packed_pieces_round_trip_exactly(world, cases, mesh_kind, mode, bucket, seed, direct_min, nf4,
                                                        lazy):
    """Uneven shards, _StridedShard, HSDP (Replicate x Shard), NF4, tiny buckets, casts, a dict
    source (buckets sized by the memory they add) or a lazy Mapping (by the full tensors read):
    every piece lands exactly, whether it travelled alone (zero-copy) or packed."""
    res = world(4).run(_wire_case, cases, mesh_kind, mode, bucket, seed, direct_min, nf4, lazy)
    assert [r[:3] for r in res] == [(True, [], True)] * 4, res


def _zero_copy_counts(direct_min):
    """A Shard(0) model on 4 ranks, rank-0 load then gather: how many pieces were packed."""
    return _wire_case([((64, 8), [("S", 0), ("R", 0)], "float32", "float32"),
                       ((33, 5), [("S", 0), ("R", 0)], "float32", "float32")],
                      "1d", "rank0", 1 << 20, 0, direct_min, False)


def test_dim0_shards_travel_without_pack_or_unpack(world):
    """Above the threshold a dim-0 shard is never packed (sent from a view of the full tensor,
    received into the final tensor, gathered straight into the full tensor); below it the pieces
    of a bucket are coalesced into one packed message per rank."""
    zero = world(4).run(_zero_copy_counts, 1)
    assert [r[:3] for r in zero] == [(True, [], True)] * 4, zero
    assert [r[3:] for r in zero] == [(0, 0)] * 4, zero  # no pack on any rank, either direction
    packed = world(4).run(_zero_copy_counts, 1 << 30)
    assert [r[:3] for r in packed] == [(True, [], True)] * 4, packed
    # rank 0 packs 2 pieces for each of 3 ranks; each sender packs its 2 pieces for the gather
    assert [r[3:] for r in packed] == [(6, 0), (0, 2), (0, 2), (0, 2)], packed


def _agreement_counts(lazy, retained):
    """2 ranks, 4 fp32 tensors of 64 x 1024 (256 KiB) as Shard(0), buckets of one tensor: the
    status agreements of a rank-0 load and of a gather, and whether the values round-trip."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fsdptk._engine.wire as wire
    from fsdptk._engine import agree, collect, distribute
    from fsdptk._engine.agree import Status

    mesh = init_device_mesh("cpu", (2,))
    fulls = {f"t{i}": torch.randn(64, 1024, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    targets = [(k, distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None).to("meta")) for k, v in fulls.items()]
    src = dict(fulls) if dist.get_rank() == 0 else {}
    calls, inner, old = [0], Status.agree, wire.DIRECT_MIN_BYTES

    def counted(self):
        calls[0] += 1
        return inner(self)

    Status.agree, wire.DIRECT_MIN_BYTES = counted, 1
    try:
        plan = agree(targets, MappingProxyType(src) if lazy else src, src_rank0=True)
        out = dict(distribute(plan, MappingProxyType(src) if lazy else src, device="cpu", bucket_bytes=256 << 10))
        load_calls, calls[0] = calls[0], 0
        got = {k: v for b in collect(list(out.items()), bucket_bytes=256 << 10, retained=retained) for k, v in b}
    finally:
        Status.agree, wire.DIRECT_MIN_BYTES = inner, old
    exact = all(torch.equal(got[k], v) for k, v in fulls.items()) if dist.get_rank() == 0 else got == {}
    return load_calls, calls[0], exact


def test_buckets_count_the_memory_they_add_not_the_bytes_they_move(world):
    """A dict already holds its tensors and dim-0 shards are sent from views of them into their
    final memory: the load adds no memory, so it is one bucket (agreed before it moves, after the
    wire, and at the end); a lazy Mapping's full tensors are read one bucket at a time. A gather
    whose caller keeps everything (``retained``) counts only packed pieces; a streaming one counts
    the full tensors rank 0 holds per bucket."""
    assert world(2).run(_agreement_counts, False, True) == [(3, 2, True)] * 2
    assert world(2).run(_agreement_counts, True, False) == [(6, 5, True)] * 2


def _own_copy_fails():
    """Rank 0 fails while copying its own piece of the 2nd tensor, after the bucket's sends
    were posted: every rank raises rank 0's error, nothing is yielded on rank 0 after it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fsdptk._engine.layouts as layouts
    from fsdptk._engine import agree, distribute

    mesh = init_device_mesh("cpu", (2,))
    fulls = {f"t{i}": torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)}
    targets = [(k, distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None).to("meta")) for k, v in fulls.items()]
    src = dict(fulls) if dist.get_rank() == 0 else {}
    inner, seen, calls = layouts.DTensorLayout.wrap, [], [0]

    def wrap(self, local):
        calls[0] += 1
        if dist.get_rank() == 0 and calls[0] == 2:
            raise MemoryError("no memory for the own piece")
        return inner(self, local)

    layouts.DTensorLayout.wrap = wrap
    try:
        for k, _ in distribute(agree(targets, src, src_rank0=True), src, device="cpu"):
            seen.append(k)
    except MemoryError as e:
        return type(e).__name__, "(on rank 0)" in str(e) or dist.get_rank() == 0, seen
    finally:
        layouts.DTensorLayout.wrap = inner
    return "no error", False, seen


def test_a_failure_copying_rank0s_own_piece_after_the_sends_is_raised_everywhere(world):
    res = world(2).run(_own_copy_fails, timeout=60)
    assert [r[:2] for r in res] == [("MemoryError", True)] * 2, res
    assert res[1][2] == [], res  # the receiver yields nothing of the failed bucket


def _differ():
    from fsdptk._engine import collect

    shape = (3,) if dist.get_rank() == 0 else (4,)
    list(collect([("w", torch.zeros(shape))]))


def test_collect_items_differ_is_an_error_on_every_rank(world):
    try:
        world(2).run(_differ)
    except RemoteError as e:
        assert all(isinstance(r, RemoteError) and "differ between rank 0 and ranks [1]" in r.message
                   for r in e.per_rank)
    else:
        raise AssertionError("expected an error")


def test_single_process_and_errors():
    from fsdptk._engine import agree, collect, distribute

    src = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.int32), "x": torch.ones(1)}
    targets = [("a", torch.empty(2, 3, dtype=torch.bfloat16, device="meta")),
               ("b", torch.empty(2, dtype=torch.int64, device="meta")), ("c", torch.empty(1))]
    plan = agree(targets, src)
    assert (plan.keys, plan.missing, plan.unexpected) == (["a", "b"], ["c"], ["x"])
    out = dict(distribute(plan, src, device="cpu", release=True))
    assert out["a"].dtype == torch.bfloat16 and out["b"].dtype == torch.int64
    assert torch.equal(out["a"].float(), torch.arange(6.0).reshape(2, 3)) and list(src) == ["x"]
    keep = agree(targets[:1], {"a": torch.ones(2, 3)}, cast=False)
    assert next(distribute(keep, {"a": torch.ones(2, 3)}, device="cpu"))[1].dtype == torch.float32
    assert [k for b in collect(out.items(), bucket_bytes=1) for k, _ in b] == ["a", "b"]
    bad = {"a": torch.ones(3, 2), "b": torch.ones(2)}
    try:
        agree(targets, bad)
    except ValueError as e:
        assert "'a': shape mismatch" in str(e) and "[3, 2]" in str(e) and "[2, 3]" in str(e)
        assert "'b'" in str(e) and "torch.float32" in str(e) and "torch.int64" in str(e)
    else:
        raise AssertionError("expected a ValueError")
    try:
        agree(targets, {"a": "not a tensor"})
    except TypeError as e:
        assert "'a'" in str(e) and "str" in str(e)
    else:
        raise AssertionError("expected a TypeError")


# ---------------------------------------------------------------------------------------------
# failure protocol: a failure anywhere is the same error on every rank (tests/test_failure_collective.py
# covers the public calls; these drive the engine directly over random failure points)


class _FailingSource(dict):
    """Full tensors whose ``fail_at``-th data read (1-based, after the metadata pass) raises on
    ``fail_rank``; with ``slices`` it is read shard-on-read."""

    def __init__(self, data, fail_rank, fail_at, slices):
        super().__init__(data)
        self.fail_rank, self.fail_at, self.reads, self.armed = fail_rank, fail_at, 0, False
        if slices:
            self.get_slice = self._slice

    def _hit(self, key):
        if self.armed:
            self.reads += 1
            if dist.get_rank() == self.fail_rank and self.reads == self.fail_at:
                raise OSError(f"cannot read {key}")

    def __getitem__(self, key):
        self._hit(key)
        return dict.__getitem__(self, key)

    def _slice(self, key):
        src, full = self, dict.__getitem__(self, key)

        class _S:
            def get_shape(self):
                return list(full.shape)

            def get_dtype(self):
                return "F32"

            def __getitem__(self, idx):
                src._hit(key)
                return full[idx]

        return _S()


def _fail_case(mode, phase, fail_rank, fail_at, bucket):
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fsdptk._engine as engine

    mesh = init_device_mesh("cpu", (2,))
    fulls = {f"t{i}": torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    fulls["plain"] = torch.ones(5)
    targets = [(k, distribute_tensor(v, mesh, [Shard(0)]) if k != "plain" else v.clone())
               for k, v in fulls.items()]
    dist.barrier()
    t0 = time.monotonic()
    try:
        if phase == "load":
            src = (_FailingSource(fulls, fail_rank, fail_at, mode == "slices")
                   if mode != "rank0" or dist.get_rank() == 0 else {})
            plan = engine.agree([(k, t.to("meta")) for k, t in targets], src, src_rank0=mode == "rank0")
            if isinstance(src, _FailingSource):
                src.armed = True  # from here on, reads are data reads
            dict(engine.distribute(plan, src, device="cpu", bucket_bytes=bucket))
        else:  # gather: a sender or the receiver fails, or the caller's code fails (throw)
            calls = [0]

            def flaky(inner):
                def read(layout):
                    calls[0] += 1
                    if phase == "gather" and dist.get_rank() == fail_rank and calls[0] == fail_at:
                        raise OSError("cannot read a shard")
                    return inner(layout)
                return read

            with wrapped_send_local(flaky):
                buckets = engine.collect(targets, bucket_bytes=bucket)
                for n, _ in enumerate(buckets, start=1):
                    if phase == "caller" and dist.get_rank() == fail_rank and n == fail_at:
                        buckets.throw(OSError("the caller's write failed"))
    except OSError as e:
        return "OSError", str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


@settings(max_examples=12, deadline=None)
@given(mode=st.sampled_from(["local", "rank0", "slices"]), phase=st.sampled_from(["load", "gather", "caller"]),
       fail_rank=st.integers(0, 1), fail_at=st.integers(1, 7), bucket=st.sampled_from([16, 100, 1 << 20]))
def test_any_failure_point_is_the_same_error_on_every_rank(world, mode, phase, fail_rank, fail_at, bucket):
    if phase == "load" and mode == "rank0":
        fail_rank = 0  # only rank 0 reads
    res = world(2).run(_fail_case, mode, phase, fail_rank, fail_at, bucket, timeout=60,
                       return_exceptions=True)
    from fsdptk._engine.wire import buckets as _buckets

    # data reads: 6 shards + the plain tensor; send_local calls: rank 0 places its 6 shards and
    # the plain tensor, rank 1 packs its 6 shards; the caller sees one bucket per bucket
    limit = {"load": 7, "gather": 7 if fail_rank == 0 else 6,
             "caller": len(_buckets([48] * 6 + [20], bucket))}[phase]
    happens = fail_at <= limit
    for rank, r in enumerate(res):
        assert not isinstance(r, RemoteError), r
        kind, msg, seconds = r
        assert seconds < 10, r
        if not happens:
            assert kind == "no error", r
            continue
        assert kind == "OSError", r
        if rank != fail_rank:
            assert f"(on rank {fail_rank})" in msg, r


def test_checksum_tells_values_apart():
    from fsdptk._engine.agree import _checksum

    a = torch.arange(12, dtype=torch.float32)
    b = a.clone()
    b[7] += 1
    assert _checksum([a]) == _checksum([a.clone()]) and _checksum([a]) != _checksum([b])
    big = torch.arange(10, dtype=torch.uint8)
    assert _checksum([big[1:9]]) == _checksum([big[1:9].clone()])  # odd storage offset
    assert _checksum([torch.ones(3, dtype=torch.bfloat16)]) != _checksum([torch.zeros(3, dtype=torch.bfloat16)])


def _extra_bytes_by_output_device():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fsdptk._engine.wire as wire
    from fsdptk._engine import agree
    from fsdptk._engine.scatter import _extra_bytes

    mesh = init_device_mesh("cpu", (2,))
    full = torch.ones(64, 1024)  # 256 KiB: Shard(0) pieces of 128 KiB
    target = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to("meta")
    src = {"w": full} if dist.get_rank() == 0 else {}
    plan = agree([("w", target)], src, src_rank0=True)
    direct = [[[True]], [[True]]]  # as if above the direct threshold
    cpu = torch.device("cpu")
    old, wire.DIRECT_MIN_BYTES = wire.DIRECT_MIN_BYTES, 1
    try:
        return (_extra_bytes(plan, 0, direct, 2, cpu, cpu), _extra_bytes(plan, 0, direct, 2, cpu, torch.device("cuda")))
    finally:
        wire.DIRECT_MIN_BYTES = old


def test_received_pieces_count_when_they_are_staged_for_another_device(world):
    """gloo moving into CUDA outputs receives into CPU staging buffers: they count in full."""
    assert world(2).run(_extra_bytes_by_output_device) == [(0, 64 * 1024 * 4)] * 2


# ---------------------------------------------------------------------------------------------
# point-to-point order (docs/architecture.md, "Point-to-point order"): a rank that both sends and
# receives in one bucket cannot block a peer that does too. The posts are simulated under
# rendezvous semantics: a send does not complete until its peer has posted the matching receive
# (the n-th receive from this rank), the posts of a batch are concurrent and the batch completes
# only when all of them do, an unbatched send blocks the rank until it completes, an unbatched
# receive does not.


class _Op(NamedTuple):
    """One posted message as the simulation sees it."""

    recv: bool
    peer: int
    nbytes: int


def _simulate(programs: list[list[tuple[str, list[_Op]]]]) -> list[str]:
    """Run every rank's program of steps (``("batch", ops)``: posted together, done when all are
    matched; ``("post", [op])``: one unbatched post; ``("wait", [])``: done when everything this
    rank posted is matched). Returns the problems: messages whose sizes or counts differ between
    the two ends, and ranks that never complete ([] when every rank completes)."""
    world = len(programs)
    counts: Counter = Counter()
    sizes: dict[tuple[int, int], tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    numbered: list[list[tuple[str, list[tuple[bool, tuple[int, int], int]]]]] = []
    for r, prog in enumerate(programs):
        steps = []
        for kind, ops in prog:
            step = []
            for op in ops:
                ch = (op.peer, r) if op.recv else (r, op.peer)
                side = int(op.recv)
                step.append((op.recv, ch, counts[ch, side]))
                counts[ch, side] += 1
                sizes[ch][side].append(op.nbytes)
            steps.append((kind, step))
        numbered.append(steps)
    problems = [f"messages {a}->{b}: sent {s}, received {v}" for (a, b), (s, v) in sizes.items() if s != v]
    posted: Counter = Counter()
    pc, entered = [0] * world, [False] * world
    mine: list[list[tuple[bool, tuple[int, int], int]]] = [[] for _ in range(world)]

    def matched(op: tuple[bool, tuple[int, int], int]) -> bool:
        recv, ch, k = op
        return posted[ch, int(not recv)] > k  # the other end has posted its k-th message of ch

    progress = True
    while progress:
        progress = False
        for r in range(world):
            while pc[r] < len(numbered[r]):
                kind, ops = numbered[r][pc[r]]
                if not entered[r]:
                    for op in ops:
                        posted[op[1], int(op[0])] += 1
                        mine[r].append(op)
                    entered[r], progress = True, True
                if kind == "batch":
                    done = all(matched(op) for op in ops)
                elif kind == "post":
                    done = ops[0][0] or matched(ops[0])
                else:
                    done = all(matched(op) for op in mine[r])
                if not done:
                    break
                pc[r], entered[r], progress = pc[r] + 1, False, True
    stuck = [r for r in range(world) if pc[r] < len(numbered[r])]
    if stuck:
        problems.append(f"ranks {stuck} never complete (at steps {[pc[r] for r in stuck]})")
    return problems


def _engine_programs(plan, batched: bool) -> list[list[tuple[str, list[_Op]]]]:
    """Every rank's posts of a collect, exactly as the engine plans and orders them
    (``bucket_transfers`` then ``posting_order``): one batch per bucket (what ``InFlight.post_all``
    does), or, where a backend does not group posts, the same posts one by one and a wait per bucket."""
    from fsdptk._engine.routes import bucket_transfers
    from fsdptk._engine.wire import posting_order

    programs = []
    for r in range(len(plan.sends)):
        prog: list[tuple[str, list[_Op]]] = []
        for bucket in plan.buckets:
            ops = [_Op(t.recv, t.peer, t.nbytes) for t in posting_order(bucket_transfers(plan, bucket, r))]
            prog += [("batch", ops)] if batched else [*(("post", [op]) for op in ops), ("wait", [])]
        programs.append(prog)
    return programs


def _parts(draw, n: int, k: int) -> list[slice]:
    """``k`` consecutive (possibly empty) slices covering ``range(n)``."""
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=k - 1, max_size=k - 1)))
    edges = [0, *cuts, n]
    return [slice(a, b) for a, b in pairwise(edges)]


@st.composite
def _gather_case(draw):
    """Random holdings (replicated, dim-0 shards, HSDP replicas, experts on some ranks, strided
    columns), destinations (rank 0, one per item, writers over runs of items) and buckets."""
    world = draw(st.integers(2, 4))
    n = draw(st.integers(1, 8))
    shapes, dtypes = [], []
    boxes: list[list] = [[] for _ in range(world)]
    for _ in range(n):
        rows, cols = draw(st.integers(0, 9)), draw(st.sampled_from([1, 3, 1 << 16]))  # a row of 1 << 16: direct
        shapes.append((rows, cols))
        dtypes.append(draw(st.sampled_from([torch.float32, torch.bfloat16])))
        kind = draw(st.sampled_from(["replicated", "shard", "hsdp", "ep", "strided"]))
        if kind == "hsdp" and world % 2:
            kind = "shard"
        held: list = [None] * world
        if kind == "replicated":
            held = [(slice(0, rows), slice(0, cols))] * world
        elif kind == "shard":
            held = [(p, slice(0, cols)) for p in _parts(draw, rows, world)]
        elif kind == "hsdp":
            parts = _parts(draw, rows, world // 2)
            held = [(parts[r % (world // 2)], slice(0, cols)) for r in range(world)]
        elif kind == "ep":
            owners = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1)))
            for r, p in zip(owners, _parts(draw, rows, len(owners))):
                held[r] = (p, slice(0, cols))
        else:
            held = [(slice(0, rows), tuple(range(r, cols, world)) or slice(0, 0)) for r in range(world)]
        for r in range(world):
            boxes[r].append(held[r])
    how = draw(st.sampled_from(["rank0", "per_item", "writers"]))
    if how == "rank0":
        dests = [0] * n
    elif how == "per_item":
        dests = draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n))
    else:  # writers: runs of consecutive items (files) to W ranks
        w = draw(st.integers(1, world))
        dests = sorted(draw(st.lists(st.integers(0, w - 1), min_size=n, max_size=n)))
    hosts = draw(st.lists(st.sampled_from("ab"), min_size=world, max_size=world))
    return dict(shapes=shapes, dtypes=dtypes, boxes=boxes, hosts=hosts, dests=dests,
                bucket_bytes=draw(st.sampled_from([1, 40, 600, 1 << 20, 1 << 30])), retained=draw(st.booleans()),
                quantized=draw(st.lists(st.booleans(), min_size=n, max_size=n)), into_full=draw(st.booleans()))


def _plan(case):
    from fsdptk._engine.routes import Holdings, plan_gather

    return plan_gather(case["shapes"], case["dtypes"], Holdings(boxes=case["boxes"], hosts=case["hosts"]),
                       case["dests"], bucket_bytes=case["bucket_bytes"], retained=case["retained"],
                       quantized=case["quantized"], into_full=case["into_full"])


@settings(max_examples=300, deadline=None)
@given(case=_gather_case())
def test_collect_posts_cannot_block_each_other(case):
    """Over random holdings, destinations and buckets at 2-4 ranks, the posts the engine makes
    complete on every rank, batched (NCCL) or one by one (a transport without grouping), and every
    message has the same size at both ends."""
    plan = _plan(case)
    assert _simulate(_engine_programs(plan, batched=True)) == []
    assert _simulate(_engine_programs(plan, batched=False)) == []


def test_the_simulation_catches_the_order_that_blocks():
    """Two ranks, each the destination of every other item: both send and receive in every bucket.
    Posted one by one with the sends first (the engine's old order), both ranks block on their
    sends; the engine's posts complete."""
    halves = [(slice(0, 2), slice(0, 8)), (slice(2, 4), slice(0, 8))]
    case = dict(shapes=[(4, 8)] * 4, dtypes=[torch.float32] * 4, boxes=[[halves[0]] * 4, [halves[1]] * 4],
                hosts=["a", "a"], dests=[0, 1, 0, 1], bucket_bytes=1 << 20, retained=False,
                quantized=[False] * 4, into_full=True)
    plan = _plan(case)
    both = _engine_programs(plan, batched=True)
    assert all({op.recv for _, ops in prog for op in ops} == {True, False} for prog in both)  # not vacuous
    old = [[("post", [op]) for _, ops in prog for op in [o for o in ops if not o.recv] + [o for o in ops if o.recv]]
           for prog in both]
    assert _simulate(old) == ["ranks [0, 1] never complete (at steps [0, 0])"]
    assert _simulate(both) == [] and _simulate(_engine_programs(plan, batched=False)) == []


def _recorded_collect(dest_kind: str, own_group: bool):
    """A collect whose ranks both send and receive in one bucket, its posts recorded as the engine
    really makes them (the batches it opens, each ``isend`` / ``irecv``, passed through to gloo).

    ``alternate``: 2 ranks, each item's destination alternately rank 0 and rank 1; ``writers``: 4
    ranks, runs of items to writers 0..3, dim-0 shards beside HSDP replicas (mesh 2 x 2). Large
    dim-0 pieces travel alone, small ones packed. ``own_group`` runs it on a gloo group of its own
    (as the background save does). Returns (what each destination got differs from the expected
    fulls, the recorded program, whether the items' destinations were as asked)."""
    from contextlib import contextmanager

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fsdptk._engine.wire as wire
    from fsdptk._core.dist import using_group
    from fsdptk._engine import collect

    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    flat = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (2, world // 2)) if world == 4 else None
    shapes = [(8, 1 << 15), (6, 5), (8, 1 << 15), (3, 7), (5, 2), (8, 1 << 15), (4, 4), (9, 3)]
    fulls, items = {}, []
    for i, shape in enumerate(shapes):
        fulls[f"t{i}"] = full = torch.randn(shape, generator=gen)
        if hsdp is not None and i % 2:
            t = distribute_tensor(full, hsdp, [Replicate(), Shard(0)], src_data_rank=None)
        else:
            t = distribute_tensor(full, flat, [Shard(0)], src_data_rank=None)
        items.append((f"t{i}", t))
    dests = [i % 2 for i in range(len(shapes))] if dest_kind == "alternate" else [i * world // len(shapes) for i in range(len(shapes))]
    program: list[tuple[str, list[_Op]]] = []
    current: list[list[_Op] | None] = [None]
    real_batch, real = wire.p2p_batch, {"isend": dist.isend, "irecv": dist.irecv}

    @contextmanager
    def batch(group, device):
        current[0] = []
        with real_batch(group, device) as b:
            yield b
        program.append(("batch", current[0]))
        current[0] = None

    def recording(name):
        def post(tensor, *args, **kwargs):
            op = _Op(name == "irecv", kwargs["src" if name == "irecv" else "dst"], tensor.numel() * tensor.element_size())
            if current[0] is None:
                program.append(("post", [op]))
            else:
                current[0].append(op)
            return real[name](tensor, *args, **kwargs)
        return post

    group = dist.new_group(backend="gloo") if own_group else None
    wire.p2p_batch, dist.isend, dist.irecv = batch, recording("isend"), recording("irecv")
    try:
        with using_group(group):
            got = {k: v for b in collect(items, bucket_bytes=1 << 20, dest=dests) for k, v in b}
    finally:
        wire.p2p_batch, dist.isend, dist.irecv = real_batch, real["isend"], real["irecv"]
        if group is not None:
            dist.destroy_process_group(group)
    mine = {k: v for (k, v), d in zip(fulls.items(), dests) if d == rank}
    return tensor_diffs(got, mine), program, sorted(got) == sorted(mine)


def _check_recorded(results) -> None:
    programs = [program for _, program, _ in results]
    for rank, (diffs, program, right_keys) in enumerate(results):
        assert diffs == [] and right_keys, (rank, diffs)
        assert all(kind == "batch" for kind, _ in program), (rank, program)  # no post outside a batch
    # not vacuous: some rank both sends and receives in one batch, with a message above 256 KiB
    assert any(any(o.recv for o in ops) and any(not o.recv for o in ops) and max(o.nbytes for o in ops) > 256 << 10
               for program in programs for _, ops in program), programs
    assert _simulate(programs) == []
    # and posted one by one, sends first (the old order), the same messages would block
    old = [[("post", [o]) for _, ops in p for o in [o for o in ops if not o.recv] + [o for o in ops if o.recv]]
           for p in programs]
    assert _simulate(old) != []


def test_collect_to_alternating_destinations_posts_one_batch_per_bucket(world):
    """2 ranks, each the destination of every other item, so both send and receive in every
    bucket: every destination gets its fulls exactly, every post is in its bucket's batch, and the
    recorded posts complete under rendezvous semantics."""
    _check_recorded(world(2).run(_recorded_collect, "alternate", False, timeout=60))


def test_collect_to_writers_posts_one_batch_per_bucket(world):
    """4 ranks, writers-like destinations (runs of items to each rank), dim-0 shards beside HSDP
    replicas, on a gloo group of its own (as a background save): the same checks."""
    _check_recorded(world(4).run(_recorded_collect, "writers", True, timeout=60))

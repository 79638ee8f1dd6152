"""The gather's reused memory (:mod:`fsdptk._engine.pool`): a block is handed out again only when
nobody holds it (no tensor, view or storage object), a block shared with another process never,
the pool stays within its cap (at the end of a call whatever the caller still holds), and a
gather whose consumer drops each tensor reuses memory where the consumer opted in, while one that
keeps tensors, views or storage objects never sees them written over."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptk._core.compat import storage_users
from fsdptk._engine.pool import Pool


def test_storage_users_counts_views_and_only_them() -> None:
    a = torch.empty(64, dtype=torch.uint8)
    assert storage_users(a) == 1
    v = a[8:16].view(torch.float32)
    assert storage_users(a) == 2
    w = v.view(2)
    assert storage_users(a) == 3
    del v, w
    assert storage_users(a) == 1
    assert storage_users(a.clone()) == 1


def test_storage_users_counts_a_kept_storage_object() -> None:
    """torch's use count sees a storage's one Python object once, however many hold it, and the
    handle storage_users makes is that same object: the object's own references must count."""
    a = torch.empty(64, dtype=torch.uint8)
    kept = a.untyped_storage()
    assert storage_users(a) == 2
    also = a[4:].untyped_storage()  # the same Python object, held twice
    assert also is kept and storage_users(a) == 3
    del kept, also
    assert storage_users(a) == 1
    t = a.view(torch.float32)
    held = t.untyped_storage()
    del t  # a consumer that keeps only the storage of what it was handed
    assert storage_users(a) == 2
    del held
    assert storage_users(a) == 1


_OPS = st.lists(st.tuples(st.sampled_from(["take", "take-keep", "take-keep-storage", "take-share", "drop", "trim"]),
                          st.sampled_from([0, 16, 64, 256, 1024]), st.integers(0, 50)), min_size=1, max_size=40)


def _as_tensor(kept: torch.Tensor | torch.UntypedStorage, size: int) -> torch.Tensor:
    if isinstance(kept, torch.Tensor):
        return kept
    return torch.empty(0, dtype=torch.float32).set_(kept, 0, (size // 4,))


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, cap=st.sampled_from([0, 512, 4096, 1 << 20]))
def test_a_held_tensor_is_never_handed_out_again_and_the_pool_keeps_within_cap(ops, cap) -> None:
    """What the caller holds (a tensor, or only its storage object) is never handed out again nor
    written over; a block shared with another process never again; a new block is made within the
    cap (beyond what the caller holds); after ``trim`` (the end of a call) the pool is within its
    cap whatever the caller holds, and once the caller lets go."""
    pool = Pool(cap=cap, expected=[size for _, size, _ in ops])
    held: list[tuple[torch.Tensor | torch.UntypedStorage, int, int]] = []  # (what the caller keeps, size, value)
    for step, (op, size, pick) in enumerate(ops):
        if op == "drop":
            if held:
                held.pop(pick % len(held))
            continue
        if op == "trim":
            pool.trim()
            assert pool.nbytes() <= cap, (pool.nbytes(), cap)
            continue
        before = sum(n for _, n, _ in held)
        blocks_before = pool.nbytes()
        t = pool.take((size // 4,), torch.float32)
        assert t.shape == (size // 4,) and t.dtype == torch.float32
        assert not t.untyped_storage().is_shared()  # never a block another process may be reading
        lo, hi = t.data_ptr(), t.data_ptr() + size
        # never memory the caller still holds (a generator: no loop variable left holding a tensor)
        assert size == 0 or all(n == 0 or hi <= h.data_ptr() or h.data_ptr() + n <= lo for h, n, _ in held)
        t.fill_(step)
        blocks = pool.nbytes()
        if blocks > blocks_before:  # a block was made: room made first, down to what the caller holds
            assert blocks <= max(cap, before + size), (blocks, cap, before, size)
        if op == "take-keep":
            held.append((t, size, step))
        elif op == "take-keep-storage":
            held.append((t.untyped_storage(), size, step))
        elif op == "take-share":
            t.share_memory_()  # handed to another process: nothing of it is left here
        del t
    for h, n, value in held:  # what the caller kept is as it wrote it
        assert bool((_as_tensor(h, n) == value).all())
    pool.trim()  # whatever the caller still holds
    assert pool.nbytes() <= cap


def test_a_dropped_block_serves_the_next_request_of_its_size_only() -> None:
    pool = Pool(cap=1 << 20, expected=[256] * 3 + [128])
    a = pool.take((64,), torch.float32)
    ptr = a.data_ptr()
    del a
    assert pool.take((8, 8), torch.float32).data_ptr() == ptr  # same bytes, another shape: reused
    assert pool.reused == 256
    b = pool.take((32,), torch.float32)  # 128 bytes: a block of its own, never a larger one's part
    assert b.data_ptr() != ptr
    assert pool.take((64,), torch.float32).data_ptr() == ptr  # the first one's view above is gone


def test_over_the_cap_the_blocks_no_later_request_needs_go_first() -> None:
    pool = Pool(cap=1024, expected=[512, 256, 512, 512])
    big = pool.take((128,), torch.float32)  # 512 bytes, needed again later
    small = pool.take((64,), torch.float32)  # 256 bytes, never again
    big_ptr = big.data_ptr()
    del big, small
    again = pool.take((128,), torch.float32)  # reuses big, and is held
    assert again.data_ptr() == big_ptr
    other = pool.take((128,), torch.float32)  # a new 512: over the cap, so the free 256 goes first
    assert other.data_ptr() != big_ptr
    assert pool.nbytes() == 1024  # the held 512 and the new one


# ----------------------------------------------------------------------------------------------
# the gather: reuse while the consumer drops (where it opted in), never while it holds
def _gather(mode: str, reuse_yielded: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdptk._engine import collect

    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(7)
    shapes = [(64, 48), (96,), (64, 48), (128, 32), (64, 48), (96,), (128, 32), (512, 64)] * 3
    fulls = {f"t{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    items = [(k, distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None)) for k, v in fulls.items()]
    ptrs, wrong, kept, pooled = [], [], [], 0
    pool = Pool(cap=0)  # the caller's pool (the gather sets its cap), to see which memory it hands out
    for bucket in collect(items, bucket_bytes=40_000, dest=[i % 2 for i in range(len(items))], pool=pool,
                          reuse_yielded=reuse_yielded):
        for name, t in bucket:
            ptrs.append(t.data_ptr())
            pooled += any(t.untyped_storage().data_ptr() == b.data_ptr() for bs in pool._blocks.values()
                          for _, b in bs)
            if not torch.equal(t, fulls[name]):
                wrong.append(name)
            if mode == "keep-views" and int(name[1:]) % 3 == 0:
                kept.append((name, t[1:].view(-1)[:7]))  # a view of a view: still the yielded memory
            if mode == "keep-storages" and int(name[1:]) % 3 == 0:
                kept.append((name, torch.empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape)))
                kept[-1] = (name, kept[-1][1].untyped_storage())  # only the storage object is kept
        del bucket
    changed = []
    for n, v in kept:
        if isinstance(v, torch.UntypedStorage):
            v = torch.empty(0).set_(v, 0, fulls[n].shape)
            same = torch.equal(v, fulls[n])
        else:
            same = torch.equal(v, fulls[n][1:].reshape(-1)[:7])
        if not same:
            changed.append(n)
    return {"n": len(ptrs), "distinct": len(set(ptrs)), "wrong": wrong, "changed": changed, "kept": len(kept),
            "pooled": pooled}


def test_a_gather_reuses_memory_the_consumer_dropped_and_never_what_it_holds(world) -> None:
    for reuse_yielded in (True, False):
        for mode in ("drop", "keep-views", "keep-storages"):
            results = world(2).run(_gather, mode, reuse_yielded, timeout=120)
            for rank, r in enumerate(results):
                assert r["wrong"] == [] and r["changed"] == [], (mode, rank, r)
                assert r["n"] == 12, (mode, rank, r)  # every other item
                assert r["kept"] == (0 if mode == "drop" else 4), (mode, rank, r)
            # with the opt-in every full tensor is a pool block's (reused ones where the consumer
            # dropped them); without it none is: the pool serves the wire's buffers only
            assert all(r["pooled"] == (r["n"] if reuse_yielded else 0) for r in results), (reuse_yielded, results)
            if mode == "drop" and reuse_yielded:  # each rank's 12 tensors in a handful of reused blocks
                assert all(r["distinct"] < r["n"] for r in results), results


# ----------------------------------------------------------------------------------------------
# weight_source(keep_buffers=True): the next pass writes into the last pass's blocks
def _passes(keep: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    from fsdptk.hf import weight_source

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    source = weight_source(model, conversion=None, keep_buffers=keep, bucket_bytes=40_000)

    def expected() -> dict:
        return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}

    def drain(want: dict) -> tuple[set[int], list[str]]:
        ptrs, wrong = set(), []
        for name, t in source.iter_full():
            ptrs.add(t.data_ptr())
            if not torch.equal(t, want[name]):
                wrong.append(name)
        return ptrs, wrong

    want1 = expected()
    kept = dict(source.iter_full())  # the consumer keeps the whole first pass
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    want2 = expected()
    _, wrong2 = drain(want2)  # while the first pass is held
    rank = dist.get_rank()
    kept_ok = all(torch.equal(kept[k], want1[k]) for k in want1) if rank == 0 else not kept
    del kept
    ptrs3, wrong3 = drain(want2)
    pool = source._pool
    blocks = {b.data_ptr() for bs in pool._blocks.values() for _, b in bs} if pool is not None else set()
    ptrs4, wrong4 = drain(want2)
    # what stays between passes: about two buckets (2 x the largest of bucket and tensor, less a bucket)
    within = pool is None or pool.nbytes() <= 2 * max(40_000, 64 * 64 * 4) - 40_000
    return {"kept_ok": kept_ok, "wrong": wrong2 + wrong3 + wrong4, "from_last_pass": len(ptrs4 & blocks & ptrs3),
            "n": len(ptrs4), "pool": pool is not None, "within": within}


def test_keep_buffers_reuses_the_last_pass_memory_and_never_what_the_consumer_kept(world) -> None:
    for keep in (True, False):
        results = world(2).run(_passes, keep, timeout=120)
        assert all(r["kept_ok"] and r["wrong"] == [] and r["pool"] == keep and r["within"] for r in results), (
            keep, results)
        if keep:  # rank 0 owns every name: its last pass writes into blocks the pass before left
            assert results[0]["n"] > 0 and results[0]["from_last_pass"] > 0, results


def test_keep_buffers_must_be_a_bool() -> None:
    import pytest

    from fsdptk.hf import weight_source

    with pytest.raises(TypeError, match="keep_buffers must be a bool, got 'yes'"):
        weight_source(torch.nn.Linear(2, 2), keep_buffers="yes")  # type: ignore[arg-type]

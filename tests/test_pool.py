"""The gather's reused memory (:mod:`fsdptk._engine.pool`): a block is handed out again only when
nobody holds it, the pool stays within its cap, and a gather whose consumer drops each tensor
reuses memory while one that keeps tensors (or views of them) never sees them written over."""

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


_OPS = st.lists(st.tuples(st.sampled_from(["take", "take-keep", "drop"]), st.sampled_from([0, 16, 64, 256, 1024]),
                          st.integers(0, 50)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, cap=st.sampled_from([0, 512, 4096, 1 << 20]))
def test_a_held_tensor_is_never_handed_out_again_and_the_pool_keeps_within_cap(ops, cap) -> None:
    pool = Pool(cap=cap, expected=[size for _, size, _ in ops])
    held: list[tuple[torch.Tensor, int]] = []  # (tensor the caller keeps, the value written into it)
    for step, (op, size, pick) in enumerate(ops):
        if op == "drop":
            if held:
                held.pop(pick % len(held))
            continue
        before = sum(t.numel() * 4 for t, _ in held)
        blocks_before = pool.nbytes()
        t = pool.take((size // 4,), torch.float32)
        assert t.shape == (size // 4,) and t.dtype == torch.float32
        lo, hi = t.data_ptr(), t.data_ptr() + size
        # never memory the caller still holds (a generator: no loop variable left holding a tensor)
        assert size == 0 or all(h.numel() == 0 or hi <= h.data_ptr() or h.data_ptr() + h.numel() * 4 <= lo
                                for h, _ in held)
        t.fill_(step)
        blocks = pool.nbytes()
        if blocks > blocks_before:  # a block was made: room made first, down to what the caller holds
            assert blocks <= max(cap, before + size), (blocks, cap, before, size)
        if op == "take-keep":
            held.append((t, step))
        del t
    for h, value in held:  # what the caller kept is as it wrote it
        assert bool((h == value).all())


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
# the gather: reuse while the consumer drops, never while it holds
def _gather(mode: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdptk._engine import collect

    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(7)
    shapes = [(64, 48), (96,), (64, 48), (128, 32), (64, 48), (96,), (128, 32), (512, 64)] * 3
    fulls = {f"t{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    items = [(k, distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None)) for k, v in fulls.items()]
    ptrs, wrong, kept = [], [], []
    for bucket in collect(items, bucket_bytes=40_000, dest=[i % 2 for i in range(len(items))]):
        for name, t in bucket:
            ptrs.append(t.data_ptr())
            if not torch.equal(t, fulls[name]):
                wrong.append(name)
            if mode == "keep-views" and int(name[1:]) % 3 == 0:
                kept.append((name, t[1:].view(-1)[:7]))  # a view of a view: still the yielded memory
        del bucket
    changed = [n for n, v in kept if not torch.equal(v, fulls[n][1:].reshape(-1)[:7])]
    return {"n": len(ptrs), "distinct": len(set(ptrs)), "wrong": wrong, "changed": changed, "kept": len(kept)}


def test_a_gather_reuses_memory_the_consumer_dropped_and_never_what_it_holds(world) -> None:
    for mode in ("drop", "keep-views"):
        results = world(2).run(_gather, mode, timeout=120)
        for rank, r in enumerate(results):
            assert r["wrong"] == [] and r["changed"] == [], (mode, rank, r)
            assert r["n"] == 12, (mode, rank, r)  # every other item
        if mode == "drop":  # each rank's 12 tensors in a handful of reused blocks
            assert all(r["distinct"] < r["n"] for r in results), results
        else:
            assert all(r["kept"] == 4 for r in results), results
    assert dist.is_available()


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

"""The consumer contract of :func:`fsdptk.hf.weight_source` (issue 49, defects 1-4 and 9), on real
gloo ranks:

- every pass ends in one agreement on every rank whether the consumer finishes, raises, or closes
  the generator on one rank only (``break``, ``.close()``): the other ranks raise within seconds,
  naming that rank, in ``iter_full``, ``iter_buckets`` and ``iter_local(owners="all")`` (whose
  pieces after the last gathered tensor are yielded outside the engine), and the next pass works;
- by default a tensor handed to the consumer is the consumer's: a consumer that keeps only
  ``t.untyped_storage()``, or moves each tensor into shared memory and sends it to another process
  through a ``torch.multiprocessing`` queue, finds its values intact after the pass (with
  ``keep_buffers=True`` too: a kept storage object counts as a holder, shared memory is never
  reused);
- with ``keep_buffers=True`` the memory the source keeps between passes is within its documented
  cap once the consumer drops what it kept;
- what each rank can import of vLLM is agreed: one rank with an older vLLM (no
  ``vllm.distributed.weight_transfer``) makes every rank raise one error naming each rank's kind.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

_PROMPT = 20.0  # seconds within which every rank must have raised (a hang waits for the call timeout)
_CALL_TIMEOUT = 60  # shorter than a collective's timeout in the test world: a hang fails the test


def _fsdp_model(layers: int, rows: int, cols: int, bias: bool = True, mixed: bool = False) -> torch.nn.Module:
    """``mixed``: every other layer has one output row, which one rank of two does not hold a
    piece of: gathered whole by ``iter_local(owners="all")``, between the pieces of the others."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(cols, 1 if mixed and i % 2 else rows, bias=bias)
                                  for i in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------
# defect 1: a consumer that raises or closes the generator on one rank only
def _stop_on_one_rank(mode: str, owners, stopper: int, how: str) -> dict:
    from fsdptk.hf import weight_source

    model = _fsdp_model(6, 64, 64, mixed=mode == "local-mixed")
    source = weight_source(model, conversion=None, owners=owners, bucket_bytes=20_000)
    rank = dist.get_rank()
    start = {"full": source.iter_full, "buckets": source.iter_buckets, "local": source.iter_local,
             "local-mixed": source.iter_local}[mode]
    outcome = None
    seen = 0
    t0 = time.monotonic()
    try:
        if how == "close":
            it = start()
            for _ in it:
                seen += 1
                if rank == stopper and seen == 2:
                    it.close()  # the rest of the loop sees the end of the pass
            del it
        else:
            for _ in start():  # no name holds the generator: leaving the loop closes it
                seen += 1
                if rank == stopper and seen == 2:
                    if how == "raise":
                        raise KeyError("the consumer failed")
                    break
    except Exception as e:  # noqa: BLE001 - what each rank raised
        outcome = (type(e).__name__, str(e))
    elapsed = time.monotonic() - t0
    again = {k: v.clone() for k, v in source.iter_full()}  # the next pass is whole
    want = _full(model)
    return {"outcome": outcome, "elapsed": elapsed, "seen": seen,
            "again_ok": all(torch.equal(v, want[k]) for k, v in again.items()), "again": sorted(again)}


@pytest.mark.parametrize("how", ["raise", "break", "close"])
@pytest.mark.parametrize(("mode", "owners", "stopper"), [("full", "all", 1), ("full", 1, 0), ("buckets", 1, 1),
                                                         ("local", "all", 1), ("local-mixed", "all", 0)])
def test_a_consumer_leaving_on_one_rank_fails_every_other_rank_at_once(world, mode, owners, stopper, how) -> None:
    """``local`` with owners="all" over FSDP: every Hub tensor is a piece the rank holds, so every
    piece is yielded after the (empty) gather: the case the engine's agreements did not cover;
    ``local-mixed``: pieces and gathered tensors interleaved (the consumer leaves at a piece)."""
    results = world(2).run(_stop_on_one_rank, mode, owners, stopper, how, timeout=_CALL_TIMEOUT)
    for rank, r in enumerate(results):
        if rank == stopper:
            assert r["outcome"] == (("KeyError", "'the consumer failed'") if how == "raise" else None), r
            assert r["seen"] == 2, r
        else:
            assert r["outcome"] is not None and r["outcome"][0] == "RuntimeError", r
            assert f"rank {stopper}" in r["outcome"][1] and "stopped iterating" in r["outcome"][1], r
        assert r["elapsed"] < _PROMPT, r
        assert r["again_ok"], r
    names = sorted({n for r in results for n in r["again"]})
    assert len(names) == 12, names  # 6 weights, 6 biases


# ----------------------------------------------------------------------------------------------
# defects 2 and 3: what the consumer keeps is never written over
_BIG = (2048, 1024)  # 8 MiB of float32 per weight: two per 16 MiB bucket, a pass of several buckets


def _keep_storages(keep_buffers: bool) -> dict:
    from fsdptk.hf import weight_source

    model = _fsdp_model(8, *_BIG, bias=False)
    source = weight_source(model, conversion=None, keep_buffers=keep_buffers)  # default bucket: 16 MiB
    want = _full(model)
    kept = []
    for _ in range(2):  # a second pass may reuse what the first handed out (keep_buffers)
        for name, t in source.iter_full():
            kept.append((name, t.untyped_storage(), t.storage_offset(), t.shape, t.stride(), t.dtype))
            del t  # only the storage object is kept
    changed = []
    for name, storage, offset, shape, stride, dtype in kept:
        again = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
        if not torch.equal(again, want[name]):
            changed.append(name)
    return {"n": len(kept), "changed": changed}


@pytest.mark.parametrize("keep_buffers", [False, True])
def test_a_kept_untyped_storage_keeps_its_weight(world, keep_buffers) -> None:
    results = world(2).run(_keep_storages, keep_buffers, timeout=180)
    assert results[0]["n"] == 16 and results[1]["n"] == 0, results  # rank 0 owns every name
    assert results[0]["changed"] == [], results


def _receiver(queue, answers) -> None:  # a separate process: reads what it was sent after the passes
    got: dict[str, list[torch.Tensor]] = {}
    while True:
        msg = queue.get()
        if msg is None:
            break
        kind, name, t = msg
        if kind == "tensor":
            got.setdefault(name, []).append(t)
        else:  # the expected values, sent once every pass has ended
            diffs = [float((g - t).abs().max()) for g in got.get(name, [])]
            answers.put((name, len(diffs), max(diffs, default=float("nan"))))
    answers.put(None)


def _share_with_a_process(keep_buffers: bool) -> dict:
    import multiprocessing

    import torch.multiprocessing as tmp

    from fsdptk.hf import weight_source

    model = _fsdp_model(8, *_BIG, bias=False)
    source = weight_source(model, conversion=None, keep_buffers=keep_buffers)
    want = _full(model)
    if dist.get_rank() != 0:
        for _ in range(2):
            assert list(source.iter_full()) == []
        return {}
    ctx = tmp.get_context("spawn")
    queue, answers = ctx.Queue(), ctx.Queue()
    me = multiprocessing.current_process()
    daemon = me._config.get("daemon")  # the test world's workers are daemons, which may not start
    me._config["daemon"] = False  # a process: only this test's receiver, joined below
    try:
        child = ctx.Process(target=_receiver, args=(queue, answers))
        child.start()
    finally:
        me._config["daemon"] = daemon
    try:
        for _ in range(2):
            for name, t in source.iter_full():
                t.share_memory_()  # what a CPU IPC handoff does; nothing of it is left here
                queue.put(("tensor", name, t))
                del t
        for name, t in want.items():
            queue.put(("expected", name, t))
        queue.put(None)
        rows = []
        while (row := answers.get(timeout=120)) is not None:
            rows.append(row)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    return {"rows": rows}


@pytest.mark.parametrize("keep_buffers", [False, True])
def test_memory_shared_with_another_process_is_never_written_over(world, keep_buffers) -> None:
    results = world(2).run(_share_with_a_process, keep_buffers, timeout=240)
    rows = results[0]["rows"]
    assert len(rows) == 8 and all(n == 2 for _, n, _ in rows), rows  # each weight, from both passes
    assert all(diff == 0.0 for _, _, diff in rows), rows


# ----------------------------------------------------------------------------------------------
# defect 4: what keep_buffers keeps between passes, once the consumer lets go
def _dropped_after_the_pass(bucket_bytes: int) -> dict:
    import gc

    from fsdptk.hf import weight_source

    model = _fsdp_model(16, 256, 256)
    source = weight_source(model, conversion=None, keep_buffers=True, bucket_bytes=bucket_bytes)
    everything = list(source.iter_full())  # the consumer keeps the whole pass ...
    total = sum(t.numel() * t.element_size() for _, t in everything)
    del everything  # ... and drops it after the pass
    gc.collect()
    pool = source._pool
    assert pool is not None
    return {"total": total, "held": pool.nbytes()}


def test_keep_buffers_holds_within_its_cap_between_passes_once_the_consumer_drops(world) -> None:
    bucket_bytes = 300_000
    results = world(2).run(_dropped_after_the_pass, bucket_bytes, timeout=_CALL_TIMEOUT)
    largest = 256 * 256 * 4
    cap = 2 * max(bucket_bytes, largest) - bucket_bytes  # docs/weight_sync.md, "Reused memory"
    assert results[0]["total"] > 4 * cap, results  # the whole model is far over the cap
    assert all(r["held"] <= cap for r in results), (cap, results)


# ----------------------------------------------------------------------------------------------
# defect 9: what each rank can import of vLLM is part of the agreement
def _older_vllm_on(ranks: list[int]) -> dict:
    import importlib.machinery
    import sys
    import types

    from fsdptk.hf import weight_source

    fake = None
    if dist.get_rank() in ranks and "vllm" not in sys.modules:  # an older vLLM: no weight_transfer module
        fake = types.ModuleType("vllm")
        fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
        fake.__version__ = "0.32.0"
        sys.modules["vllm"] = fake
    model = _fsdp_model(2, 8, 8)
    outcome, rows = None, None
    try:
        source = weight_source(model, conversion=None)
        rows = [(m.name, type(m).__module__) for m in source.metadata]
        rows += [(n, "iter_full") for n, _ in source.iter_full()]
    except Exception as e:  # noqa: BLE001 - what each rank raised
        outcome = (type(e).__name__, str(e))
    finally:
        if fake is not None:
            del sys.modules["vllm"]
    return {"outcome": outcome, "rows": rows, "faked": fake is not None}


def test_ranks_that_can_import_different_vllm_records_get_one_error_naming_them(world) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    results = world(2).run(_older_vllm_on, [1], timeout=_CALL_TIMEOUT)
    assert results[1]["faked"], results
    for r in results:
        assert r["outcome"] is not None and r["outcome"][0] == "ValueError", results
        message = r["outcome"][1]
        assert "rank 0" in message and "rank 1" in message and "vllm.distributed.weight_transfer" in message, message
        assert "not installed" in message, message  # rank 0's kind
    assert results[0]["outcome"] == results[1]["outcome"], results


def test_an_older_vllm_on_every_rank_gives_fsdptks_own_records(world) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    results = world(2).run(_older_vllm_on, [0, 1], timeout=_CALL_TIMEOUT)
    for r in results:
        assert r["faked"] and r["outcome"] is None, results
        assert {m for n, m in r["rows"] if m != "iter_full"} == {"fsdptk.hf._weight_meta"}, r
    assert [n for n, m in results[0]["rows"] if m == "iter_full"] == ["0.weight", "0.bias", "1.weight", "1.bias"]

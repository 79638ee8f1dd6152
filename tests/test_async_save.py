"""Background saves (issue 26): ``save_safetensors_async`` / ``save_dcp_async`` on real gloo worlds.

Training goes on while the save runs and the files hold the snapshot's values (bit-exact), not
the later ones; an error on one rank in the background (a failed read, a failed write, a killed
rank) reaches every rank's ``wait()`` within seconds; a process killed mid-save leaves the
previous checkpoint loadable; two saves in a row hold one snapshot at a time, and the next save
copies into the kept snapshot's buffers (a new layout reallocates them); 2-D (FSDP x TP) and NF4
models. Failures are injected as the other failure tests inject them (a patched engine
read, a real file size limit, ``os._exit`` / SIGKILL of a real worker); torch.distributed is real.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from fsdptk.testing import RemoteError

_HARD_TIMEOUT = 120
_PROMPT = 10.0  # seconds within which every rank's wait() must raise


# ----------------------------------------------------------------------------------------------
# helpers (module level: the workers import them)
def _model(n: int = 4, width: int = 32, seed: int = 0) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    from fsdptk import gather_cpu_state_dict

    return gather_cpu_state_dict(model, dist.get_rank() == 0)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, model[0].in_features, generator=gen)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


class _SlowWrites:
    """Rank 0's file writes take ``seconds`` each (a slow disk), so the save surely overlaps the
    training steps that follow the call."""

    def __init__(self, seconds: float) -> None:
        from fsdptk._files.safetensors_writer import ShardedWriter

        self.cls, self.inner, self.seconds = ShardedWriter, ShardedWriter.write, seconds

    def __enter__(self) -> None:
        inner, seconds = self.inner, self.seconds

        def slow(writer: Any, key: str, tensor: torch.Tensor) -> int:
            time.sleep(seconds)
            return inner(writer, key, tensor)

        self.cls.write = slow

    def __exit__(self, *exc: object) -> None:
        self.cls.write = self.inner


# ----------------------------------------------------------------------------------------------
# training goes on; the files hold the snapshot
def _train_while_saving(path: str) -> dict[str, Any]:
    from fsdptk import save_safetensors_async

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt, 0)
    expected = _gathered(model)
    with _SlowWrites(0.1):
        t0 = time.monotonic()
        pending = save_safetensors_async(model, path, bucket_bytes=4096)
        blocked = time.monotonic() - t0
        overlapped = []
        for step in range(1, 4):  # FSDP collectives on the default group, the save on its own
            _train_step(model, opt, step)
            overlapped.append(not pending.done())
        out = pending.wait(timeout=60)
    after = _gathered(model)
    if dist.get_rank() != 0:
        return {"blocked": blocked, "overlapped": overlapped}
    files = load_file(out)
    return {"blocked": blocked, "overlapped": overlapped, "snapshot": _same(files, expected),
            "later_differ": not any(torch.equal(files[k], after[k]) for k in files if k.endswith("weight")),
            "seconds": pending.seconds}


def test_training_continues_and_the_files_hold_the_snapshot(world, tmp_path: Path) -> None:
    res = world(2).run(_train_while_saving, str(tmp_path / "ckpt"), timeout=_HARD_TIMEOUT)
    for r in res:
        assert all(r["overlapped"]), r  # three optimizer steps ran while the save was writing
    assert res[0]["snapshot"] and res[0]["later_differ"], res[0]  # bit-exact, not the later values
    assert res[0]["seconds"] > 4 * 0.1  # the writes took their time, in the background


def _train_while_saving_dcp(path: str) -> tuple[bool, bool, bool]:
    from fsdptk import load_dcp, save_dcp_async
    from fsdptk.optim import get_full_optimizer_state_dict

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train_step(model, opt, 0)
    expected = _gathered(model)
    expected_opt = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    pending = save_dcp_async(model, path, opt, extra={"step": 1})
    for step in range(1, 3):
        _train_step(model, opt, step)
    assert pending.wait(timeout=60) == Path(path)
    fresh = _model(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    extra = load_dcp(fresh, path, fresh_opt)
    got, got_opt = _gathered(fresh), get_full_optimizer_state_dict(fresh, fresh_opt, dist.get_rank() == 0)
    if dist.get_rank() != 0:
        return True, True, extra == {"step": 1}
    same_opt = all(_same(expected_opt["state"][k], got_opt["state"][k]) for k in expected_opt["state"])
    return _same(got, expected), same_opt, extra == {"step": 1}


def test_dcp_async_saves_model_and_optimizer_snapshot(world, tmp_path: Path) -> None:
    res = world(2).run(_train_while_saving_dcp, str(tmp_path / "step_1"), timeout=_HARD_TIMEOUT)
    assert res == [(True, True, True)] * 2, res


# ----------------------------------------------------------------------------------------------
# errors in the background reach every rank's wait()
def _wait_error(pending: Any) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        pending.wait(timeout=60)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def _read_fails(path: str, fail_rank: int) -> tuple[tuple[str, str, float], bool]:
    from _patching import wrapped_send_local

    from fsdptk import load_safetensors, save_safetensors, save_safetensors_async

    model = _model()
    save_safetensors(model, path)
    previous = _gathered(model)
    calls = [0]

    def flaky(inner):
        def read(layout):
            calls[0] += 1
            if dist.get_rank() == fail_rank and calls[0] == 3:
                raise RuntimeError("device-side fault while reading a shard")
            return inner(layout)
        return read

    with wrapped_send_local(flaky), torch.no_grad():
        pending = save_safetensors_async(model, path, bucket_bytes=600)
        for p in model.parameters():
            p.add_(1.0)
        res = _wait_error(pending)
    check = _model(seed=5)
    load_safetensors(check, path, strict=True)
    return res, _same(_gathered(check), previous)  # the previous checkpoint is intact


def _write_fails(path: str) -> tuple[tuple[str, str, float], bool]:
    from fsdptk import load_safetensors, save_safetensors, save_safetensors_async

    model = _model()
    save_safetensors(model, path, max_shard_size=6000)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if dist.get_rank() == 0:  # a real write failure: the file size limit, half way through a shard
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, old_limit[1]))
    try:
        pending = save_safetensors_async(model, path, max_shard_size=6000, bucket_bytes=2000)
        res = _wait_error(pending)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    check = _model(seed=5)
    load_safetensors(check, path, strict=True)
    return res, _same(_gathered(check), _gathered(model))


def _check_errors(res: list[Any], kind: str, failing_rank: int, part: str) -> None:
    for rank, r in enumerate(res):
        assert not isinstance(r, RemoteError), (rank, r)
        (got, msg, seconds), previous_ok = r
        assert got == kind and part in msg, (rank, got, msg)
        assert seconds < _PROMPT, (rank, seconds)
        assert previous_ok, (rank, "the previous checkpoint changed")
        if rank != failing_rank:
            assert f"on rank {failing_rank}" in msg, (rank, msg)


def test_a_read_failing_on_one_rank_reaches_every_wait(world, tmp_path: Path) -> None:
    for fail_rank in (1, 0):  # a sender, and the receiver placing its own shards
        res = world(2).run(_read_fails, str(tmp_path / f"r{fail_rank}"), fail_rank,
                           timeout=_HARD_TIMEOUT, return_exceptions=True)
        _check_errors(res, "RuntimeError", fail_rank, "device-side fault")


def test_a_write_failing_on_rank0_reaches_every_wait(world, tmp_path: Path) -> None:
    res = world(2).run(_write_fails, str(tmp_path / "w"), timeout=_HARD_TIMEOUT, return_exceptions=True)
    _check_errors(res, "OSError", 0, "File too large")
    assert not [p for p in (tmp_path / "w").iterdir() if p.name.endswith(".tmp")]  # nothing left


def _rank1_dies(path: str) -> tuple[str, str, float]:
    from _patching import wrapped_send_local

    from fsdptk import save_safetensors_async

    model = _model()
    calls = [0]

    def dies(inner):
        def read(layout):
            calls[0] += 1
            if dist.get_rank() == 1 and calls[0] == 3:
                os._exit(3)  # killed (out of memory, preempted) in the middle of the background save
            return inner(layout)
        return read

    with wrapped_send_local(dies):
        pending = save_safetensors_async(model, path, bucket_bytes=600)
        return _wait_error(pending)


def test_a_killed_rank_reaches_the_survivors_wait(world, tmp_path: Path) -> None:
    w = world(2)
    restarts = w.restarts
    res = w.run(_rank1_dies, str(tmp_path / "k"), timeout=_HARD_TIMEOUT, return_exceptions=True)
    assert isinstance(res[1], RemoteError) and res[1].exc_type == "WorkerDied", res[1]
    kind, msg, seconds = res[0]
    assert kind == "RuntimeError" and seconds < _PROMPT, res[0]
    assert "communication with the other ranks failed on rank 0" in msg, msg
    assert w.restarts == restarts + 1


def _writer_killed(path: str) -> None:
    from fsdptk import save_safetensors, save_safetensors_async
    from fsdptk._files.safetensors_writer import ShardedWriter

    model = _model()
    save_safetensors(model, path, max_shard_size=6000)  # the previous checkpoint
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    inner, calls = ShardedWriter.write, [0]

    def killed(writer: Any, key: str, tensor: torch.Tensor) -> int:
        calls[0] += 1
        if calls[0] == 5:  # rank 0, half way through the new files
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(writer, key, tensor)

    ShardedWriter.write = killed
    save_safetensors_async(model, path, max_shard_size=6000, bucket_bytes=600).wait(timeout=60)


def _recover(path: str) -> tuple[bool, bool]:
    from fsdptk import load_safetensors, save_safetensors

    previous = _model()
    check = _model(seed=5)
    load_safetensors(check, path, strict=True)  # the previous checkpoint, as it was
    loadable = _same(_gathered(check), _gathered(previous))
    save_safetensors(previous, path, max_shard_size=6000)  # recovers what the killed save left
    return loadable, True


def test_a_killed_writer_leaves_the_previous_checkpoint_loadable(world, tmp_path: Path) -> None:
    import json

    w = world(2)
    d = tmp_path / "ckpt"
    res = w.run(_writer_killed, str(d), timeout=_HARD_TIMEOUT, return_exceptions=True)
    assert isinstance(res[0], RemoteError) and res[0].exc_type == "WorkerDied", res[0]
    assert (d / ".fsdptk.lock").exists()  # the dead writer's lock and temporary files are left
    assert w.run(_recover, str(d), timeout=_HARD_TIMEOUT) == [(True, True)] * 2
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert {p.name for p in d.iterdir()} == {"model.safetensors.index.json", *index["weight_map"].values()}


# ----------------------------------------------------------------------------------------------
# two saves in a row: one snapshot at a time; a load of the path waits
def _two_in_a_row(root: str) -> dict[str, bool]:
    from fsdptk import load_safetensors, save_safetensors, save_safetensors_async

    model = _model()
    first = _gathered(model)
    with _SlowWrites(0.05):
        p1 = save_safetensors_async(model, f"{root}/a", bucket_bytes=600)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        second = _gathered(model)
        p2 = save_safetensors_async(model, f"{root}/b", bucket_bytes=600)
        first_done_before_second_snapshot = p1.done()  # the call waited: one snapshot at a time
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        third = _gathered(model)
        back = _model(seed=5)
        load_safetensors(back, f"{root}/b", strict=True)  # waits for p2, which writes it
        p2_done_before_load = p2.done()
        p3 = save_safetensors_async(model, f"{root}/c", bucket_bytes=600)
        save_safetensors(model, f"{root}/d")  # a synchronous save waits for p3 first
        p3_done_before_sync = p3.done()
    out = {"one_snapshot": first_done_before_second_snapshot, "load_waits": p2_done_before_load,
           "sync_waits": p3_done_before_sync, "back": _same(_gathered(back), second)}
    p1.wait(), p2.wait(), p3.wait()
    if dist.get_rank() == 0:
        out["a"] = _same(load_file(f"{root}/a/model.safetensors"), first)
        out["b"] = _same(load_file(f"{root}/b/model.safetensors"), second)
        out["c"] = _same(load_file(f"{root}/c/model.safetensors"), third)
        out["d"] = _same(load_file(f"{root}/d/model.safetensors"), third)
    return out


def test_two_pending_saves_in_a_row(world, tmp_path: Path) -> None:
    res = world(2).run(_two_in_a_row, str(tmp_path), timeout=_HARD_TIMEOUT)
    for r in res:
        assert all(r.values()), r
    assert {"a", "b", "c", "d"} <= set(res[0])


# ----------------------------------------------------------------------------------------------
# the snapshot is kept from one save to the next
def _kept() -> list[torch.Tensor]:
    from fsdptk.background import _KEPT

    return [t for _, t in _KEPT._buffers]


def _same_buffers(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(x is y and x.data_ptr() == y.data_ptr() for x, y in zip(a, b))


def _reused_between_saves(root: str) -> dict[str, Any]:
    import weakref

    from fsdptk import release_snapshot, save_dcp_async, save_safetensors_async

    release_snapshot()  # the world's processes are shared between tests
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    expected, kept, files = [], [], []
    for i in range(3):
        _train_step(model, opt, i)  # training between the saves: new values each time
        expected.append(_gathered(model))
        with _SlowWrites(0.02):
            pending = save_safetensors_async(model, f"{root}/s{i}", bucket_bytes=600)
            kept.append(_kept())
            _train_step(model, opt, 10 + i)  # changes the live shards while the save reads its copy
        files.append(pending.wait(timeout=60))
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    out = {"reused": _same_buffers(kept[0], kept[1]) and _same_buffers(kept[1], kept[2])
           and len(kept[0]) == 2 * 4}
    del kept
    out["released"] = release_snapshot() == local_bytes and _kept() == []

    save_safetensors_async(model, f"{root}/s3").wait(timeout=60)
    old = [weakref.ref(t) for t in _kept()]
    wider = _model(width=48)  # another layout: new buffers, the old ones dropped
    save_safetensors_async(wider, f"{root}/wide").wait(timeout=60)
    out["old_dropped"] = len(old) == 8 and all(r() is None for r in old)
    out["wide_new"] = [t.shape for t in _kept()] == [p.to_local().shape for p in wider.parameters()]
    wide_expected = _gathered(wider)
    save_dcp_async(model, f"{root}/dcp", opt).wait(timeout=60)  # model and momentum: new once
    dcp_kept = _kept()
    save_dcp_async(model, f"{root}/dcp2", opt).wait(timeout=60)
    out["dcp_reused"] = _same_buffers(dcp_kept, _kept()) and len(dcp_kept) == 2 * 8
    del dcp_kept
    release_snapshot()
    if dist.get_rank() == 0:
        for i in range(3):
            out[f"s{i}"] = _same(load_file(files[i]), expected[i])  # bit-exact, each its own values
        out["differ"] = not _same(expected[0], expected[1]) and not _same(expected[1], expected[2])
        out["wide"] = _same(load_file(f"{root}/wide/model.safetensors"), wide_expected)
    return out


def test_the_snapshot_is_reused_by_the_next_save(world, tmp_path: Path) -> None:
    res = world(2).run(_reused_between_saves, str(tmp_path), timeout=_HARD_TIMEOUT)
    for r in res:
        assert all(r.values()), r
    assert {"s0", "s1", "s2", "differ", "wide"} <= set(res[0])


# ----------------------------------------------------------------------------------------------
# 2-D (FSDP x TP) and NF4 models
def _two_d(root: str) -> tuple[bool, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from fsdptk import load_dcp, save_dcp_async, save_safetensors_async

    def build(seed: int) -> nn.Module:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model[0], mesh=mesh["dp_shard"])
        fully_shard(model[2], mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
        return model

    model = build(0)
    expected = _gathered(model)
    pending = save_safetensors_async(model, f"{root}/hf", bucket_bytes=512)
    pending_dcp = save_dcp_async(model, f"{root}/dcp")  # waits for the first: one snapshot
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    out = pending.wait(timeout=60)
    pending_dcp.wait(timeout=60)
    back = build(1)
    load_dcp(back, f"{root}/dcp")
    dcp_ok = _same(_gathered(back), expected)
    if dist.get_rank() != 0:
        return True, dcp_ok
    return _same(load_file(out), expected), dcp_ok


def test_async_save_of_a_2d_fsdp_tp_model(world, tmp_path: Path) -> None:
    assert world(4).run(_two_d, str(tmp_path), timeout=_HARD_TIMEOUT) == [(True, True)] * 4


def _nf4(path: str) -> tuple[bool, bool]:
    from torch.distributed.fsdp import fully_shard

    from fsdptk import save_safetensors_async
    from fsdptk.nf4 import dequantize, to_nf4

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128, bias=False, dtype=torch.bfloat16),
                          nn.Linear(128, 8, dtype=torch.bfloat16))
    weight = to_nf4(model[0].weight.detach())
    model[0].weight = nn.Parameter(weight, requires_grad=False)
    fully_shard(model[0])
    fully_shard(model)
    head = _gathered(model)
    pending = save_safetensors_async(model, path, bucket_bytes=4096)
    with torch.no_grad():
        model[1].weight.add_(1.0)
    out = pending.wait(timeout=60)
    if dist.get_rank() != 0:
        return True, True
    files = load_file(out)
    return torch.equal(files["0.weight"], dequantize(weight)), torch.equal(files["1.weight"], head["1.weight"])


def test_async_save_of_an_nf4_model(world, tmp_path: Path) -> None:
    assert world(2).run(_nf4, str(tmp_path), timeout=_HARD_TIMEOUT) == [(True, True)] * 2

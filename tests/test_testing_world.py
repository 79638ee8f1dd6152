"""The persistent test world itself: results per rank, errors, timeouts, recovery, FSDP2."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptk.testing import RemoteError, World, WorldTimeout


def _rank_info(x: int) -> tuple[int, int, int]:
    return dist.get_rank(), dist.get_world_size(), x * (dist.get_rank() + 1)


def _all_reduce_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.tolist()


def _raise_on(rank: int, msg: str) -> int:
    if dist.get_rank() == rank:
        raise KeyError(msg)
    return dist.get_rank()


def _raise_everywhere() -> None:
    raise ValueError(f"shape mismatch on rank {dist.get_rank()}")


def _sleep_on(rank: int, seconds: float) -> int:
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return os.getpid()


def _half_collective() -> None:
    # rank 0 enters a collective that rank 1 never joins, then rank 1 fails: the classic hang.
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        raise RuntimeError("rank 1 gave up before the collective")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_results_per_rank(world, n: int) -> None:
    assert world(n).run(_rank_info, 3) == [(r, n, 3 * (r + 1)) for r in range(n)]


def test_collectives_and_kwargs(world) -> None:
    res = world(4).run(_all_reduce_sum, values=[1.0, 2.0])
    assert res == [[10.0, 20.0]] * 4


def test_exception_carries_rank_type_and_traceback(world) -> None:
    w = world(2)
    with pytest.raises(RemoteError) as info:
        w.run(_raise_on, 1, "missing key 'lm_head.weight'")
    err = info.value
    assert err.rank == 1 and err.exc_type == "KeyError"
    assert "lm_head.weight" in err.message and "_raise_on" in err.remote_traceback
    assert "rank 1 raised KeyError" in str(err)
    assert err.per_rank[0] == 0 and isinstance(err.per_rank[1], RemoteError)
    assert isinstance(err.original, KeyError)
    # the world is still usable, with the same processes (no restart for a clean failure)
    assert w.run(_rank_info, 1) == [(0, 2, 1), (1, 2, 2)]


def test_return_exceptions_gives_every_rank(world) -> None:
    res = world(2).run(_raise_everywhere, return_exceptions=True)
    assert [type(r) for r in res] == [RemoteError, RemoteError]
    assert [r.rank for r in res] == [0, 1]
    assert all(r.exc_type == "ValueError" for r in res)
    assert "rank 1" in res[1].message


def test_timeout_rebuilds_world() -> None:
    with World(2, timeout=60) as w:
        pids = w.pids
        # a first call under the world's own timeout: on a busy machine the workers' first call
        # (imports, unpickling) can take longer than the short limit below by itself
        assert w.run(_rank_info, 1) == [(0, 2, 1), (1, 2, 2)]
        t0 = time.monotonic()
        with pytest.raises(WorldTimeout, match=r"rank\(s\) \[1\]"):
            w.run(_sleep_on, 1, 60.0, timeout=5)
        assert time.monotonic() - t0 < 30
        assert w.restarts == 1 and w.pids != pids
        assert w.run(_rank_info, 2) == [(0, 2, 2), (1, 2, 4)]


def test_failed_collective_does_not_poison_next_call(world) -> None:
    w = world(2)
    with pytest.raises(RemoteError, match="gave up"):
        w.run(_half_collective)
    assert w.run(_all_reduce_sum, [1.0]) == [[3.0], [3.0]]


def _result_only_the_worker_can_unpickle() -> object:
    import types

    mod = sys.modules.setdefault("_fsdptk_worker_only", types.ModuleType("_fsdptk_worker_only"))
    mod.Thing = type("Thing", (), {"__module__": "_fsdptk_worker_only"})
    return mod.Thing()


def test_unreadable_result_is_an_error_and_does_not_poison_next_call(world) -> None:
    w = world(2)
    with pytest.raises(RemoteError, match="could not unpickle the result") as info:
        w.run(_result_only_the_worker_can_unpickle)
    assert info.value.rank == 0 and isinstance(info.value.per_rank[1], RemoteError)
    # every rank's answer to the failed call was read: the next call gets its own results
    assert w.run(_rank_info, 5) == [(0, 2, 5), (1, 2, 10)]


def test_lambdas_and_closures_run_and_accelerators_are_hidden() -> None:
    factor = 7
    with World(1) as w:
        assert w.run(lambda: factor * 6) == [42]
        # a CPU world on a machine with a GPU must behave as on a CPU-only machine
        assert w.run(lambda: (os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.is_available())) == [
            ("", False)]


@settings(max_examples=60)
@given(
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=8),
)
def test_property_all_reduce_on_reused_world(world, values: list[float]) -> None:
    # 60 examples on a 2-rank world: cheap because the world is reused (one start for all).
    res = world(2).run(_all_reduce_sum, values)
    expected = (torch.tensor(values) * 3).tolist()
    assert res[0] == res[1] == expected


def _fsdp2_round_trip(seed: int) -> dict[str, object]:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    assert isinstance(model, FSDPModule)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    local_rows = model[0].weight.to_local().shape[0]
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"equal": all(full[k].equal(reference[k]) for k in reference), "rows": local_rows,
            "grads": grads, "x": x}


def test_fsdp2_round_trip_two_ranks(world) -> None:
    res = world(2).run(_fsdp2_round_trip, 0)
    assert [r["equal"] for r in res] == [True, True]
    assert [r["rows"] for r in res] == [4, 3]  # 7 rows over 2 ranks: uneven shards
    # gradients are averaged over ranks: compare with one process on both inputs
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    for r in res:
        ref(r["x"]).sum().backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(res[0]["grads"][name], p.grad / 2)
        torch.testing.assert_close(res[1]["grads"][name], p.grad / 2)


def _hsdp_step(extra_groups: int) -> float:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    for _ in range(extra_groups):  # moves torch's group numbering on before the mesh is made
        dist.new_group(list(range(dist.get_world_size())))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return float(model.weight.full_tensor().sum())


def _fail() -> None:
    raise ValueError("expected failure")


def test_meshes_work_after_the_world_rebuilt_its_process_group(world) -> None:
    # regression: a failed call rebuilds the process group, which restarts torch's group
    # numbering; DTensor's caches (mesh equality ignores group names) then handed new meshes
    # group names of the destroyed process group ("Could not resolve the process group ...")
    w = world(4)
    first = w.run(_hsdp_step, 6)
    w.run(_fail, return_exceptions=True)
    assert w.run(_hsdp_step, 0) == first


# ---------------------------------------------------------------------------------------------
# backend= : gloo by default, NCCL on GPUs (validated in the caller, before any worker starts)


def test_default_backend_is_gloo_on_cpu(world) -> None:
    w = world(2)
    assert (w.backend, w.cpu_only) == ("gloo", True)
    # the workers' group is gloo and the accelerators stay hidden, as before backend= existed
    assert w.run(lambda: (dist.get_backend(), os.environ["CUDA_VISIBLE_DEVICES"])) == [("gloo", "")] * 2


def test_explicit_gloo_with_visible_accelerators() -> None:
    with World(1, backend="gloo", cpu_only=False) as w:
        assert (w.backend, w.cpu_only) == ("gloo", False)
        assert w.run(dist.get_backend) == ["gloo"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"backend": "mpi"}, ValueError, r"backend must be one of \('gloo', 'nccl', 'cuda:nccl,cpu:gloo'\), got 'mpi'"),
        ({"backend": "NCCL"}, ValueError, r"got 'NCCL'"),
        ({"backend": "nccl", "cpu_only": True}, ValueError, r"backend='nccl' needs the GPUs: pass cpu_only=False"),
        ({"backend": "cuda:nccl,cpu:gloo", "cpu_only": True}, ValueError,
         r"backend='cuda:nccl,cpu:gloo' needs the GPUs"),
    ],
)
def test_backend_argument_errors(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        World(2, **kwargs)


def test_nccl_needs_cuda_and_one_gpu_per_rank(monkeypatch) -> None:
    import multiprocessing

    started = []
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", lambda self: started.append(self))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"backend='nccl' needs CUDA, but torch.cuda.is_available\(\) is False"):
            World(1, backend="nccl")
    # more ranks than GPUs (on any machine): the message names both counts
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    if not torch.cuda.is_available():  # pretend one GPU, so that the count check is reached
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    n = gpus + 1
    with pytest.raises(RuntimeError, match=rf"world_size {n} needs {n} GPUs, torch.cuda.device_count\(\) is {n - 1}"):
        World(n, backend="nccl")
    assert started == []  # nothing was spawned


def _what_the_worker_inherited() -> tuple[bool, bool, str, int]:
    import gc

    return ("fsdptk.testing._preload" in sys.modules, "peft" in sys.modules, os.environ["CUDA_VISIBLE_DEVICES"],
            gc.get_freeze_count())


def test_cpu_workers_are_forked_from_the_preloaded_server(world) -> None:
    # this module imports neither peft nor the preload module: the workers have them from the fork
    # server (tests/conftest.py sets FSDPTK_WORLD_PRELOAD), with the accelerators hidden and what
    # the server imported frozen (their collections leave it alone)
    assert "peft" in os.environ.get("FSDPTK_WORLD_PRELOAD", "").split(",")
    for preloaded, peft_there, cuda, frozen in world(2).run(_what_the_worker_inherited):
        assert preloaded and peft_there and cuda == ""
        assert frozen > 100_000  # torch, transformers, PEFT: hundreds of thousands of objects


def test_the_preload_module_changes_nothing_outside_the_fork_server() -> None:
    """Imported by any other process (the doctests walk every module of fsdptk), the preload
    module neither hides the accelerators nor freezes the collector's objects."""
    import subprocess

    code = ("import gc, os, fsdptk.testing._preload as p; "
            "print(gc.get_freeze_count(), os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'), p._in_fork_server())")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "unset", "False"], out.stdout


def test_nccl_worlds_and_the_opt_out_spawn(monkeypatch) -> None:
    from fsdptk.testing.world import _start_context

    assert _start_context(cpu_only=False).get_start_method() == "spawn"  # a forked CUDA context is unusable
    monkeypatch.setenv("FSDPTK_WORLD_START", "spawn")
    assert _start_context(cpu_only=True).get_start_method() == "spawn"
    monkeypatch.delenv("FSDPTK_WORLD_START")
    assert _start_context(cpu_only=True).get_start_method() == "forkserver"

"""The failure protocol of every collective call (issue 13, point 4): a failure on any rank, in
any phase, is the same exception on every rank within seconds, naming the failing rank.

Each case fails on ONE rank in the data phase (after the metadata agreement), while that rank stays
alive (it raises, it does not exit). Before the per-bucket status agreement the other ranks blocked
in gloo until the process group timeout, and with shard-on-read rank 0 even returned success. The
rank functions catch the error and report ``(type, message, seconds, model untouched)``; the calls
run under a hard timeout, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from _patching import wrapped_send_local
from torch import nn

from fsdptk.testing import RemoteError

_N = 4  # linear layers: 8 tensors
_HARD_TIMEOUT = 60
_PROMPT = 10.0  # seconds within which every rank must have its error


# ----------------------------------------------------------------------------------------------
# helpers (module level: the workers import them)
def _model(meta: bool = True, shard: bool = True) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta" if meta else "cpu"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(_N)])
    if shard:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model


def _full_sd() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {f"{i}.{n}": torch.randn(s, generator=gen)
            for i in range(_N) for n, s in (("weight", (8, 8)), ("bias", (8,)))}


def _untouched(model: nn.Module) -> bool:
    """A meta model that nothing was assigned to."""
    return all(p.to_local().is_meta if hasattr(p, "to_local") else p.is_meta
               for p in model.parameters())


class _Slice:
    def __init__(self, owner: _Flaky, key: str) -> None:
        self._owner, self._key = owner, key

    def get_shape(self) -> list[int]:
        return list(self._owner.data[self._key].shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> torch.Tensor:
        self._owner.hit(self._key)
        return self._owner.data[self._key][index]


class _Flaky(Mapping[str, torch.Tensor]):
    """A lazy source whose ``fail_at``-th read (counting from 1) fails on ``fail_rank`` only.

    ``how="raise"``: an OSError, the rank stays alive; ``how="exit"``: the process dies.
    """

    def __init__(self, data: dict[str, torch.Tensor], fail_rank: int, fail_at: int,
                 how: str = "raise") -> None:
        self.data, self.fail_rank, self.fail_at, self.how = data, fail_rank, fail_at, how
        self.reads = 0

    def hit(self, key: str) -> None:
        self.reads += 1
        if dist.get_rank() == self.fail_rank and self.reads == self.fail_at:
            if self.how == "exit":
                os._exit(3)
            raise OSError(f"read of {key!r} failed: input/output error")

    def __getitem__(self, key: str) -> torch.Tensor:
        self.hit(key)
        return self.data[key]

    def __contains__(self, key: object) -> bool:  # Mapping's default would count a read
        return key in self.data

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


class _FlakySlices(_Flaky):
    """The same, read shard-on-read: metadata through ``get_slice`` costs no read."""

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.data[key]

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self, key)


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str, float]:
    """Run a collective call from a common start; its error as (type, message, seconds)."""
    dist.barrier()
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def _check(results: list[Any], kind: str, failing_rank: int, *parts: str) -> None:
    """Every rank got the failing rank's error, promptly, and its model is untouched."""
    for rank, res in enumerate(results):
        assert not isinstance(res, RemoteError), (rank, res)  # no hang, no crash
        got, msg, seconds, untouched = res
        assert got == kind, (rank, got, msg)
        assert seconds < _PROMPT, (rank, seconds)
        assert untouched, (rank, "the model was changed")
        for part in parts:
            assert part in msg, (rank, part, msg)
        if rank != failing_rank:
            assert f"on rank {failing_rank}" in msg, (rank, msg)


# ----------------------------------------------------------------------------------------------
# load_from_full_model_state_dict
def _load_flaky(mode: str, fail_rank: int) -> tuple[str, str, float, bool]:
    from fsdptk import load_from_full_model_state_dict

    model, sd = _model(), _full_sd()
    n = len(sd)
    if mode == "slices":  # shard-on-read: the 3rd tensor's slice read fails
        source: Any = _FlakySlices(sd, fail_rank, 3)
    elif mode == "mapping":  # the metadata pass reads every key once, then the 3rd data read fails
        source = _Flaky(sd, fail_rank, n + 3)
    else:  # "bcast": rank 0 reads, then scatters; its 3rd data read fails
        source = _Flaky(sd, fail_rank, n + 3) if dist.get_rank() == 0 else {}
    res = _timed(load_from_full_model_state_dict, model, source, "cpu", release_sd=False,
                 broadcast_from_rank0=mode == "bcast", bucket_bytes=300)
    return (*res, _untouched(model))


def test_shard_on_read_failure_on_one_rank_raises_on_every_rank(world) -> None:
    res = world(2).run(_load_flaky, "slices", 1, timeout=_HARD_TIMEOUT, return_exceptions=True)
    _check(res, "OSError", 1, "read of '1.weight' failed")  # rank 0 does not return success
    assert "reading '1.weight' on rank 1" in res[0][1]  # the key and rank being read


def test_lazy_mapping_raising_on_one_rank_raises_on_every_rank(world) -> None:
    res = world(2).run(_load_flaky, "mapping", 1, timeout=_HARD_TIMEOUT, return_exceptions=True)
    _check(res, "OSError", 1, "read of '1.weight' failed")


def test_rank0_read_failing_mid_scatter_raises_on_every_rank(world) -> None:
    res = world(2).run(_load_flaky, "bcast", 0, timeout=_HARD_TIMEOUT, return_exceptions=True)
    _check(res, "OSError", 0, "read of '1.weight' failed")


def _load_none_on_rank1() -> tuple[str, str, float, bool]:
    from fsdptk import load_from_full_model_state_dict

    model = _model()
    sd = None if dist.get_rank() == 1 else _full_sd()
    return (*_timed(load_from_full_model_state_dict, model, sd, "cpu"), _untouched(model))


def test_full_sd_none_on_one_rank_is_a_type_error_on_every_rank(world) -> None:
    res = world(2).run(_load_none_on_rank1, timeout=_HARD_TIMEOUT, return_exceptions=True)
    _check(res, "TypeError", 1, "full_sd must be a Mapping", "got NoneType")


def _load_via_files(path: str) -> tuple[str, str, float, bool]:
    from fsdptk import load_safetensors
    from fsdptk._engine.sources import RenamedSource

    model = _model()
    inner = RenamedSource.read
    reads = [0]

    def flaky(self: Any, key: str, box: Any = None) -> torch.Tensor:
        if box is not None and not isinstance(self.mapping, RenamedSource):  # a slice of the file
            reads[0] += 1
            if dist.get_rank() == 1 and reads[0] == 3:
                raise OSError("read failed: stale file handle")
        return inner(self, key, box)

    RenamedSource.read = flaky  # the checkpoint under model names (and the tied-alias view over it)
    try:
        res = _timed(load_safetensors, model, path, shard_on_read=True, device="cpu", bucket_bytes=300)
    finally:
        RenamedSource.read = inner
    return (*res, _untouched(model))


def test_load_safetensors_shard_on_read_failure_on_rank1(world, tmp_path) -> None:
    from safetensors.torch import save_file

    save_file(_full_sd(), str(tmp_path / "model.safetensors"))
    res = world(2).run(_load_via_files, str(tmp_path), timeout=_HARD_TIMEOUT, return_exceptions=True)
    _check(res, "OSError", 1, "stale file handle")


# ----------------------------------------------------------------------------------------------
# gather / save
def _loaded_model() -> nn.Module:
    from fsdptk import load_from_full_model_state_dict

    model = _model()
    load_from_full_model_state_dict(model, _full_sd(), "cpu")
    return model


def _gather_failing(fail_rank: int) -> tuple[str, str, float, bool]:
    from fsdptk import gather_cpu_state_dict

    model = _loaded_model()
    calls = [0]

    def flaky(inner):
        def read(layout: Any) -> torch.Tensor:
            calls[0] += 1
            if dist.get_rank() == fail_rank and calls[0] == 3:
                raise RuntimeError("device-side fault while reading a shard")
            return inner(layout)
        return read

    with wrapped_send_local(flaky):
        res = _timed(gather_cpu_state_dict, model, dist.get_rank() == 0, bucket_bytes=300)
    return (*res, True)


def test_one_rank_raising_inside_gather_raises_on_every_rank(world) -> None:
    for fail_rank in (1, 0):  # a sender, and the receiver placing its own shards
        res = world(2).run(_gather_failing, fail_rank, timeout=_HARD_TIMEOUT, return_exceptions=True)
        _check(res, "RuntimeError", fail_rank, "device-side fault")


def _consumer_abandons() -> tuple[str, str, float, bool]:
    from fsdptk import iter_full_state_dict

    model = _loaded_model()

    def consume() -> None:
        for i, _ in enumerate(iter_full_state_dict(model, bucket_bytes=300)):
            if i == 1 and dist.get_rank() == 0:
                raise KeyError("the caller's own code failed")  # no throw(): just leaves

    return (*_timed(consume), True)


def test_caller_leaving_the_gather_lets_the_others_raise(world) -> None:
    res = world(2).run(_consumer_abandons, timeout=_HARD_TIMEOUT, return_exceptions=True)
    assert res[0][0] == "KeyError" and res[0][2] < _PROMPT, res[0]
    kind, msg, seconds, _ = res[1]
    assert kind == "RuntimeError" and seconds < _PROMPT, res[1]
    assert "rank 0 stopped iterating before the end" in msg and "(on rank 0)" in msg, msg


def _save_failing(path: str) -> tuple[tuple[str, str, float, bool], int]:
    from fsdptk import save_safetensors
    from fsdptk._files.safetensors_writer import ShardedWriter

    model = _loaded_model()
    inner, calls = ShardedWriter.write, [0]
    reads = [0]

    def flaky(self: Any, key: str, tensor: torch.Tensor) -> int:
        calls[0] += 1
        if calls[0] == 2:  # only rank 0 writes
            raise OSError(28, "No space left on device")
        return inner(self, key, tensor)

    def counted(inner_read):
        def read(layout: Any) -> torch.Tensor:
            reads[0] += 1
            return inner_read(layout)
        return read

    ShardedWriter.write = flaky
    try:
        with wrapped_send_local(counted):
            res = _timed(save_safetensors, model, path, bucket_bytes=300, max_shard_size=600)
    finally:
        ShardedWriter.write = inner
    return (*res, True), reads[0]


def test_writer_failing_inside_save_safetensors_raises_on_every_rank(world, tmp_path) -> None:
    res = world(2).run(_save_failing, str(tmp_path / "out"), timeout=_HARD_TIMEOUT,
                       return_exceptions=True)
    _check([r[0] for r in res], "OSError", 0, "No space left on device")
    assert not list((tmp_path / "out").glob("*.safetensors*"))  # nothing committed
    # the gather stops at the next bucket (rank 0 failed in bucket 1 of 4): rank 1 does not pack
    # the rest of the model first, so the error is prompt whatever the model's size
    assert res[1][1] <= 4, res[1][1]


# ----------------------------------------------------------------------------------------------
# optimizer pair
def _optim_failing(phase: str) -> tuple[str, str, float, bool]:
    import fsdptk._engine.scatter as scatter
    from fsdptk import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict

    model = _loaded_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    rank0 = dist.get_rank() == 0
    if phase == "load_none":
        osd = get_full_optimizer_state_dict(model, opt, rank0)
        fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
        res = _timed(load_from_full_optimizer_state_dict, model, fresh,
                     None if dist.get_rank() == 1 else osd, "cpu", broadcast_from_rank0=False)
        return (*res, not fresh.state)
    calls = [0]

    def flaky(inner):
        def call(*args: Any) -> Any:
            calls[0] += 1
            if dist.get_rank() == (0 if phase == "load_scatter" else 1) and calls[0] == 3:
                raise MemoryError("cannot allocate the state bucket")
            return inner(*args)
        return call

    if phase == "load_scatter":
        osd = get_full_optimizer_state_dict(model, opt, rank0)
        fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
        inner = scatter._rank0_pieces
        scatter._rank0_pieces = flaky(inner)
        try:
            res = _timed(load_from_full_optimizer_state_dict, model, fresh, osd if rank0 else {},
                         "cpu", broadcast_from_rank0=True, bucket_bytes=300)
        finally:
            scatter._rank0_pieces = inner
        return (*res, not fresh.state)
    with wrapped_send_local(flaky):
        res = _timed(get_full_optimizer_state_dict, model, opt, rank0, bucket_bytes=300)
    return (*res, True)


def test_optimizer_pair_failures_raise_on_every_rank(world) -> None:
    w = world(2)
    _check(w.run(_optim_failing, "load_none", timeout=_HARD_TIMEOUT, return_exceptions=True),
           "TypeError", 1, "full_sd must be a Mapping", "NoneType")
    _check(w.run(_optim_failing, "load_scatter", timeout=_HARD_TIMEOUT, return_exceptions=True),
           "MemoryError", 0, "cannot allocate the state bucket")
    _check(w.run(_optim_failing, "gather", timeout=_HARD_TIMEOUT, return_exceptions=True),
           "MemoryError", 1, "cannot allocate the state bucket")


# ----------------------------------------------------------------------------------------------
# point 11: argument types, replicated tensors that differ between ranks
def _wrong_types() -> dict[str, tuple[str, str]]:
    from fsdptk import (
        gather_cpu_state_dict,
        get_full_optimizer_state_dict,
        load_from_full_model_state_dict,
        load_from_full_optimizer_state_dict,
    )

    out = {}
    model = _model()
    for name, call in {
        "full_sd_list": lambda: load_from_full_model_state_dict(model, [("0.weight", 1)], "cpu"),
        "model_dict": lambda: load_from_full_model_state_dict({"0.weight": 1}, {}, "cpu"),
        "gather_model": lambda: gather_cpu_state_dict("model.pt", True),
        "model_on_rank1": lambda: load_from_full_model_state_dict(
            model if dist.get_rank() == 0 else None, _full_sd(), "cpu"),
        "gather_model_on_rank1": lambda: gather_cpu_state_dict(model if dist.get_rank() == 0 else [], True),
        "optim_gather_on_rank1": lambda: get_full_optimizer_state_dict(
            model, torch.optim.SGD(model.parameters()) if dist.get_rank() == 0 else "sgd", True),
        "optim_load_on_rank1": lambda: load_from_full_optimizer_state_dict(
            model if dist.get_rank() == 0 else 7, torch.optim.SGD(model.parameters()), {}, "cpu"),
    }.items():
        try:
            call()
            out[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e))
    return out


def test_wrong_argument_types_name_the_argument_on_every_rank(world) -> None:
    res = world(2).run(_wrong_types, timeout=_HARD_TIMEOUT)
    expect = {"full_sd_list": ("full_sd must be a Mapping", "got list"),
              "model_dict": ("model must be a torch.nn.Module", "got dict"),
              "gather_model": ("model must be a torch.nn.Module", "got str"),
              "model_on_rank1": ("model must be a torch.nn.Module", "got NoneType", "(on rank 1)"),
              # argument errors of one rank ride in the engine's one metadata exchange (no
              # agreement of their own): still raised on every rank, naming the failing rank
              "gather_model_on_rank1": ("model must be a torch.nn.Module", "got list", "(on rank 1)"),
              "optim_gather_on_rank1": ("opt must be a torch.optim.Optimizer", "got str", "(on rank 1)"),
              "optim_load_on_rank1": ("model must be a torch.nn.Module", "got int", "(on rank 1)")}
    for rank, cases in enumerate(res):
        for name, parts in expect.items():
            kind, msg = cases[name]
            assert kind == "TypeError", (rank, name, kind, msg)
            for part in parts if rank == 0 or not name.endswith("_on_rank1") else parts[:2]:
                assert part in msg, (rank, name, msg)


def _replicated(bcast: bool, differ: bool) -> tuple[str, str, bool, list[float]]:
    from fsdptk import load_from_full_model_state_dict

    model = _model(meta=False, shard=False)  # plain (replicated) tensors on every rank
    before = [p.detach().clone() for p in model.parameters()]
    sd = _full_sd()
    if differ and dist.get_rank() == 1:
        sd["2.bias"] = sd["2.bias"] + 1
    kind, msg = "no error", ""
    try:
        load_from_full_model_state_dict(model, sd, "cpu", broadcast_from_rank0=bcast)
    except ValueError as e:
        kind, msg = type(e).__name__, str(e)
    untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return kind, msg, untouched, model[2].bias.detach().tolist()


def test_replicated_tensors_that_differ_between_ranks(world) -> None:
    w = world(2)
    res = w.run(_replicated, False, True, timeout=_HARD_TIMEOUT)
    for kind, msg, untouched, _ in res:
        assert kind == "ValueError" and untouched, (kind, msg)
        assert "'2.bias': ranks [1] differ from rank 0" in msg and "broadcast_from_rank0=True" in msg
        assert "'2.weight'" not in msg
    res = w.run(_replicated, True, True, timeout=_HARD_TIMEOUT)  # every rank gets rank 0's values
    assert res[0][0] == res[1][0] == "no error" and res[0][3] == res[1][3]
    res = w.run(_replicated, False, False, timeout=_HARD_TIMEOUT)  # same values: no error
    assert res[0][0] == res[1][0] == "no error" and res[0][3] == res[1][3]


# ----------------------------------------------------------------------------------------------
# a rank that dies mid-collective
def _load_dies_on_rank1() -> tuple[str, str, float, bool]:
    from fsdptk import load_from_full_model_state_dict

    model, sd = _model(), _full_sd()
    source = _FlakySlices(sd, 1, 3, how="exit")
    res = _timed(load_from_full_model_state_dict, model, source, "cpu", release_sd=False,
                 bucket_bytes=300)
    return (*res, _untouched(model))


def test_rank_killed_mid_collective_gives_the_survivor_a_clear_error(world) -> None:
    w = world(2)
    restarts = w.restarts
    res = w.run(_load_dies_on_rank1, timeout=_HARD_TIMEOUT, return_exceptions=True)
    assert isinstance(res[1], RemoteError) and res[1].exc_type == "WorkerDied", res[1]
    kind, msg, seconds, untouched = res[0]
    assert kind == "RuntimeError" and seconds < _PROMPT and untouched, res[0]
    assert "communication with the other ranks failed on rank 0" in msg, msg
    assert "Lost: rank 1 did not answer a roll call" in msg, msg
    assert w.restarts == restarts + 1  # the World rebuilt itself: the next call works
    assert w.run(_model_ok, timeout=_HARD_TIMEOUT) == [True, True]


def _model_ok() -> bool:
    return not _untouched(_loaded_model())


# ----------------------------------------------------------------------------------------------
# DCP: the local steps between DCP's own collectives
def _dcp_failing(path: str, phase: str) -> tuple[str, str, float, bool]:
    from fsdptk import load_dcp, save_dcp

    model = _loaded_model()
    if phase == "load":
        save_dcp(model, path)

    def fail(*_: Any, **__: Any) -> None:
        raise RuntimeError("state_dict hook failed")

    if dist.get_rank() == 1:
        if phase == "save":
            model.register_state_dict_pre_hook(fail)
        else:
            model.register_load_state_dict_pre_hook(fail)
    if phase == "save":
        return (*_timed(save_dcp, model, path, extra={"step": 1}), True)
    return (*_timed(load_dcp, model, path), True)


def test_dcp_local_failure_on_one_rank_raises_on_every_rank(world, tmp_path) -> None:
    w = world(2)
    _check(w.run(_dcp_failing, str(tmp_path / "save"), "save", timeout=_HARD_TIMEOUT,
                 return_exceptions=True), "RuntimeError", 1, "state_dict hook failed")
    _check(w.run(_dcp_failing, str(tmp_path / "load"), "load", timeout=_HARD_TIMEOUT,
                 return_exceptions=True), "RuntimeError", 1, "state_dict hook failed")

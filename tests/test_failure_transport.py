"""The failure protocol at the transport (issue 22): a rank whose post of a point-to-point message
fails while it stays alive, and source tensors that cannot be read.

A post (``torch.distributed.isend`` / ``irecv``, what the engine calls once a bucket's status is
agreed) raises an injected ``OSError`` on ONE rank, at its 2nd post of the call: a large (direct)
piece of the first bucket, after that bucket's flat buffer was posted and with more messages of the
bucket still owed. The failing rank raises and stays alive (the worker catches the error and goes on,
as a training loop that survives a failed checkpoint does). Every rank must raise that rank's error
within seconds (before: the peer waited on its posted transfer until the failing process exited, or
until the process-group timeout), with the model and optimizer untouched, and the ranks must be
able to run the next collective call (no message of the failed call left pending).

In every call: the model load from rank 0 (scatter), the model gather, the optimizer load from rank 0
and gather, ``save_safetensors``; each in both directions (the sender's post fails, the receiver's
post fails). The calls run under a hard timeout, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdptk.testing import RemoteError

_HARD_TIMEOUT = 40
_PROMPT = 10.0  # seconds within which every rank must have its error
_N = 3  # layers; a weight (512 x 512 fp32) shards into 512 KiB pieces: each travels alone (direct)
_MSG = "injected: post failed: input/output error"


# ----------------------------------------------------------------------------------------------
# helpers (module level: the workers import them)
def _model(meta: bool = True) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta" if meta else "cpu"):
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(_N)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _full_sd() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {f"{i}.{n}": torch.randn(s, generator=gen)
            for i in range(_N) for n, s in (("weight", (512, 512)), ("bias", (512,)))}


def _loaded() -> nn.Module:
    from fsdptk import load_from_full_model_state_dict

    model = _model()
    load_from_full_model_state_dict(model, _full_sd(), "cpu")
    return model


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 512)).sum().backward()
    opt.step()
    return opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """Copies of every local parameter shard and optimizer state tensor."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    out = [local(p) for p in model.parameters()]
    if opt is not None:
        out += [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _meta(model: nn.Module) -> bool:
    """A meta model that nothing was assigned to."""
    return all(p.to_local().is_meta for p in model.parameters())


@contextmanager
def _failing_post(op: str, rank: int, nth: int = 2) -> Iterator[list[int]]:
    """Within the block, this rank's ``nth`` call of ``torch.distributed.<op>`` (``isend`` or
    ``irecv``) raises an OSError before anything is posted; every other call goes through."""
    real = getattr(dist, op)
    calls = [0]

    def post(*args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == rank:
            calls[0] += 1
            if calls[0] == nth:
                raise OSError(_MSG)
        return real(*args, **kwargs)

    setattr(dist, op, post)
    try:
        yield calls
    finally:
        setattr(dist, op, real)


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str, float]:
    """Run a collective call from a common start; its error as (type, message, seconds)."""
    dist.barrier()
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def _still_works() -> bool:
    """The next collective calls of this world work (nothing of the failed call is left pending):
    a load from rank 0 and a gather, with the right values."""
    from fsdptk import gather_cpu_state_dict, load_from_full_model_state_dict

    model, sd = _model(), _full_sd()
    load_from_full_model_state_dict(model, sd if dist.get_rank() == 0 else {}, "cpu",
                                    broadcast_from_rank0=True, bucket_bytes=1024)
    got = gather_cpu_state_dict(model, dist.get_rank() == 0, bucket_bytes=1024)
    want = _full_sd()  # (the load released the entries of ``sd``)
    return dist.get_rank() != 0 or (got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want))


# ----------------------------------------------------------------------------------------------
# the calls, each with one rank's post failing
def _call(call: str, op: str, fail_rank: int, path: str) -> tuple[str, str, float, bool, int, bool]:
    """``(type, message, seconds, untouched, posts seen by the failing rank, still works)``."""
    from fsdptk import (
        gather_cpu_state_dict,
        get_full_optimizer_state_dict,
        load_from_full_model_state_dict,
        load_from_full_optimizer_state_dict,
        save_safetensors,
    )

    rank0 = dist.get_rank() == 0
    if call == "load":
        model = _model()
        with _failing_post(op, fail_rank) as posts:
            res = _timed(load_from_full_model_state_dict, model, _full_sd() if rank0 else {}, "cpu",
                         broadcast_from_rank0=True, bucket_bytes=1024)
        untouched = _meta(model)
    elif call == "optim_load":
        model = _loaded()
        opt = _trained(model)
        osd = get_full_optimizer_state_dict(model, opt, rank0)
        fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
        before = _snapshot(model)
        with _failing_post(op, fail_rank) as posts:
            res = _timed(load_from_full_optimizer_state_dict, model, fresh, osd if rank0 else {}, "cpu",
                         broadcast_from_rank0=True, bucket_bytes=1024)
        untouched = not fresh.state and _same(before, _snapshot(model))
    else:
        model = _loaded()
        opt = _trained(model)
        before = _snapshot(model, opt)
        with _failing_post(op, fail_rank) as posts:
            if call == "gather":
                res = _timed(gather_cpu_state_dict, model, rank0, bucket_bytes=1024)
            elif call == "optim_gather":
                res = _timed(get_full_optimizer_state_dict, model, opt, rank0, bucket_bytes=1024)
            else:  # "save": 2.1 MiB buckets: two weights and two biases in the first one
                res = _timed(save_safetensors, model, path, bucket_bytes=2100 * 1024)
        untouched = _same(before, _snapshot(model, opt))
    return (*res, untouched, posts[0], _still_works())


_CASES = [(call, op, rank) for call in ("load", "optim_load") for op, rank in (("isend", 0), ("irecv", 1))]
_CASES += [(call, op, rank) for call in ("gather", "optim_gather", "save") for op, rank in (("isend", 1), ("irecv", 0))]


@pytest.mark.parametrize("call,op,fail_rank", _CASES, ids=[f"{c}-{o}-rank{r}" for c, o, r in _CASES])
def test_a_post_failing_on_one_live_rank_raises_on_every_rank(world, tmp_path, call, op, fail_rank) -> None:
    res = world(2).run(_call, call, op, fail_rank, str(tmp_path / "out"), timeout=_HARD_TIMEOUT,
                       return_exceptions=True)
    for rank, r in enumerate(res):
        assert not isinstance(r, RemoteError), (rank, r)  # no hang; the failing rank is alive
        kind, msg, seconds, untouched, _posts, works = r
        assert kind == "OSError" and _MSG in msg, (rank, kind, msg)
        assert seconds < _PROMPT, (rank, seconds)
        assert untouched, (rank, "the model or the optimizer was changed")
        assert works, (rank, "the next collective call failed")
        if rank != fail_rank:
            assert f"(on rank {fail_rank})" in msg, (rank, msg)
    assert res[fail_rank][4] >= 2, res[fail_rank]  # the injected post was reached
    if call == "save":
        assert not list((tmp_path / "out").glob("*.safetensors*"))  # nothing committed


# ----------------------------------------------------------------------------------------------
# source tensors that cannot be read: refused in the metadata agreement, naming the key
def _unreadable(what: str, bcast: bool, bad_rank: int) -> tuple[str, str, float, bool]:
    from fsdptk import load_from_full_model_state_dict

    model, sd = _model(), _full_sd()
    if dist.get_rank() == bad_rank:
        sd["1.weight"] = (torch.empty(512, 512, device="meta") if what == "meta"
                          else sd["1.weight"].to_sparse())
    if bcast and dist.get_rank() != 0:
        sd = {}
    res = _timed(load_from_full_model_state_dict, model, sd, "cpu", broadcast_from_rank0=bcast)
    return (*res, _meta(model))


@pytest.mark.parametrize("what,bcast,bad_rank", [("meta", True, 0), ("sparse", True, 0), ("meta", False, 1)])
def test_unreadable_source_tensors_are_refused_naming_the_key(world, what, bcast, bad_rank) -> None:
    res = world(2).run(_unreadable, what, bcast, bad_rank, timeout=_HARD_TIMEOUT, return_exceptions=True)
    for rank, r in enumerate(res):
        assert not isinstance(r, RemoteError), (rank, r)
        kind, msg, seconds, untouched = r
        assert kind == "ValueError", (rank, kind, msg)
        assert "'1.weight'" in msg and ("meta device" if what == "meta" else "sparse") in msg, (rank, msg)
        assert seconds < _PROMPT and untouched, (rank, seconds, untouched)
        if not bcast:
            assert f"rank {bad_rank}: '1.weight'" in msg, (rank, msg)


def _optim_unreadable() -> tuple[str, str, float, bool]:
    from fsdptk import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict

    model = _loaded()
    opt = _trained(model)
    osd = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    if dist.get_rank() == 0:
        osd["state"]["1.weight"]["exp_avg"] = torch.empty(512, 512, device="meta")
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    res = _timed(load_from_full_optimizer_state_dict, model, fresh, osd, "cpu", broadcast_from_rank0=True)
    return (*res, not fresh.state)


def test_unreadable_optimizer_state_is_refused_naming_the_key(world) -> None:
    res = world(2).run(_optim_unreadable, timeout=_HARD_TIMEOUT, return_exceptions=True)
    for rank, r in enumerate(res):
        assert not isinstance(r, RemoteError), (rank, r)
        kind, msg, seconds, untouched = r
        assert kind == "ValueError" and "1.weight" in msg and "exp_avg" in msg and "meta device" in msg, (rank, msg)
        assert seconds < _PROMPT and untouched, (rank, seconds, untouched)

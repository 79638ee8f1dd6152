"""A rank that dies in the middle of a weight source's stream (issue 41, "a rank that dies
mid-stream makes the others raise within seconds"): the process ends (``os._exit``) while the
others are iterating, as a trainer rank killed by the out-of-memory killer or a preemption would.
Every survivor raises a RuntimeError within seconds (not a collective timeout) naming the lost rank,
or, when rank 0 dies (it holds the rendezvous store, as under torchrun), saying that the store's host
is unreachable; whether the dead rank is an owner consuming its buckets or a rank that only sends.
The pool's World rebuilds itself and the next stream works."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fsdptk.testing import RemoteError

_HARD_TIMEOUT = 60
_PROMPT = 10.0  # seconds within which every survivor must have raised


def _model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _stream_dies(owners: int, dying: int) -> tuple[str, str, float, int]:
    import os

    from fsdptk.hf import weight_source

    source = weight_source(_model(), conversion=None, owners=owners, bucket_bytes=64 * 1024)
    rank = dist.get_rank()
    start, seen = time.monotonic(), 0
    try:
        for i, bucket in enumerate(source.iter_buckets()):
            seen += len(bucket)
            if rank == dying and i == 3:
                os._exit(3)  # killed mid-stream: no exception, no goodbye
            time.sleep(0.01)  # an engine's send between buckets
    except Exception as e:  # noqa: BLE001 - compared by the test
        return type(e).__name__, str(e), time.monotonic() - start, seen
    return "no error", "", time.monotonic() - start, seen


def _stream_ok() -> int:
    from fsdptk.hf import weight_source

    return sum(len(b) for b in weight_source(_model(), conversion=None, owners=4).iter_buckets())


@pytest.mark.parametrize(("owners", "dying"), [(1, 0), (4, 3)], ids=["the-owner-dies", "one-of-four-owners-dies"])
def test_a_rank_dying_mid_stream_makes_every_other_rank_raise_within_seconds(world, owners, dying) -> None:
    w = world(4)
    restarts = w.restarts
    res = w.run(_stream_dies, owners, dying, timeout=_HARD_TIMEOUT, return_exceptions=True)
    assert isinstance(res[dying], RemoteError) and res[dying].exc_type == "WorkerDied", res[dying]
    for rank, r in enumerate(res):
        if rank == dying:
            continue
        kind, message, seconds, _ = r
        assert kind == "RuntimeError", (rank, r)
        assert "communication with the other ranks failed" in message, (rank, message)
        if dying == 0:  # rank 0 holds the rendezvous store: the roll call itself is lost, and says so
            assert "the host that holds it (under torchrun, the first host) is most likely lost too" in message, (
                rank, message)
        else:
            assert f"rank {dying}" in message, (rank, message)
        assert seconds < _PROMPT, (rank, r)
    assert w.restarts == restarts + 1  # the World rebuilt itself
    assert w.run(_stream_ok, timeout=_HARD_TIMEOUT) == [4] * 4  # 16 tensors, 4 owned by each rank

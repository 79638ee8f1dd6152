"""The consumer contract of fsdptk's other streaming generators (issue 49), on real gloo ranks:
:func:`fsdptk.iter_full_state_dict` and :func:`fsdptk.iter_full_optimizer_state`, like the passes
of :func:`fsdptk.hf.weight_source` (tests/test_consumer_contract.py).

A consumer that leaves a stream on one rank only (it raises inside its loop, ``break``s out of it,
or calls ``.close()``) still takes part in the engine's next agreement on that rank, so every other
rank raises a RuntimeError naming it within seconds (not at the process group's timeout), and the
next stream works. Here something keeps the frames of the abandoned generators alive (as a
debugger, a profiler or a kept traceback does): only an explicit ``close()`` of the engine's
generator reaches that agreement then, not the release of the last reference to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

_PROMPT = 10.0  # seconds within which every rank must have raised (a hang waits for the call timeout)
_CALL_TIMEOUT = 60  # shorter than a collective's timeout in the test world: a hang fails the test
_BUCKET = 300  # bytes: one 8 x 8 fp32 weight (256 bytes) per bucket, so a stream has several buckets


def _fsdp_model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _stream(kind: str) -> tuple[Callable[[], Iterator[list[tuple[str, Any]]]], list[str]]:
    """A fresh stream of ``kind`` ("state" or "optimizer") and the names its full pass yields."""
    from fsdptk import iter_full_optimizer_state, iter_full_state_dict

    model = _fsdp_model()
    names = [f"{i}.{n}" for i in range(4) for n in ("weight", "bias")]
    if kind == "state":
        return lambda: iter_full_state_dict(model, bucket_bytes=_BUCKET), names
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # exp_avg and exp_avg_sq for every parameter: 16 state tensors
    return lambda: iter_full_optimizer_state(model, opt, bucket_bytes=_BUCKET), names


def _held(gen: Iterator[Any], frames: list[Any]) -> Iterator[Any]:
    """``gen`` started, its frame and those of the generators it delegates to (``yield from``)
    kept in ``frames``, with their locals: what a debugger, a profiler or a kept traceback of the
    suspended stack holds. The caller keeps no reference to ``gen`` itself."""
    first = next(gen)
    g: Any = gen
    while g is not None and getattr(g, "gi_frame", None) is not None:
        frames.append(g.gi_frame)
        g = g.gi_yieldfrom
    yield first
    yield from gen


def _leave_on_one_rank(kind: str, stopper: int, how: str) -> dict:
    start, names = _stream(kind)
    rank = dist.get_rank()
    frames: list[Any] = []  # kept until the next stream has ended
    outcome = None
    seen = 0
    t0 = time.monotonic()
    try:
        if how == "close":
            it = _held(start(), frames)
            for _ in it:
                seen += 1
                if rank == stopper and seen == 2:
                    it.close()  # the rest of the loop sees the end of the stream
            del it
        else:
            for _ in _held(start(), frames):  # no name holds the generator: leaving the loop drops it
                seen += 1
                if rank == stopper and seen == 2:
                    if how == "raise":
                        raise KeyError("the consumer failed")
                    break
    except Exception as e:  # noqa: BLE001 - what each rank raised
        outcome = (type(e).__name__, str(e))
        frames.append(e.__traceback__)
    elapsed = time.monotonic() - t0
    again = [fqn for bucket in start() for fqn, _ in bucket]  # the next stream is whole
    return {"outcome": outcome, "elapsed": elapsed, "seen": seen, "held": len(frames),
            "again_ok": again == (names if rank == 0 else [])}


@pytest.mark.parametrize("how", ["raise", "break", "close"])
@pytest.mark.parametrize(("kind", "stopper"), [("state", 1), ("state", 0), ("optimizer", 1), ("optimizer", 0)])
def test_a_consumer_leaving_a_stream_on_one_rank_fails_every_other_rank_at_once(world, kind, stopper,
                                                                                how) -> None:
    results = world(2).run(_leave_on_one_rank, kind, stopper, how, timeout=_CALL_TIMEOUT)
    for rank, r in enumerate(results):
        assert r["held"] >= 1, r  # the frames really were kept
        if rank == stopper:
            assert r["outcome"] == (("KeyError", "'the consumer failed'") if how == "raise" else None), r
            assert r["seen"] == 2, r
        else:
            assert r["outcome"] is not None and r["outcome"][0] == "RuntimeError", r
            message = r["outcome"][1]
            assert f"rank {stopper} stopped iterating before the end" in message, r
            assert f"(on rank {stopper})" in message, r
        assert r["elapsed"] < _PROMPT, r
        assert r["again_ok"], r

"""The roll call that names lost ranks (fsdptk._core.peers), on a real process group's store.

The full path (a host killed mid-load, every survivor raising within seconds and naming the lost
ranks, rank 0 included while its transfer to the dead host is half-written) runs on simulated hosts
in tests/test_hosts.py; here the roll call itself: who is named, and that old answers do not count.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from fsdptk._core.peers import FRESH_S, ROLL_CALL_S, _answers, _key, roll_call


def _roll_call_of_four() -> tuple[str, float]:
    """Both ranks of a 2-rank world take a roll call of 4 ranks: ranks 2 and 3 never answer,
    though an answer of theirs from an earlier failure (a minute old) is in the store."""
    from fsdptk._core.compat import default_store

    store = default_store()
    if dist.get_rank() == 0:
        store.append(_key(None), f"2@{time.time() - 60:.3f};3@{time.time() - 60:.3f};")
    dist.barrier()
    t0 = time.perf_counter()
    message = roll_call(None, 4, dist.get_rank())
    return message, time.perf_counter() - t0


def test_roll_call_names_the_ranks_that_do_not_answer(world) -> None:
    res = world(2).run(_roll_call_of_four, timeout=60)
    for message, seconds in res:
        assert "Lost: rank 2 and rank 3 did not answer a roll call" in message, message
        assert ROLL_CALL_S - 0.2 <= seconds < ROLL_CALL_S + 1.0


def _roll_call_of_two() -> tuple[str, float]:
    group = dist.new_group(backend="gloo")  # a key of its own: no answers from the test above
    t0 = time.perf_counter()
    message = roll_call(group, 2, dist.get_rank())
    return message, time.perf_counter() - t0


def test_roll_call_ends_early_when_every_rank_answers(world) -> None:
    for message, seconds in world(2).run(_roll_call_of_two, timeout=60):
        assert message.startswith("Every rank answered a roll call"), message
        assert seconds < ROLL_CALL_S


def test_answers_keep_the_fresh_ones_only() -> None:
    now = time.time()
    raw = f"0@{now - FRESH_S - 5:.3f};1@{now:.3f};0@{now - 1:.3f};junk;2@;"
    assert _answers(raw.encode(), now - FRESH_S) == {1: round(now, 3), 0: round(now - 1, 3)}
    assert _answers(f"0@{now - 60:.3f};", now - FRESH_S) == {}



def _waits_right_after_a_roll_call() -> tuple[str, list[int], list[int]]:
    """Both ranks take a roll call (every rank answers: a failure the job then went on from); right
    after, well within FRESH_S, what a wait of this process would count as reports, and what the
    plain FRESH_S window would have counted."""
    from fsdptk._core.peers import _reported, _since

    group = dist.new_group(backend="gloo")
    message = roll_call(group, 2, dist.get_rank())
    dist.barrier()
    now = time.time()
    return message, _reported(group, _since(group, now)), _reported(group, now - FRESH_S)


def test_a_roll_call_the_job_went_on_from_does_not_fail_later_waits(world) -> None:
    for message, counted, in_window in world(2).run(_waits_right_after_a_roll_call, timeout=60):
        assert message.startswith("Every rank answered a roll call"), message
        assert in_window == [0, 1]  # the old answers are in the store, within FRESH_S
        assert counted == []  # but a later wait of a rank that took that roll call ignores them

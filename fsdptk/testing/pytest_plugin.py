"""pytest plugin: a session-scoped ``world`` fixture giving persistent multi-process worlds.

Registered through the ``pytest11`` entry point, so any project that installs fsdptk can write::

    def test_sum(world):
        assert world(2).run(my_fn) == [...]

``world(n)`` returns the shared :class:`~fsdptk.testing.World` of ``n`` ranks, started on first use
and closed at the end of the session. Set ``FSDPTK_TEST_TIMEOUT`` to change the default per-call
timeout (seconds).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fsdptk.testing.world import World


@pytest.fixture(scope="session")
def world() -> Iterator[Callable[[int], World]]:
    """Factory fixture: ``world(n)`` -> the session's persistent World of ``n`` ranks."""
    from fsdptk.testing.world import World

    worlds: dict[int, World] = {}
    timeout = float(os.environ.get("FSDPTK_TEST_TIMEOUT", "180"))

    def get(n: int) -> World:
        if n not in worlds:
            worlds[n] = World(n, timeout=timeout)
        return worlds[n]

    yield get
    for w in worlds.values():
        w.close()

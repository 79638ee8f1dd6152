"""Wrap what the engine's gather reads: ``send_local()`` of every layout class (a shard read on a
sender, rank 0 placing its own shards), to make a read fail or count the reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Read = Callable[[Any], Any]


@contextmanager
def wrapped_send_local(wrap: Callable[[Read], Read]) -> Iterator[None]:
    """Within the block, ``Layout.send_local`` and every override of it is ``wrap(original)``
    (``wrap`` gets and returns ``fn(layout) -> tensor``); the originals come back after."""
    from fsdptk._engine import layouts

    real = {cls: vars(cls)["send_local"] for cls in vars(layouts).values()
            if isinstance(cls, type) and issubclass(cls, layouts.Layout) and "send_local" in vars(cls)}
    for cls, fn in real.items():
        cls.send_local = wrap(fn)
    try:
        yield
    finally:
        for cls, fn in real.items():
            cls.send_local = fn

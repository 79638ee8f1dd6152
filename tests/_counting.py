"""Count real calls of torch.distributed functions (the tests of issue 14's fixed costs)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as dist

OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


@contextmanager
def counted(names: Sequence[str]) -> Iterator[list[str]]:
    """Within the block, every call of ``torch.distributed.<name>`` for ``name`` in ``names`` goes
    through and is appended to the yielded list (in call order); the originals come back after."""
    calls: list[str] = []
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*a, **k):
            calls.append(name)
            return real[name](*a, **k)
        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, f in real.items():
            setattr(dist, name, f)

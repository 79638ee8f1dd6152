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


@contextmanager
def file_reads() -> Iterator[list[tuple[str, tuple[int, ...], int]]]:
    """Within the block, every read the engine makes from a safetensors file (through its slice
    source) is appended to the yielded list as ``(checkpoint key, shape read, bytes)``."""
    from fsdptk._engine import sources

    seen: list[tuple[str, tuple[int, ...], int]] = []
    real = sources.SliceSource.read

    def counting(self, key, box=None):
        out = real(self, key, box)
        seen.append((key, tuple(out.shape), out.numel() * out.element_size()))
        return out

    sources.SliceSource.read = counting
    try:
        yield seen
    finally:
        sources.SliceSource.read = real


def raised(fn, *args) -> tuple[str, str]:
    """``(exception class name, message)`` of ``fn(*args)``, or ``("no error", "")``: what a rank
    raised, for tests that compare every rank's error."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the caller compares what every rank raised
        return type(e).__name__, str(e)
    return "no error", ""

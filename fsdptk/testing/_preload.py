"""Imported once by the fork server that starts :class:`~fsdptk.testing.World`'s CPU workers.

Every gloo-on-CPU worker is forked from that server, so a world's start (and its rebuild after a
killed rank or a timeout) costs a fork instead of a fresh interpreter importing torch: about 0.1 s
instead of 1.5 s of CPU per worker, and nothing for the modules named in ``FSDPTK_WORLD_PRELOAD``
(a comma-separated list, e.g. ``transformers,peft``: imported here once, inherited by every
worker). Accelerators are hidden before torch is imported, as a spawned CPU worker hides them.

What was imported is then frozen (``gc.freeze()``, as Python's ``gc`` documentation advises before
``fork()`` without ``exec()``): a worker's collections examine only the objects it made. Unfrozen,
every full collection in every worker (``fsdptk.hf.from_pretrained`` runs one per call) walked the
whole inherited heap, torch's, transformers' and PEFT's objects, and wrote into each of them, so
each worker copied those pages from the server: measured with py-spy on tests/test_weight_source.py,
over half of its CPU time was that one ``gc.collect()``. The workers therefore start with a frozen
count above zero, as a process whose owner froze its objects: ``from_pretrained`` pauses the
collector during its load there instead of freezing (see ``fsdptk.hf.pretrained._gc_quiet``).

All of it happens only in the fork server: imported anywhere else (``pkgutil.walk_packages`` over
fsdptk, as the doctests do), the module changes nothing, neither the environment nor the collector.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from types import FrameType


def _in_fork_server() -> bool:
    """Whether this import runs inside multiprocessing's fork server (its ``main``, preloading)."""
    suffix = os.path.join("multiprocessing", "forkserver.py")
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith(suffix):
            return True
        frame = frame.f_back
    return False


def _preload() -> None:
    from fsdptk.testing.world import _HIDE_ACCELERATORS

    os.environ.update(_HIDE_ACCELERATORS)
    import torch  # after the accelerators are hidden
    import torch.distributed  # noqa: F401

    for name in filter(None, (n.strip() for n in os.environ.get("FSDPTK_WORLD_PRELOAD", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError:  # an optional module this environment lacks: the workers import what they use
            pass
    del torch
    gc.collect()  # what the imports left behind, before the rest is frozen
    gc.freeze()


if _in_fork_server():
    _preload()

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
"""

from __future__ import annotations

import gc
import importlib
import os

from fsdptk.testing.world import _HIDE_ACCELERATORS

os.environ.update(_HIDE_ACCELERATORS)

import torch  # noqa: E402 - after the accelerators are hidden
import torch.distributed  # noqa: E402,F401

for _name in filter(None, (n.strip() for n in os.environ.get("FSDPTK_WORLD_PRELOAD", "").split(","))):
    try:
        importlib.import_module(_name)
    except ImportError:  # an optional module this environment lacks: the workers import what they use
        pass

del torch

gc.collect()  # what the imports left behind, before the rest is frozen
gc.freeze()

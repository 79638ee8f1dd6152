"""Imported once by the fork server that starts :class:`~fsdptk.testing.World`'s CPU workers.

Every gloo-on-CPU worker is forked from that server, so a world's start (and its rebuild after a
killed rank or a timeout) costs a fork instead of a fresh interpreter importing torch: about 0.1 s
instead of 1.5 s of CPU per worker, and nothing for the modules named in ``FSDPTK_WORLD_PRELOAD``
(a comma-separated list, e.g. ``transformers,peft``: imported here once, inherited by every
worker). Accelerators are hidden before torch is imported, as a spawned CPU worker hides them.
"""

from __future__ import annotations

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

"""Tools for real multi-process tests of FSDP2 code on a CPU.

- :class:`World`: persistent gloo workers that run picklable functions on every rank.
- :mod:`fsdptk.testing.strategies`: hypothesis strategies for random module trees and state dicts.
- :class:`Hosts` (:mod:`fsdptk.testing.hosts`): simulated hosts (network namespaces, shaped links,
  ``torchrun`` per host, the bytes each host's link moved); needs root.
- :mod:`fsdptk.testing.pytest_plugin`: the session-scoped ``world`` fixture (registered
  automatically as a pytest plugin when fsdptk is installed).
"""

from __future__ import annotations

from fsdptk.testing.hosts import (
    HostRun,
    Hosts,
    HostsUnavailable,
    Launch,
    LinkStats,
    hosts_unavailable,
    link_stats,
)
from fsdptk.testing.world import RemoteError, World, WorldTimeout

__all__ = ["World", "RemoteError", "WorldTimeout", "Hosts", "HostRun", "Launch", "LinkStats",
           "HostsUnavailable", "hosts_unavailable", "link_stats"]

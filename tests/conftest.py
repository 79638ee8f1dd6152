"""Suite-wide settings. The ``world`` fixture comes from fsdptk's pytest plugin (fsdptk.testing)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Multi-process properties are slow per example: no deadline, and hypothesis must not complain that
# a session-scoped fixture is shared across examples.
settings.register_profile(
    "fsdptk",
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("ci", parent=settings.get_profile("fsdptk"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "fsdptk")

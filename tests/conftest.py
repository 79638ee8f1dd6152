"""Suite-wide settings. The ``world`` fixture comes from fsdptk's pytest plugin (fsdptk.testing)."""

from __future__ import annotations

import os

import pytest
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` (registered in pyproject.toml) where CUDA is not available.

    ``python -m pytest -m gpu`` selects exactly those tests (see docs/testing.md, "GPU checks").
    """
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); on a GPU "
                                   "machine run: python -m pytest -m gpu")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory):
    """``family`` -> the ``save_pretrained`` directory of a tiny transformers model of that family
    (tests/_tiny_hub.py), written once per session; the tests only read it."""
    from _tiny_hub import hub_dir

    made: dict[str, object] = {}

    def get(family: str):
        if family not in made:
            made[family] = hub_dir(tmp_path_factory.mktemp(family), family)
        return made[family]

    return get

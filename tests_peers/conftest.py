"""The torchtune parity suite runs in the peers environment, never in ``.venv``.

    bash benchmarks/setup_peers.sh && .venv-peers/bin/python -m pytest -q tests_peers

(``scripts/test.sh`` and ``.ci/run`` do both.) The ``world`` fixture comes from fsdptk's pytest
plugin, registered by the editable install of fsdptk in that environment.
"""

from __future__ import annotations

import importlib.metadata as md

import pytest

try:
    _TORCHTUNE = md.version("torchtune")
except md.PackageNotFoundError as e:  # pragma: no cover - wrong environment
    raise pytest.UsageError(
        "tests_peers needs torchtune 0.6.1: run `bash benchmarks/setup_peers.sh` and then "
        "`.venv-peers/bin/python -m pytest tests_peers`"
    ) from e
if _TORCHTUNE != "0.6.1":  # pragma: no cover - wrong environment
    raise pytest.UsageError(f"tests_peers pins torchtune 0.6.1, found {_TORCHTUNE}")

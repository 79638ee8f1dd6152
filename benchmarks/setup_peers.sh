#!/usr/bin/env bash
# Create ./.venv-peers: the environment the benchmark suite and the torchtune parity tests
# (tests_peers/) run in, with the peers fsdptk is compared against (torchtune 0.6.1, accelerate)
# beside an editable fsdptk, plus matplotlib for the plots and pytest for the tests.
# Kept apart from ./.venv so the peers' pins never touch the project's own environment.
#
# Usage: bash benchmarks/setup_peers.sh        (safe to run again: pip skips what is installed)
# Then:  .venv-peers/bin/python -m benchmarks --quick
#        .venv-peers/bin/python -m pytest -q tests_peers
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's editable install writes fsdptk.egg-info into the checkout: one at a time, as scripts/test.sh
# sets up several environments at once
one_at_a_time() { if command -v flock >/dev/null 2>&1; then flock "${TMPDIR:-/tmp}/fsdptk-editable-install.lock" "$@"; else "$@"; fi; }
PY="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x .venv-peers/bin/python ]; then
    "$PY" -m venv .venv-peers
fi
VPY=.venv-peers/bin/python
# The CPU build of torch; an index with CUDA builds would pull several GB of CUDA wheels instead.
"$VPY" -m pip install -q torch==2.13.0
# torchtune 0.6.1 declares torchao without a pin; torchao 0.14.1 is the release torchtune 0.6.1
# imports cleanly with (newer releases moved modules it imports), so it is installed without deps.
"$VPY" -m pip install -q torchtune==0.6.1
"$VPY" -m pip install -q --no-deps torchao==0.14.1
"$VPY" -m pip install -q accelerate safetensors numpy psutil matplotlib
"$VPY" -m pip install -q pytest pytest-timeout hypothesis cloudpickle
one_at_a_time "$VPY" -m pip install -q --no-deps -e .
"$VPY" - <<'PY'
import importlib.metadata as md
missing = []
for name in ("torch", "torchtune", "torchao", "accelerate", "safetensors", "matplotlib", "pytest",
             "hypothesis", "fsdptk"):
    try:
        print(f"[setup_peers] {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"[setup_peers] {name} MISSING")
        missing.append(name)
# torchtune imports torchao's NF4 at import time: fail here, not in the middle of a test run
import torchtune.training  # noqa: E402,F401
if missing:
    raise SystemExit(f"[setup_peers] missing after install: {missing}")
PY

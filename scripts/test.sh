#!/usr/bin/env bash
# Quickstart command 2: set up ./.venv and run the whole test suite (also what .ci/run runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q "$@"

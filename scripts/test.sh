#!/usr/bin/env bash
# Quickstart command 2 (and what .ci/run runs): set up ./.venv and run the whole test suite: the
# main suite (tests/) in ./.venv, then the torchtune parity suite (tests_peers/) in ./.venv-peers
# (torchtune 0.6.1, torchao 0.14.1, accelerate; created by benchmarks/setup_peers.sh).
#
# Usage: bash scripts/test.sh [--no-peers] [pytest args for the main suite...]
#   --no-peers   only the main suite (no ./.venv-peers), e.g. for a quick local run
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=1
if [ "${1:-}" = "--no-peers" ]; then
    PEERS=0
    shift
fi
bash scripts/setup.sh test
.venv/bin/python -m pytest -q "$@"
if [ "$PEERS" = 1 ]; then
    echo "[test] torchtune parity suite: setting up .venv-peers"
    bash benchmarks/setup_peers.sh || { echo "[test] benchmarks/setup_peers.sh failed" >&2; exit 1; }
    .venv-peers/bin/python -m pytest -q tests_peers
fi

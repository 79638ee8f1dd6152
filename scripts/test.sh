#!/usr/bin/env bash
# Quickstart command 2: set up ./.venv and run the whole test suite.
#
# Usage: bash scripts/test.sh [--peers] [pytest args...]
#   --peers   afterwards, also create ./.venv-peers (torchtune 0.6.1, torchao 0.14.1, accelerate;
#             benchmarks/setup_peers.sh) and run the torchtune parity suite tests_peers/ in it.
#             This is what .ci/run does.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=0
if [ "${1:-}" = "--peers" ]; then
    PEERS=1
    shift
fi
bash scripts/setup.sh test
.venv/bin/python -m pytest -q "$@"
if [ "$PEERS" = 1 ]; then
    echo "[test] torchtune parity suite: setting up .venv-peers"
    bash benchmarks/setup_peers.sh || { echo "[test] benchmarks/setup_peers.sh failed" >&2; exit 1; }
    .venv-peers/bin/python -m pytest -q tests_peers
fi

#!/usr/bin/env bash
# Quickstart command 2 (and what .ci/run runs): the whole test suite, on both legs of
# scripts/legs.env. Each leg sets up its own environment (scripts/setup.sh) first:
#   pinned  ./.venv: ruff and mypy (scripts/lint.sh), then the main suite (tests/) on the oldest
#           supported Python with every dependency at its declared floor; then the torchtune
#           parity suite (tests_peers/) in ./.venv-peers (torchtune 0.6.1, torchao 0.14.1,
#           accelerate; created by benchmarks/setup_peers.sh)
#   newest  ./.venv-newest: the main suite on the newest Python with the newest torch release
#   vllm    ./.venv-vllm: vLLM 0.33 with its own torch and transformers (scripts/test_vllm.sh): the
#           weight source and the quantized saves judged by vLLM's own classes (WeightSource,
#           ParamMeta, ModuleSource, Fp8Config, Mxfp4Config, per_block_cast_to_fp8)
#
# Usage: bash scripts/test.sh [--leg pinned|newest|vllm|all] [--no-peers] [pytest args for the main suite...]
#   --leg L      run one leg only (default: all, pinned first, vllm last)
#   --no-peers   skip the torchtune parity suite, e.g. for a quick local run
set -euo pipefail
cd "$(dirname "$0")/.."
LEGS="pinned newest vllm"
PEERS=1
while [ $# -gt 0 ]; do
    case "$1" in
        --no-peers) PEERS=0; shift ;;
        --leg)
            case "${2:-}" in
                pinned|newest|vllm) LEGS="$2" ;;
                all) LEGS="pinned newest vllm" ;;
                *) echo "[test] --leg takes pinned, newest, vllm or all, got '${2:-}'" >&2; exit 2 ;;
            esac
            shift 2 ;;
        *) break ;;
    esac
done
for LEG in $LEGS; do
    if [ "$LEG" = vllm ]; then
        echo "[test] leg 'vllm': setting up .venv-vllm (scripts/test_vllm.sh)"
        bash scripts/test_vllm.sh
        continue
    fi
    VENV=.venv
    [ "$LEG" = newest ] && VENV=.venv-newest
    echo "[test] leg '$LEG': setting up $VENV"
    FSDPTK_LEG="$LEG" bash scripts/setup.sh test
    if [ "$LEG" = pinned ]; then
        bash scripts/lint.sh
    fi
    "$VENV/bin/python" -c 'import sys, torch; print(f"[test] leg {sys.argv[1]}: Python {sys.version.split()[0]}, torch {torch.__version__}")' "$LEG"
    FSDPTK_LEG="$LEG" "$VENV/bin/python" -m pytest -q "$@"
    if [ "$LEG" = pinned ] && [ "$PEERS" = 1 ]; then
        echo "[test] torchtune parity suite: setting up .venv-peers"
        bash benchmarks/setup_peers.sh || { echo "[test] benchmarks/setup_peers.sh failed" >&2; exit 1; }
        .venv-peers/bin/python -m pytest -q tests_peers
    fi
done

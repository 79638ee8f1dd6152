#!/usr/bin/env bash
# Quickstart command 2 (and what .ci/run runs): the whole test suite, on both legs of
# scripts/legs.env. Each leg sets up its own environment (scripts/setup.sh) first:
#   pinned  ./.venv: ruff and mypy (scripts/lint.sh), then the main suite (tests/) on the oldest
#           supported Python with every dependency at its declared floor; then the torchtune
#           parity suite (tests_peers/) in ./.venv-peers (torchtune 0.6.1, torchao 0.14.1,
#           accelerate; created by benchmarks/setup_peers.sh)
#   newest  ./.venv-newest: the main suite on the newest Python with the newest torch release
#   vllm    ./.venv-vllm: vLLM 0.33 with its own torch and transformers (scripts/test_vllm.sh): the
#           weight source, its patches and the quantized saves judged by vLLM's own classes
#           (WeightSource, ParamMeta, ModuleSource, SparseWeightPatch, load_checkpoint_weight_patches,
#           Fp8Config, Mxfp4Config, per_block_cast_to_fp8)
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
# The environments of the later legs (and the peers') are set up in the background while the
# first leg sets up and lints: their installs are mostly downloads and unpacking, and on a fresh
# clone they take about 7 of the run's minutes. Every suite then waits for every setup: an install
# writes gigabytes, and a suite beside it waited on the disk (each save fsyncs its files; the CLI
# demo's two saves took 175-187 s instead of 36-46 s, the pinned suite 523-621 s instead of about
# 390 s, even with the installs at nice 10). Each setup's log is printed when it is waited for; a
# failed setup stops the run there, with its log. With one leg there is nothing to overlap.
SETUP_LOGS="$(mktemp -d)"
trap 'rm -rf "$SETUP_LOGS"' EXIT
declare -A SETUP_PID=()
in_background() {  # in_background NAME COMMAND...: run a setup now, its output in $SETUP_LOGS/NAME.log
    local name="$1"
    shift
    "$@" >"$SETUP_LOGS/$name.log" 2>&1 &
    SETUP_PID[$name]=$!
}
declare -A SETUP_DONE=()
finished() {  # finished NAME: wait for that setup, print its log; fail (with the log) when it failed
    local name="$1" rc=0
    [ -n "${SETUP_DONE[$name]:-}" ] && return 0
    SETUP_DONE[$name]=1
    wait "${SETUP_PID[$name]}" || rc=$?
    sed "s/^/[setup $name] /" "$SETUP_LOGS/$name.log"
    if [ "$rc" != 0 ]; then
        echo "[test] setting up '$name' failed (exit $rc); its log is above" >&2
        exit 1
    fi
}
FIRST="${LEGS%% *}"
if [ "$FIRST" != "$LEGS" ]; then
    for LEG in $LEGS; do
        [ "$LEG" = "$FIRST" ] && continue
        case "$LEG" in
            newest) in_background newest env FSDPTK_LEG=newest bash scripts/setup.sh test ;;
            vllm) in_background vllm env FSDPTK_VLLM_SETUP_ONLY=1 bash scripts/test_vllm.sh ;;
        esac
    done
fi
if [ "$PEERS" = 1 ] && [ "$FIRST" = pinned ]; then
    in_background peers bash benchmarks/setup_peers.sh
fi
for LEG in $LEGS; do
    if [ "$LEG" = vllm ]; then
        echo "[test] leg 'vllm': setting up .venv-vllm (scripts/test_vllm.sh)"
        [ -n "${SETUP_PID[vllm]:-}" ] && finished vllm
        bash scripts/test_vllm.sh
        continue
    fi
    VENV=.venv
    [ "$LEG" = newest ] && VENV=.venv-newest
    echo "[test] leg '$LEG': setting up $VENV"
    if [ -n "${SETUP_PID[$LEG]:-}" ]; then
        finished "$LEG"
    else
        FSDPTK_LEG="$LEG" bash scripts/setup.sh test
    fi
    if [ "$LEG" = pinned ]; then
        bash scripts/lint.sh
    fi
    for NAME in "${!SETUP_PID[@]}"; do  # the suites run on a quiet disk: every setup has finished
        finished "$NAME"  # at once where it was waited for already
    done
    "$VENV/bin/python" -c 'import sys, torch; print(f"[test] leg {sys.argv[1]}: Python {sys.version.split()[0]}, torch {torch.__version__}")' "$LEG"
    # two pytest workers (pytest-xdist), a module each at a time (--dist loadfile: a module's
    # fixtures, its worlds and simulated hosts, are made once): one multi-process test waits on
    # its ranks' messages while the other computes, so both cores stay busy. FSDPTK_TEST_WORKERS=0
    # (or -n 0 among the pytest arguments) runs the suite in one process.
    FSDPTK_LEG="$LEG" "$VENV/bin/python" -m pytest -q -n "${FSDPTK_TEST_WORKERS:-2}" --dist loadfile "$@"
    if [ "$LEG" = pinned ] && [ "$PEERS" = 1 ]; then
        echo "[test] torchtune parity suite: setting up .venv-peers"
        if [ -n "${SETUP_PID[peers]:-}" ]; then
            finished peers
        else
            bash benchmarks/setup_peers.sh || { echo "[test] benchmarks/setup_peers.sh failed" >&2; exit 1; }
        fi
        .venv-peers/bin/python -m pytest -q tests_peers
    fi
done

#!/usr/bin/env bash
# Create (or reuse) the virtual environment of one test leg (scripts/legs.env) with fsdptk and
# what it needs. Safe to run again: it installs only what is missing.
#
# Usage: bash scripts/setup.sh [EXTRAS]              the pinned leg, ./.venv (what demo.sh uses)
#        FSDPTK_LEG=newest bash scripts/setup.sh test   the newest leg, ./.venv-newest
#
# pinned: Python $PINNED_PYTHON (python3 where that is not installed; PYTHON=... to choose), torch
#         and every other dependency at the floor pyproject.toml declares (scripts/floors.txt);
#         torch 2.13.0 is the CPU build (an unpinned `torch` pulls a multi-GB CUDA build).
# newest: Python $NEWEST_PYTHON and torch $NEWEST_TORCH, the newest release of everything else.
#         pip on this project's machines is capped below that torch by a constraint file
#         (PIP_CONSTRAINT); the cap is lifted for this environment's installs only. PyPI serves a
#         CUDA build of torch for Linux (about 4 GB with its CUDA libraries; it runs on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's editable install writes fsdptk.egg-info into the checkout: one at a time, as scripts/test.sh
# sets up several environments at once
one_at_a_time() { if command -v flock >/dev/null 2>&1; then flock "${TMPDIR:-/tmp}/fsdptk-editable-install.lock" "$@"; else "$@"; fi; }
source scripts/legs.env
LEG="${FSDPTK_LEG:-pinned}"
EXTRAS="${1:-}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
case "$LEG" in
    pinned) VENV=.venv; WANT="$PINNED_PYTHON" ;;
    newest) VENV=.venv-newest; WANT="$NEWEST_PYTHON" ;;
    *) echo "[setup] FSDPTK_LEG must be pinned or newest, got '$LEG'" >&2; exit 2 ;;
esac
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if ! PY="$(bash scripts/find_python.sh "$WANT")"; then
        if [ "$LEG" = newest ]; then
            echo "[setup] the newest leg needs Python $WANT and none is installed (set PYTHON=...)" >&2
            exit 1
        fi
        PY=python3
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -c 'import sys; assert sys.version_info >= (3, 11), "fsdptk needs Python >= 3.11, found " + sys.version.split()[0]'
    echo "[setup] creating $VENV with $("$PY" -c 'import sys; print("Python", sys.version.split()[0])')"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if [ "$LEG" = pinned ]; then
    PINS=(-c scripts/floors.txt)
    TORCH="torch==$(sed -n 's/^torch==//p' scripts/floors.txt)"
else
    # an empty constraint file (an empty PIP_CONSTRAINT value does not lift a configured one)
    NOCAP="$(mktemp)"
    trap 'rm -f "$NOCAP"' EXIT
    export PIP_CONSTRAINT="$NOCAP"
    PINS=()
    TORCH="torch==$NEWEST_TORCH"
fi
if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
    if [ "$LEG" = newest ]; then
        # PyPI's CUDA build: about 3 GB of wheels that unpack to about 5.5 GB. One pip command
        # holds all of its wheels in its temporary directory until it ends (a peak near 9 GB);
        # scripts/pip_batched.py installs the same resolved set in batches of at most 512 MB of
        # wheels, without pip's cache: the peak is about 6 GB.
        NEED_GB="${FSDPTK_NEWEST_NEED_GB:-7}"
        for DIR in "$VENV" "${TMPDIR:-/tmp}"; do
            FREE_KB="$(df -Pk "$DIR" | awk 'NR == 2 {print $4}')"
            if [ "$FREE_KB" -lt $((NEED_GB * 1024 * 1024)) ]; then
                echo "[setup] the newest leg installs $TORCH (PyPI's CUDA build, about 3 GB of wheels" \
                     "unpacking to 5.5 GB) and needs about $NEED_GB GB free; $DIR has" \
                     "$((FREE_KB / 1024)) MB free. Free some disk, or run the pinned leg alone:" \
                     "bash scripts/test.sh --leg pinned" >&2
                exit 1
            fi
        done
    fi
    echo "[setup] installing $TORCH into $VENV"
    if [ "$LEG" = newest ]; then
        "$VPY" scripts/pip_batched.py --tag setup "$TORCH"
    else
        "$VPY" -m pip install -q "${PINS[@]}" "$TORCH"
    fi
fi
if ! "$VPY" -c 'import fsdptk, safetensors, torchao, tqdm' >/dev/null 2>&1 || [ -n "$EXTRAS" ]; then
    echo "[setup] installing fsdptk${EXTRAS:+[$EXTRAS]} (editable) into $VENV"
    one_at_a_time "$VPY" -m pip install -q "${PINS[@]}" -e ".${EXTRAS:+[$EXTRAS]}"
fi
"$VPY" -c 'import fsdptk' || { echo "[setup] fsdptk failed to import" >&2; exit 1; }

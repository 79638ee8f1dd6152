#!/usr/bin/env bash
# Create (or reuse) ./.venv with fsdptk and what it needs. Safe to run again: it installs only what
# is missing. torch is pinned to 2.13.0 (CPU build) when absent, because an unpinned `torch` pulls a
# multi-GB CUDA build; any torch>=2.13 that is already in the venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -c 'import sys; assert sys.version_info >= (3, 10), "fsdptk needs Python >= 3.10, found " + sys.version.split()[0]'
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
    echo "[setup] installing torch==2.13.0"
    "$VPY" -m pip install -q torch==2.13.0
fi
if ! "$VPY" -c 'import fsdptk, safetensors, torchao, tqdm' >/dev/null 2>&1 || [ -n "$EXTRAS" ]; then
    echo "[setup] installing fsdptk${EXTRAS:+[$EXTRAS]} (editable)"
    "$VPY" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
fi
"$VPY" -c 'import fsdptk' || { echo "[setup] fsdptk failed to import" >&2; exit 1; }

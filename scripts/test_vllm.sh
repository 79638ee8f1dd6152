#!/usr/bin/env bash
# The vLLM test environment (issue 41): fsdptk.hf.weight_source checked against vLLM's own
# weight-transfer protocol classes (WeightSource, ParamMeta, ModuleSource), which import on CPU.
#
# Creates (or reuses) ./.venv-vllm: Python 3.11 with vLLM 0.33.0, which pins its own torch (2.14.0,
# PyPI's CUDA build; it runs on the CPU) and transformers (< 5.21); then fsdptk (editable) WITHOUT
# its dependencies, so vLLM's torch stays, plus the few packages fsdptk and its tests need that vLLM
# does not bring (installed against vLLM's torch and transformers, pinned). Safe to run again: it
# installs only what is missing. Then runs the tests of the weight source in it, and those of the
# quantized saves that need vLLM (skipped in the other legs).
#
# Needs about 9.5 GB of disk for the environment (vLLM and torch's CUDA libraries) and about 1 GB
# more while installing (it installs in batches: scripts/pip_batched.py).
#
# Usage: bash scripts/test_vllm.sh [pytest args...]
#        FSDPTK_VLLM_SETUP_ONLY=1 bash scripts/test_vllm.sh     (the environment only)
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's editable install writes fsdptk.egg-info into the checkout: one at a time, as scripts/test.sh
# sets up several environments at once
one_at_a_time() { if command -v flock >/dev/null 2>&1; then flock "${TMPDIR:-/tmp}/fsdptk-editable-install.lock" "$@"; else "$@"; fi; }
VENV=.venv-vllm
VLLM_VERSION=0.33.0
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    PY="$(bash scripts/find_python.sh 3.11)" || { echo "[vllm] needs Python 3.11 (set PYTHON=...)" >&2; exit 1; }
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "[vllm] creating $VENV with $("$PY" -c 'import sys; print("Python", sys.version.split()[0])')"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
have() {  # have DIST [VERSION]: the distribution is installed (at exactly VERSION when given)
    "$VPY" - "$@" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    got = version(sys.argv[1])
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if len(sys.argv) < 3 or got == sys.argv[2] else 1)
EOF
}
if ! have vllm "$VLLM_VERSION"; then
    # vLLM and what it pulls: about 4 GB of wheels that unpack to about 9.5 GB. pip holds every
    # wheel of one command in its temporary directory until the command ends, so one
    # `pip install vllm` peaks near 14 GB; scripts/pip_batched.py installs the same resolved set in
    # batches of at most 512 MB of wheels, vLLM itself last: the peak is about 10 GB.
    NEED_GB="${FSDPTK_VLLM_NEED_GB:-11}"
    for DIR in "$VENV" "${TMPDIR:-/tmp}"; do
        FREE_KB="$(df -Pk "$DIR" | awk 'NR == 2 {print $4}')"
        if [ "$FREE_KB" -lt $((NEED_GB * 1024 * 1024)) ]; then
            echo "[vllm] installing vllm==$VLLM_VERSION needs about $NEED_GB GB free; $DIR has" \
                 "$((FREE_KB / 1024)) MB free. Free some disk, or run the other legs alone:" \
                 "bash scripts/test.sh --leg pinned" >&2
            exit 1
        fi
    done
    echo "[vllm] installing vllm==$VLLM_VERSION into $VENV (several GB: torch's CUDA libraries)"
    "$VPY" scripts/pip_batched.py --tag vllm "vllm==$VLLM_VERSION"
fi
# everything after vLLM keeps vLLM's torch and transformers (a constraint file pins what it installed)
PINS="$(mktemp)"
trap 'rm -f "$PINS"' EXIT
"$VPY" -c 'from importlib.metadata import version; print("torch==" + version("torch")); print("transformers==" + version("transformers"))' > "$PINS"
if ! have fsdptk; then
    echo "[vllm] installing fsdptk (editable, without dependencies) into $VENV"
    one_at_a_time "$VPY" -m pip install -q --no-deps -e .
fi
MISSING=()  # fsdptk's pure dependencies and the test extras vLLM does not bring (peft: the adapter tests)
for DIST in safetensors numpy tqdm hypothesis pytest pytest-timeout pytest-xdist cloudpickle psutil accelerate peft; do
    have "$DIST" || MISSING+=("$DIST")
done
if [ "${#MISSING[@]}" -gt 0 ]; then
    echo "[vllm] installing ${MISSING[*]} into $VENV"
    "$VPY" -m pip install -q -c "$PINS" "${MISSING[@]}"
fi
if ! have torchao; then  # fsdptk declares torchao; vLLM does not bring it (no deps: it would not add any)
    echo "[vllm] installing torchao (without dependencies) into $VENV"
    "$VPY" -m pip install -q --no-deps "torchao>=0.16"
fi
"$VPY" -c 'from vllm.distributed.weight_transfer.base import WeightSource, ParamMeta, ModuleSource; import fsdptk' \
    || { echo "[vllm] vLLM's weight_transfer module or fsdptk failed to import in $VENV" >&2; exit 1; }
"$VPY" -c 'import sys, torch, transformers, vllm; print(f"[vllm] Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, vLLM {vllm.__version__}")'
# FSDPTK_VLLM_SETUP_ONLY=1: make the environment and stop (scripts/test.sh sets it up while the
# other legs run, then calls this script again for the tests)
[ "${FSDPTK_VLLM_SETUP_ONLY:-0}" = 1 ] && exit 0
"$VPY" -m pytest -q -n "${FSDPTK_TEST_WORKERS:-2}" --dist loadfile tests/test_vllm_source.py tests/test_weight_source.py \
    tests/test_vllm_patches.py tests/test_weight_patches.py "$@"
# the quantized saves' checks that need vLLM (the others run in the main legs, on the transformers
# release the project declares; this environment holds vLLM's older one)
exec "$VPY" -m pytest -q tests/test_quantize_out.py -k vllm "$@"

#!/usr/bin/env bash
# Quickstart command 1: set up ./.venv and run the main job on CPU with 2 processes (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc_per_node=2 examples/train_llama.py "$@"

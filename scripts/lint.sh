#!/usr/bin/env bash
# Lint and type-check: ruff (pyproject [tool.ruff]) over the package and the tests, mypy
# (pyproject [tool.mypy]) over the package, and the documentation site built with
# `mkdocs build --strict` (every docstring cross-reference resolves). Runs from ./.venv; installs
# the pinned ruff and mypy (the `lint` extra of pyproject.toml) and the `docs` extra into it when
# they are missing.
#
# Usage: bash scripts/lint.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.6
MYPY_VERSION=2.4.1
if [ ! -x .venv/bin/python ]; then
    echo "[lint] no ./.venv: run scripts/setup.sh first" >&2
    exit 1
fi
if ! .venv/bin/ruff --version 2>/dev/null | grep -q "ruff $RUFF_VERSION\$" \
        || ! .venv/bin/mypy --version 2>/dev/null | grep -q "^mypy $MYPY_VERSION "; then
    echo "[lint] installing ruff==$RUFF_VERSION mypy==$MYPY_VERSION into .venv"
    .venv/bin/python -m pip install -q "ruff==$RUFF_VERSION" "mypy==$MYPY_VERSION"
fi
echo "[lint] ruff check"
.venv/bin/ruff check fsdptk tests tests_peers
echo "[lint] mypy"
.venv/bin/mypy
if ! .venv/bin/mkdocs --version >/dev/null 2>&1 || ! .venv/bin/python -c 'import mkdocstrings_handlers.python' >/dev/null 2>&1; then
    echo "[lint] installing the docs extra (mkdocs, mkdocstrings[python]) into .venv"
    .venv/bin/python -m pip install -q "mkdocs>=1.6" "mkdocstrings[python]>=0.26"
fi
echo "[lint] mkdocs build --strict"
SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
.venv/bin/mkdocs build --strict --quiet -d "$SITE"

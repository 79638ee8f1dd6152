#!/usr/bin/env bash
# Print the path of a Python X.Y interpreter: `pythonX.Y` on PATH if it runs, else the newest X.Y.Z
# that pyenv has installed (its shims only answer when PYENV_VERSION selects it). Exit 1 if none.
# Usage: bash scripts/find_python.sh 3.13
set -euo pipefail
want="$1"
if command -v "python$want" >/dev/null 2>&1 && "python$want" -c 'import sys' >/dev/null 2>&1; then
    command -v "python$want"
    exit 0
fi
if command -v pyenv >/dev/null 2>&1; then
    v="$(pyenv versions --bare 2>/dev/null | grep -E "^${want//./\\.}\.[0-9]+$" | sort -V | tail -1 || true)"
    if [ -n "$v" ] && [ -x "$(pyenv root)/versions/$v/bin/python$want" ]; then
        echo "$(pyenv root)/versions/$v/bin/python$want"
        exit 0
    fi
fi
exit 1

#!/usr/bin/env bash
# Creates .venv with every dependency; safe to run repeatedly (a stamp file
# skips the pip work when pyproject.toml has not changed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
STAMP=.venv/.shardcache-stamp
WANT="$(sha256sum pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    # torch first and pinned: the CPU wheel. A later unpinned requirement then
    # finds torch satisfied instead of pulling the multi-GB CUDA build.
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -e ".[test]" "torch==2.13.0"
    echo "$WANT" > "$STAMP"
fi

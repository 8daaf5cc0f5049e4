#!/usr/bin/env bash
# The benchmark: shardcache beside plain PyTorch/s3fs, a Manager-dict cache and
# fsspec simplecache, in one run. Writes bench/results/<date>.json (+ .png) and BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m pip install --quiet "matplotlib>=3.8" "torch==2.13.0"
exec .venv/bin/python bench/run.py "$@"

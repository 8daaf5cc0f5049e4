#!/usr/bin/env bash
# The benchmark: shardcache beside plain PyTorch/s3fs, a Manager-dict cache,
# fsspec simplecache, Ray Data and LitData, in one run. Writes bench/results/<date>.json (+ .png) and BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# torch stays pinned so no competitor pulls another build. Mosaic Streaming is
# not installed: it imports torchvision, whose PyPI wheels fail against the CPU
# torch here (bench/NOTES.md).
# LitData goes in without its torchvision requirement for the same reason (the
# code paths used here never import it).
.venv/bin/python -m pip install --quiet "matplotlib>=3.8" "torch==2.13.0" \
    boto3 filelock lightning-utilities obstore requests tifffile
.venv/bin/python -m pip install --quiet --no-deps "litdata==0.2.76"
exec .venv/bin/python bench/run.py "$@"

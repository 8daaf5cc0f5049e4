#!/usr/bin/env bash
# The benchmark: shardcache beside plain PyTorch (s3fs, or local files), a
# Manager-dict cache, fsspec simplecache, Ray Data, LitData and Mosaic, in one
# run, on an emulated S3 and on page-cached local files. Writes
# bench/results/<date>T<time>.json (+ .png) and BENCHMARKS.md (--out DIR: there).
# --quick writes to a temp dir; --systems picks systems (bench/README.md).
# Scenarios with a table of their own: `formats`, `scale`, `cold`, `gpu` and `jobs` (below).
set -euo pipefail
cd "$(dirname "$0")/.."
# `scripts/bench.sh formats [--write]`: bytes each packed format reads from S3
# per file byte (bench/formats.py); needs nothing the comparison installs.
if [ "${1:-}" = "formats" ]; then shift; exec .venv/bin/python bench/formats.py "$@"; fi
# `scripts/bench.sh scale [--write]`: reading at scale in one run: the packed
# formats' bytes, one listing at 1 M and 10 M keys, memory per sample and the
# cold epoch at 1 M files, the first batch at 100 k / 1 M / 10 M (bench/at_scale.py).
if [ "${1:-}" = "scale" ]; then shift; exec .venv/bin/python bench/at_scale.py "$@"; fi
# `scripts/bench.sh cold`: epoch 1 on the README's DataLoader path against
# DataLoader(num_workers=2) over the same .npy files (bench/cold_readme.py);
# `scripts/bench.sh gpu`: time to a normalised batch on the GPU (bench/gpu.py;
# prints "skipped" where there is no CUDA device).
case "${1:-}" in
    cold) shift; PYTHONPATH=sdk:services:bench exec .venv/bin/python bench/cold_readme.py "$@" ;;
    gpu) shift; PYTHONPATH=sdk:services:bench exec .venv/bin/python bench/gpu.py "$@" ;;
esac
bash scripts/bootstrap.sh
# torch stays pinned so no competitor pulls another build. PyPI's torchvision
# fails against the CPU torch 2.13.0 here, so LitData goes in without its
# torchvision requirement (the code paths used here never import it) and
# Mosaic Streaming, whose `import streaming` imports torchvision, gets an
# environment of its own with the torch 2.14.1 + torchvision 0.29.1 pair that
# lies on this machine's disk (bench/mosaic.py).
.venv/bin/python -m pip install --quiet "matplotlib>=3.8" "torch==2.13.0" \
    boto3 filelock lightning-utilities obstore requests tifffile
.venv/bin/python -m pip install --quiet --no-deps "litdata==0.2.76"
if [ ! -x .venv-mosaic/bin/python ] || ! .venv-mosaic/bin/python -c "import streaming" 2>/dev/null; then
    "${PYTHON:-python3.11}" -m venv .venv-mosaic
    .venv-mosaic/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
    .venv-mosaic/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1" \
        "mosaicml-streaming>=0.11" boto3 psutil numpy pillow \
        || echo "note: Mosaic Streaming could not be installed; the table will say so"
fi
# `scripts/bench.sh jobs [--jobs 1,4,8,16] [--write]`: N concurrent training
# jobs on one dataset on one node, beside plain DataLoaders and LitData
# (bench/many_jobs.py); uses what the lines above installed.
if [ "${1:-}" = "jobs" ]; then shift; exec .venv/bin/python bench/many_jobs.py "$@"; fi
exec .venv/bin/python bench/run.py "$@"

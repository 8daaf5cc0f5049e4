#!/usr/bin/env bash
# The main job: bootstrap .venv, then a 2-rank DDP demo on embedded defaults
# (local Redis, local Ray, an S3 emulator with generated images). Extra
# arguments go to `shardcache demo` (e.g. --images 5000, --source s3://...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/shardcache demo "$@"

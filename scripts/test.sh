#!/usr/bin/env bash
# The test command: bootstrap .venv, then the whole suite against real
# components (redis-server, moto's S3 server, a 2-node Ray cluster, gloo ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python - <<'PY'
from shardcache.embedded import find_redis_server
print("redis-server:", find_redis_server())  # a setup error here, never a silent skip
PY
exec .venv/bin/python -m pytest --doctest-modules sdk services tests "$@"

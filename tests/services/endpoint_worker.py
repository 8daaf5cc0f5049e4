"""Cache-worker side of tests/services/test_endpoint.py: a Ray node plus the
node-local endpoint as a driver beside it, as in the chart's DaemonSet pod.
Run inside its own mount namespace; settings come from SHARDCACHE_* env."""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray

from shardcache.embedded import start_loopback_cluster

WORKER_OBJECT_STORE_BYTES = 150 * 2**20


def main() -> None:
    cluster = start_loopback_cluster(1, WORKER_OBJECT_STORE_BYTES, cpus_per_node=2)
    os.environ["SHARDCACHE_RAY_ADDRESS"] = cluster.address
    from shardcache_server.endpoint.__main__ import main as serve

    try:
        serve()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()

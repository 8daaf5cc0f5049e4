"""Per-operation costs that docs/scale.md builds its 1,000-node model from.

.venv/bin/python bench/ops.py      # prints JSON and writes bench/results/ops-<date>.json
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
BATCH = 64


def _time(fn: Any, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def main() -> None:
    import ray

    from shardcache.embedded import start_redis_server
    from shardcache_server.index import ClusterIndex
    from shardcache_server.settings import ServiceSettings
    from shardcache_server.store import start_shard

    proc, url = start_redis_server(Path(tempfile.mkdtemp()), password="ops")
    index = ClusterIndex.from_url(url, "ops")
    index.register("ds", "s3://b/", "fp", 1000, 0)
    paths = [f"s3://b/{i}" for i in range(BATCH)]
    out: dict[str, Any] = {}
    out["redis_hget_generation_us"] = _time(lambda: index.generation("ds"), 2000) * 1e6
    out["redis_claim_64_us"] = (
        _time(lambda: index.claim_owners("ds", 1, paths, "n/1"), 500) * 1e6
    )
    out["redis_stats_flush_us"] = (
        _time(
            lambda: index.flush_stats(
                {("ds", 1): {"hits": 64, "misses": 1, "bytes_read": 4096}}, "n"
            ),
            500,
        )
        * 1e6
    )
    ray.init(
        address="local",  # always a private cluster, never a running one
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        node = ray.get_runtime_context().get_node_id()
        store = start_shard(ServiceSettings(redis_url=url, namespace="ops"), node)
        ray.get(store.ping.remote())
        out["actor_call_roundtrip_us"] = (
            _time(lambda: ray.get(store.info.remote()), 300) * 1e6
        )
        for size in (4096, 100_000):
            refs = [ray.put(np.zeros(size, np.uint8)) for _ in range(BATCH)]
            out[f"ray_get_{BATCH}x{size // 1000}kB_us"] = (
                _time(lambda refs=refs: ray.get(refs), 300) * 1e6
            )
        out["batch"] = BATCH
        out["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        out["cpus"] = os.cpu_count()
    finally:
        ray.shutdown()
        proc.terminate()
    print(json.dumps(out, indent=1))
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    (HERE / "results" / f"ops-{stamp}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

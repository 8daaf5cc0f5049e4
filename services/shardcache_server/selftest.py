"""``shardcache selftest``: prove an installed cache works end to end.

Checks Redis (PING), the dashboard (``/healthz``), then serves 8 generated
objects from an S3 emulator inside this pod, warms them through the Ray
cluster and reads them again: the second read must be all hits.
"""

from __future__ import annotations

import os
import urllib.request

from rich.console import Console

from shardcache.errors import BackendError, ShardUnavailable
from shardcache.transport.base import Status

__all__ = ["run_selftest"]

SELFTEST_OBJECTS = 8


def run_selftest(
    *,
    ray_address: str | None,
    dashboard_url: str | None,
    redis_url: str | None,
    namespace: str,
    console: Console,
) -> None:
    """Raise a ShardCacheError naming the first failed check."""
    import ray
    import s3fs

    from shardcache.config import ClientConfig
    from shardcache.embedded import attach_ray
    from shardcache.index import RedisIndex
    from shardcache.transport.direct import CacheClient
    from shardcache_server.datagen import upload_blobs
    from shardcache_server.emulator import S3Emulator
    from shardcache_server.warm import warm_dataset

    index = RedisIndex.from_url(redis_url or ClientConfig().redis_url or "", namespace)
    with index.errors():
        index.client.ping()
    console.print("redis: PONG")
    if dashboard_url:
        try:
            with urllib.request.urlopen(f"{dashboard_url}/healthz", timeout=10) as resp:
                console.print(f"dashboard: {resp.read().decode().strip()}")
        except OSError as exc:
            raise BackendError(
                f"dashboard {dashboard_url}/healthz failed: {exc}"
            ) from exc
    # The stores in other pods must reach this emulator: bind the pod IP there.
    emulator = S3Emulator(host=os.environ.get("POD_IP", "127.0.0.1")).start()
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **emulator.storage_options())
        fs.mkdir("selftest")
        upload_blobs(fs, "selftest/d", SELFTEST_OBJECTS, 1024)
        summary = warm_dataset(
            "s3://selftest/d/",
            name="selftest",
            storage_options=emulator.storage_options(),
            redis_url=index.url,
            namespace=namespace,
            ray_address=ray_address,
            console=console,
            force=True,  # its own dataset: an older install's may differ
        )
        attach_ray(ray_address)
        client = CacheClient(ClientConfig(redis_url=index.url, namespace=namespace))
        results = client.get_refs(
            "selftest", summary["generation"], summary["items"], summary["digest"]
        )
        ray.get([ref for _, ref in results])
        statuses = {s for s, _ in results}
        if statuses - {Status.HIT, Status.REMOTE_HIT}:
            raise ShardUnavailable(
                f"selftest: second read was not all hits: {sorted(map(str, statuses))}"
            )
        console.print(f"cache: {SELFTEST_OBJECTS} objects warmed and read back as hits")
    finally:
        emulator.stop()

"""``shardcache warm``: fetch every object once, spread over the node stores."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

from shardcache.config import ClientConfig
from shardcache.dataset import default_name
from shardcache.embedded import attach_ray, local_redis_url
from shardcache.errors import ShardUnavailable
from shardcache.fingerprint import fingerprint
from shardcache.index import RedisIndex
from shardcache.sharding import assign_shards
from shardcache.source import list_source
from shardcache_server.cluster import ensure_stores
from shardcache_server.preprocess import get_preprocessor
from shardcache_server.settings import ServiceSettings

__all__ = ["warm_dataset"]


def warm_dataset(
    url: str,
    *,
    preprocess: str = "raw",
    name: str | None = None,
    storage_options: dict[str, Any] | None = None,
    redis_url: str | None = None,
    namespace: str = "default",
    ray_address: str | None = None,
    batch: int = 64,
    console: Console | None = None,
) -> dict[str, Any]:
    """Warm ``url`` into the cluster cache; returns a summary.

    Objects are spread over the nodes by the same rendezvous hashing the
    sampler uses, so no single store holds the whole dataset.

    Raises:
        ConfigError, SourceNotFound, EmptyDatasetError, IndexUnavailable,
        ShardUnavailable, and the first per-object error (PreprocessError, ...).
    """
    import ray

    started = time.perf_counter()
    fn = get_preprocessor(preprocess)
    config = ClientConfig(
        redis_url=redis_url, namespace=namespace, ray_address=ray_address
    )
    redis_url = config.redis_url or local_redis_url()
    manifest = list_source(url, storage_options)
    name = name or default_name(url)
    index = RedisIndex.from_url(redis_url, namespace)
    generation = index.register(
        name, url, fingerprint(fn), len(manifest), sum(o.size for o in manifest.objects)
    )
    index.invalidate_changed(
        name, generation, {o.url: o.etag for o in manifest.objects}
    )
    attach_ray(config.ray_address)
    handles = ensure_stores(ServiceSettings(redis_url=redis_url, namespace=namespace))
    nodes = sorted(handles)
    if not nodes:
        raise ShardUnavailable("no alive Ray node to warm into.")
    spec = {
        "name": name,
        "protocol": manifest.protocol,
        "storage_options": storage_options or {},
        "fingerprint": fingerprint(fn),
        "generation": generation,
    }
    ray.get([h.register.remote(spec, fn) for h in handles.values()])
    shards = assign_shards([o.url for o in manifest.objects], len(nodes))
    counts = {"fetched": 0, "already_cached": 0, "errors": 0}
    first_error: tuple[str, str] | None = None
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(f"warming {name}", total=len(manifest))
        pending = []
        for node, shard in zip(nodes, shards, strict=False):
            for i in range(0, len(shard), batch):
                items = [
                    (
                        manifest.objects[j].url,
                        manifest.objects[j].etag,
                        manifest.objects[j].size,
                    )
                    for j in shard[i : i + batch]
                ]
                pending.append(handles[node].get.remote(name, generation, items))
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for res in ray.get(done[0]):
                if res[0] == "error":
                    counts["errors"] += 1
                    first_error = first_error or (res[1], res[2])
                else:
                    counts["fetched" if res[0] == "fetched" else "already_cached"] += 1
                progress.advance(task)
    if first_error is not None:
        from shardcache.client import raise_item_error

        raise_item_error(*first_error)
    return {
        "dataset": name,
        "generation": generation,
        "objects": len(manifest),
        "bytes": sum(o.size for o in manifest.objects),
        "seconds": time.perf_counter() - started,
        **counts,
    }

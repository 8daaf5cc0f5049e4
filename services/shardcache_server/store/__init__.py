"""The per-node cache store: ``CacheShard`` and the one place it becomes a Ray actor."""

from shardcache_server.store.shard import (
    CacheShard,
    Item,
    Result,
    ray_namespace,
    start_shard,
    store_name,
)

__all__ = ["CacheShard", "Item", "Result", "ray_namespace", "start_shard", "store_name"]

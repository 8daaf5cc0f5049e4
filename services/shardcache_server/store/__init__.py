"""The per-node cache store: ``CacheShard`` and the one place it becomes a Ray actor."""

from shardcache_server.store.actor import (
    RayCacheShard,
    ray_namespace,
    start_shard,
    store_name,
)
from shardcache_server.store.datasets import Item, Result
from shardcache_server.store.shard import CacheShard

__all__ = [
    "CacheShard",
    "Item",
    "RayCacheShard",
    "Result",
    "ray_namespace",
    "start_shard",
    "store_name",
]

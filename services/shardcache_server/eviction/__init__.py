"""Eviction policies for a store's memory budget: one file per policy."""

from __future__ import annotations

from shardcache.errors import ConfigError
from shardcache_server.eviction.base import EvictionPolicy
from shardcache_server.eviction.clairvoyant import ClairvoyantPolicy, SamplerOrder
from shardcache_server.eviction.lru import LRUPolicy
from shardcache_server.eviction.static import StaticPolicy

__all__ = [
    "POLICIES",
    "ClairvoyantPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "SamplerOrder",
    "StaticPolicy",
    "make_policy",
]

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "static": StaticPolicy,
    "clairvoyant": ClairvoyantPolicy,
}


def make_policy(name: str, budget_bytes: int) -> EvictionPolicy:
    """Build the named policy; ConfigError lists the valid names."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}. "
            "Set SHARDCACHE_EVICTION."
        ) from None
    if budget_bytes <= 0:
        raise ConfigError(
            f"cache_bytes must be > 0, got {budget_bytes}. Set SHARDCACHE_CACHE_BYTES."
        )
    return cls(budget_bytes)

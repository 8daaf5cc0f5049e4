"""Static: once full, keep what is cached and serve further misses uncached."""

from __future__ import annotations

from collections.abc import Hashable

from shardcache_server.eviction.base import EvictionPolicy

__all__ = ["StaticPolicy"]


class StaticPolicy(EvictionPolicy):
    """Never evicts. With random-order epochs over a dataset larger than the
    cache, the hit rate stays at cache/dataset where LRU would fall towards 0."""

    def admit(self, key: Hashable, nbytes: int) -> tuple[bool, list[Hashable]]:
        if key in self._sizes:
            return True, []
        if self.used_bytes + nbytes > self.budget_bytes:
            return False, []
        self._insert(key, nbytes)
        return True, []

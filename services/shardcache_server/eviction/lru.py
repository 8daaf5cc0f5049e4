"""Least-recently-used: evict the coldest entries to make room."""

from __future__ import annotations

from collections.abc import Hashable

from shardcache_server.eviction.base import EvictionPolicy

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """Keeps the most recently used entries. Good when the working set fits;
    random-order epochs over a larger dataset thrash it (use ``static``)."""

    def admit(self, key: Hashable, nbytes: int) -> tuple[bool, list[Hashable]]:
        if nbytes > self.budget_bytes:
            return False, []
        self.remove(key)
        evicted = []
        while self.used_bytes + nbytes > self.budget_bytes and self._sizes:
            victim, size = self._sizes.popitem(last=False)
            self.used_bytes -= size
            evicted.append(victim)
        self._insert(key, nbytes)
        return True, evicted

    def touch(self, key: Hashable) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

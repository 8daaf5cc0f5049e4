"""What this store holds in memory, by ``(dataset, chunk)``.

Ownership rule: the table alone adds and removes held chunks, keeps the
eviction policy's accounts in step with them, and knows each dataset's
current generation; a chunk of an older generation leaves the table for
``retired.py`` (kept a while for ranks mid-epoch) or is freed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache_server.eviction import EvictionPolicy
from shardcache_server.store.retired import RetiredGenerations

__all__ = ["Cached", "HeldTable"]

Key = tuple[str, str]  # (dataset, chunk key)


@dataclass
class Cached:
    ref: Any
    etag: str  # the chunk's version
    generation: int
    nbytes: int
    hashes: np.ndarray  # member (url, etag) hashes: which rows a rebuild may reuse


class HeldTable:
    """The chunks held in memory, the policy that budgets them, and generations.

    Args:
        policy: decides what stays within the byte budget.
        retired: takes the values of generations that were invalidated.
    """

    def __init__(self, policy: EvictionPolicy, retired: RetiredGenerations):
        self.policy = policy
        self.retired = retired
        self.generation: dict[str, int] = defaultdict(int)
        self._entries: dict[Key, Cached] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def get(self, dataset: str, chunk: str) -> Cached | None:
        return self._entries.get((dataset, chunk))

    def items(self) -> Iterator[tuple[Key, Cached]]:
        """Every held chunk (a copy: callers may evict while iterating)."""
        return iter(list(self._entries.items()))

    def hit(
        self, dataset: str, chunk: str, version: str, generation: int
    ) -> Cached | None:
        """The held chunk if it is that version of that generation (and tell
        the policy it was used), else ``None``."""
        cached = self._entries.get((dataset, chunk))
        if cached is None or cached.etag != version or cached.generation != generation:
            return None
        self.policy.touch((dataset, chunk))
        return cached

    def admit(self, dataset: str, chunk: str, value: Cached) -> tuple[bool, list[Key]]:
        """Hold ``value`` if the policy finds room; returns ``(admitted, evicted)``.

        Retired generations go first when the budget is short; the chunks the
        policy evicts for room are gone from the table when this returns.
        """
        overflow = (
            self.policy.used_bytes
            + self.retired.nbytes
            + value.nbytes
            - self.policy.budget_bytes
        )
        if overflow > 0:
            self.retired.free(overflow)
        admitted, evicted = self.policy.admit((dataset, chunk), value.nbytes)
        for victim in evicted:
            self.evict(victim)
        if admitted:
            self._entries[(dataset, chunk)] = value
        return admitted, list(evicted)

    def evict(self, key: Key) -> None:
        self.policy.remove(key)
        self._entries.pop(key, None)

    def advance(self, dataset: str, generation: int, spec: Any | None) -> None:
        """Move to ``generation``; older values are retired (kept a while) or freed.

        ``spec`` is the dataset as registered for the generation being left
        (``None`` if never registered here): retired chunks are served with it.
        """
        previous = self.generation[dataset]
        if generation <= previous:
            return
        self.generation[dataset] = generation
        if spec is not None:
            self.retired.retire(dataset, previous, spec)
        for k in [
            k
            for k, c in self._entries.items()
            if k[0] == dataset and c.generation < generation
        ]:
            c = self._entries[k]
            self.retired.keep(dataset, c.generation, k[1], c.ref, c.etag, c.nbytes)
            self.evict(k)

    def bytes_by_dataset(self) -> dict[str, int]:
        per_ds: dict[str, int] = defaultdict(int)
        for (ds, _), c in self._entries.items():
            per_ds[ds] += c.nbytes
        return dict(per_ds)

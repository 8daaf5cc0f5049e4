"""What every eviction policy provides."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

__all__ = ["EvictionPolicy"]


class EvictionPolicy:
    """Tracks cached keys and their sizes against a byte budget.

    Subclasses decide what :meth:`admit` does when the budget is full.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def admit(self, key: Hashable, nbytes: int) -> tuple[bool, list[Hashable]]:
        """Try to cache ``key``; returns (admitted, keys evicted to make room)."""
        raise NotImplementedError

    def touch(self, key: Hashable) -> None:
        """Record a hit on ``key``."""

    def observe(self, keys: Iterable[Hashable]) -> None:
        """One store call asked for ``keys`` (hits and misses, before either
        is served); only policies that plan ahead use it."""

    def learn(self, dataset: str, order: Any) -> None:
        """Take a rank's sampler order (a ``SamplerOrder``); only policies
        that plan ahead (``clairvoyant``) use it."""

    def remove(self, key: Hashable) -> None:
        nbytes = self._sizes.pop(key, None)
        if nbytes is not None:
            self.used_bytes -= nbytes

    def _insert(self, key: Hashable, nbytes: int) -> None:
        self.remove(key)
        self._sizes[key] = nbytes
        self.used_bytes += nbytes

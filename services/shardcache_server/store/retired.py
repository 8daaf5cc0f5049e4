"""Entries of invalidated generations, kept a while for ranks mid-epoch.

A rank snapshots the generation at ``set_epoch`` and reads it to the end of
the epoch. When an invalidation lands mid-epoch, the store moves the old
generation's entries here instead of freeing them, so those ranks still get
the bytes their epoch started with. Retired entries share the store's byte
budget (they are the first to go when a new entry needs room) and expire
after ``retire_grace_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["RetiredGenerations"]


@dataclass
class _Retired:
    ref: Any
    etag: str
    nbytes: int


class RetiredGenerations:
    """Old generations' values and dataset specs, by ``(dataset, generation)``.

    Args:
        grace_s: how long a retired generation stays readable. ``0`` frees
            old generations at once (every batch then sees the newest one).
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.nbytes = 0
        self._entries: dict[tuple[str, int], dict[str, _Retired]] = {}
        self._specs: dict[tuple[str, int], Any] = {}
        self._deadline: dict[tuple[str, int], float] = {}

    def retire(self, dataset: str, generation: int, spec: Any) -> None:
        """Remember how ``generation`` of ``dataset`` was fetched and preprocessed."""
        if self.grace_s <= 0 or generation <= 0:
            return
        key = (dataset, generation)
        self._specs[key] = spec
        self._entries.setdefault(key, {})
        self._deadline[key] = time.monotonic() + self.grace_s

    def keep(
        self, dataset: str, generation: int, url: str, ref: Any, etag: str, nbytes: int
    ) -> bool:
        """Keep one value of a retired generation; False if it is not retained."""
        entries = self._entries.get((dataset, generation))
        if entries is None:
            return False
        entries[url] = _Retired(ref, etag, nbytes)
        self.nbytes += nbytes
        return True

    def spec(self, dataset: str, generation: int) -> Any | None:
        """The dataset spec of a retained generation, or ``None`` once expired."""
        self.expire()
        return self._specs.get((dataset, generation))

    def lookup(self, dataset: str, generation: int, url: str, etag: str) -> Any | None:
        entry = self._entries.get((dataset, generation), {}).get(url)
        return entry.ref if entry is not None and entry.etag == etag else None

    def free(self, nbytes: int) -> None:
        """Drop retired values, oldest generation first, until ``nbytes`` are freed."""
        for key in sorted(self._entries, key=lambda k: self._deadline[k]):
            entries = self._entries[key]
            while entries and nbytes > 0:
                _, entry = entries.popitem()
                self.nbytes -= entry.nbytes
                nbytes -= entry.nbytes
            if nbytes <= 0:
                return

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for key in [k for k, t in self._deadline.items() if t <= now]:
            self.nbytes -= sum(e.nbytes for e in self._entries.pop(key, {}).values())
            self._specs.pop(key, None)
            del self._deadline[key]

    def drop(self, dataset: str) -> None:
        """Forget every retired generation of ``dataset``."""
        for key in [k for k in self._deadline if k[0] == dataset]:
            self._deadline[key] = 0.0
        self.expire()

    def summary(self) -> dict[str, int]:
        return {
            "retired_bytes": self.nbytes,
            "retired_generations": len(self._deadline),
        }

"""Counters kept in memory and flushed to Redis in batches, never per sample."""

from __future__ import annotations

from collections import defaultdict

__all__ = ["StatsBuffer"]

MAX_BUFFERED_FLUSHES = 600  # ten minutes of 1 s flushes while Redis is down


class StatsBuffer:
    """Counters per ``(dataset, generation)``; :meth:`take` hands them over for one flush.

    When a flush fails, :meth:`restore` puts the counts back so they are sent
    later; after ``MAX_BUFFERED_FLUSHES`` failures in a row the oldest counts
    are dropped and ``dropped_flushes`` says so, so a long Redis outage never
    grows memory or blocks the store.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], dict[str, int]] = defaultdict(
            lambda: defaultdict(int)
        )
        self.failed_in_row = 0
        self.dropped_flushes = 0

    def add(self, key: tuple[str, int], name: str, amount: int = 1) -> None:
        self._counts[key][name] += amount

    def take(self) -> dict[tuple[str, int], dict[str, int]]:
        counts = {ds: dict(c) for ds, c in self._counts.items() if any(c.values())}
        self._counts.clear()
        return counts

    def restore(self, counts: dict[tuple[str, int], dict[str, int]]) -> None:
        self.failed_in_row += 1
        if self.failed_in_row > MAX_BUFFERED_FLUSHES:
            self.dropped_flushes += 1
            return
        for ds, c in counts.items():
            for name, amount in c.items():
                self._counts[ds][name] += amount

    def flushed(self) -> None:
        self.failed_in_row = 0

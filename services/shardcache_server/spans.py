"""Unit bytes the listing already read, held until their unit is built.

A tar shard has no index, so its listing reads every byte of it. Instead of
dropping those bytes and reading each unit again with a ranged GET at build
time, the listing keeps each unit's raw span in the object store and the
build of that unit takes it: each byte of the shard is read from the source
once per cluster.

Ownership: the listing task *yields* the spans (a streaming generator), so
the store that listed owns them, not the task's worker process (a pooled
worker may exit; what it ``ray.put`` itself would be lost with it). The
store holds them by unit version (:class:`HeldSpans`); a build on its own
node takes one directly, a build on another node asks it (one actor call
per chunk, ``CacheShard.take_span``) and Ray moves the bytes between object
stores.

Bounded: a store holds at most ``span_budget_bytes`` of spans
(:data:`SPAN_BUDGET_SHARE` of its cache budget, counting spans already held).
Units beyond it are not kept (:class:`SpanKeeper` counts them, and the store
logs a ``spans_over_budget`` event): their builds read the source with a
ranged GET, so those bytes are read twice. A span is dropped when a build
takes it (a rebuild after eviction reads the source, like any other
chunk), when a new listing no longer has its unit (file rewritten or gone),
and when the dataset is invalidated; spans of units that are never built
stay until then (bounded by the budget) or until the store restarts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from shardcache.packed_manifest import PackedManifest, unit_version

__all__ = ["SPAN_BUDGET_SHARE", "HeldSpans", "KeepSpan", "SpanKeeper"]

SPAN_BUDGET_SHARE = 0.25  # of the store's cache_bytes: spans are transient

# What a format calls with each unit it read whole while listing:
# ``keep(lo, hi, data)``; returns whether the bytes were kept.
KeepSpan = Callable[[int, int, bytes], bool]


class SpanKeeper:
    """The listing's side: keeps units' bytes within ``room_bytes``.

    Thread-safe (a listing opens many files at once). ``put(version, array)``
    hands a kept span on (to the task's generator, or ``ray.put`` in-process).

    Args:
        room_bytes: what the store can still hold.
        put: receives ``(unit version, uint8 array)`` for each kept unit.
        options: the format options (part of every unit's version).
    """

    def __init__(
        self,
        room_bytes: int,
        put: Callable[[str, np.ndarray], None],
        options: dict[str, Any],
    ):
        self._room = room_bytes
        self._put = put
        self._options = options
        self._lock = threading.Lock()
        self.kept = self.kept_bytes = self.over = self.over_bytes = 0

    def for_file(self, url: str, etag: str) -> KeepSpan:
        """The ``keep`` callback for one file's units."""

        def keep(lo: int, hi: int, data: bytes) -> bool:
            with self._lock:
                if len(data) > self._room:
                    self.over += 1
                    self.over_bytes += len(data)
                    return False
                self._room -= len(data)
                self.kept += 1
                self.kept_bytes += len(data)
            version = unit_version(url, etag, lo, hi, self._options)
            self._put(version, np.frombuffer(data, dtype=np.uint8))
            return True

        return keep

    def report(self) -> dict[str, int]:
        return {
            "kept": self.kept,
            "kept_bytes": self.kept_bytes,
            "over": self.over,
            "over_bytes": self.over_bytes,
        }


class HeldSpans:
    """The store's side: spans by dataset and unit version, within a budget.

    >>> spans = HeldSpans(100)
    >>> spans.hold("ds", {"00ab": ("ref", 60)})
    >>> spans.room(), spans.take("ds", "00ab"), spans.take("ds", "00ab")
    (40, 'ref', None)
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._held: dict[str, dict[str, tuple[Any, int]]] = {}

    @property
    def nbytes(self) -> int:
        return sum(n for spans in self._held.values() for _, n in spans.values())

    def room(self) -> int:
        return max(0, self.budget_bytes - self.nbytes)

    def hold(
        self,
        dataset: str,
        spans: dict[str, tuple[Any, int]],
        manifest: PackedManifest | None = None,
    ) -> None:
        """Keep a listing's new spans; with ``manifest``, drop held spans of
        units it no longer lists (their file was rewritten or removed)."""
        held = self._held.setdefault(dataset, {})
        if manifest is not None and held:
            listed = {f"{int(h):016x}" for h in manifest.columns["unit_hashes"]}
            for version in [v for v in held if v not in listed]:
                del held[version]
        held.update(spans)
        if not held:
            del self._held[dataset]

    def take(self, dataset: str, version: str) -> Any:
        """The span of unit ``version`` (no longer held), or None."""
        held = self._held.get(dataset)
        if not held or version not in held:
            return None
        ref, _ = held.pop(version)
        return ref

    def drop(self, dataset: str) -> int:
        """Forget every span of ``dataset`` (invalidated); returns how many."""
        return len(self._held.pop(dataset, {}))

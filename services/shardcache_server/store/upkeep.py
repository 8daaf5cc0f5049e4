"""The store's background loops: keep Redis in step with what is held.

Ownership rule: upkeep owns no data, only the loops and the listener
thread; it flushes counters and the heartbeat, releases a dead
predecessor's entries, re-records the table after a Redis outage, and
moves the table to the generations that invalidations announce.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from shardcache import keys
from shardcache.errors import BackendError
from shardcache_server.index import ClusterIndex
from shardcache_server.settings import ServiceSettings
from shardcache_server.store.datasets import Dataset
from shardcache_server.store.manifests import Manifests
from shardcache_server.store.records import IndexRecords
from shardcache_server.store.stats import StatsBuffer
from shardcache_server.store.table import HeldTable

__all__ = ["RESYNC_BACKOFF_S", "Upkeep"]

log = logging.getLogger(__name__)

RESYNC_BACKOFF_S = 1.0  # pause between Redis reconnect attempts of the listener


class Upkeep:
    """Flushes, heartbeats, resyncs and follows invalidations for one store.

    Args:
        settings: the service settings (Redis, namespace, flush period).
        table: what the store holds (re-recorded after an outage).
        datasets: the registered datasets (their generations are re-read
            when the listener reconnects).
        manifests: whose kept unit bytes an invalidation drops.
        records: the index link and its ``dirty`` flag.
        stats: the counters flushed every ``stats_flush_s``.
        info: the store's heartbeat record.
    """

    def __init__(
        self,
        settings: ServiceSettings,
        *,
        table: HeldTable,
        datasets: Mapping[str, Dataset],
        manifests: Manifests,
        records: IndexRecords,
        stats: StatsBuffer,
        info: Callable[[], Awaitable[dict[str, Any]]],
    ):
        self.settings = settings
        self._table = table
        self._datasets = datasets
        self._manifests = manifests
        self._records = records
        self._stats = stats
        self._info = info
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()

    def start(self) -> list[Coroutine[Any, Any, None]]:
        """Start the invalidation listener on the running loop; returns the
        loops the store runs as tasks."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(
            target=self._listen_forever, name="invalidations", daemon=True
        ).start()
        return [self._flush_forever(), self._release_predecessors()]

    def stop(self) -> None:
        self._stop.set()

    def advance(self, dataset: str, generation: int) -> None:
        """Move ``dataset`` to ``generation`` (retiring what this store held)."""
        self._table.advance(dataset, generation, self._datasets.get(dataset))

    async def flush_once(self) -> None:
        """Expire retired generations, flush counters and the heartbeat, and
        re-record the table if the index is dirty."""
        self._table.retired.expire()
        index = self._records.index
        if index is None:
            return
        counts = self._stats.take()
        info = await self._info()
        info["ts"] = time.time()
        try:
            if counts:
                node_id = self._records.node_id
                await asyncio.to_thread(index.flush_stats, counts, node_id)
            await asyncio.to_thread(index.heartbeat, self._records.node_id, info)
            self._stats.flushed()
            if self._records.dirty:
                await self._resync_index()
        except BackendError:
            self._stats.restore(counts)
            self._records.dirty = True

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stats_flush_s)
            await self.flush_once()

    async def _release_predecessors(self) -> None:
        """Drop the index entries of this node's dead earlier store, so no
        reader is pointed at values that died with it. Best effort: with Redis
        down, lookups still find the dead owner and take it over by
        compare-and-set (``MissResolver._claim``)."""
        index = self._records.index
        assert index is not None
        try:
            dropped = await asyncio.to_thread(
                index.release_predecessors, self._records.node_id, self._records.me
            )
        except BackendError:
            return
        if dropped:
            self._records.event("predecessor_released", "", entries=dropped)

    async def _resync_index(self) -> None:
        """After a Redis outage, re-record what this store holds."""
        index = self._records.index
        assert index is not None
        by_ds: dict[tuple[str, int], dict[str, dict[str, Any]]] = defaultdict(dict)
        for (ds, url), c in self._table.items():
            if keys.is_variant_key(url):
                continue  # node-local, never in the index
            by_ds[(ds, c.generation)][url] = {
                "etag": c.etag,
                "nbytes": c.nbytes,
                "samples": len(c.hashes),
                "owner": self._records.node_id,
                "generation": c.generation,
                **c.failure_fields(),
            }
        waiting = False
        for (ds, gen), entries in by_ds.items():
            current = await asyncio.to_thread(index.generation, ds)
            if current == 0:
                # Redis came back empty and no rank has registered the dataset
                # again yet: try again at the next flush, not never.
                waiting = True
                continue
            if current != gen:
                continue
            await asyncio.to_thread(index.record_entries, ds, gen, entries)
            await asyncio.to_thread(
                index.take_over, ds, gen, list(entries), "", self._records.me
            )
        self._records.dirty = waiting

    def _on_message(self, raw: str) -> None:
        try:
            msg = json.loads(raw)
            dataset, generation = str(msg["dataset"]), int(msg["generation"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed invalidation message")
            return
        if msg.get("paths"):
            # Changed chunks stay as they are: every hit compares the version,
            # so they are never served, and their unchanged members are
            # copied into the rebuilt chunk instead of being read again.
            return
        if generation > self._table.generation[dataset]:
            self._manifests.forget_kept(dataset)  # invalidated: read the source again
        self.advance(dataset, generation)

    def _listen_forever(self) -> None:
        """Pub/sub listener thread; reconnects and resyncs after Redis outages."""
        channel = keys.invalidation_channel(self.settings.namespace)
        while not self._stop.is_set():
            try:
                index = ClusterIndex.from_url(
                    self.settings.redis_url, self.settings.namespace
                )
                pubsub = index.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(channel)
                # Anything invalidated while we were away: catch up from the records.
                for name in list(self._datasets):
                    gen = index.generation(name)
                    self._call_soon(self.advance, name, gen)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg.get("type") == "message":
                        self._call_soon(self._on_message, msg["data"])
            except Exception as exc:  # any Redis failure: back off and reconnect
                if self._stop.is_set():
                    return
                log.warning(
                    "invalidation listener lost Redis (%s); reconnecting",
                    type(exc).__name__,
                )
                self._records.dirty = True
                time.sleep(RESYNC_BACKOFF_S)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

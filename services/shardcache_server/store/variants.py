"""Augmented variants in the store: built from the base chunk, on demand and in the background.

Ownership rule: ``VariantBuilds`` owns the variant builds in flight (one
future per ``(dataset, generation, variant key, version)``, settled once)
and the background queue. It takes base chunks from the table or the miss
path and admits variants to the table, never to the index, the claims or
the disk tier: a variant is node-local, derived from a base chunk this node
holds, and rebuilt from it in a build worker when lost (no source read).

A rank asks for variant ``v`` of chunk ``c`` (``c<n>.v<k>``, the version
``<base version>+aug:<fingerprint>``, ``shardcache.variants``):

1. the base: held, else resolved through the miss path (built once per
   cluster, like any miss);
2. no room for the variant in the budget (``HeldTable.variant_room``), or
   the rank's ``augment`` is not the one installed here: the base form is
   served instead, counted as ``variant_fallbacks`` (never an error);
3. else the variant is built (or its build in flight joined) in a build
   worker and admitted; the rank waits for it as for a miss;
4. the chunk's other ``K - 1`` variants are queued: built one at a time,
   only while no miss and no rank's variant build is in flight, so they
   never delay a miss.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import numpy as np

from shardcache.keys import parse_variant_key
from shardcache.transport.base import Status
from shardcache.variants import base_item, version_fingerprint
from shardcache_server.store.datasets import Builder, Dataset, Item, Result
from shardcache_server.store.misses import MissResolver
from shardcache_server.store.stats import StatsBuffer
from shardcache_server.store.table import Cached, HeldTable
from shardcache_server.variants import VariantRequest

__all__ = ["VariantBuilds"]

log = logging.getLogger(__name__)

BACKGROUND_BUILDS = 1  # background variant builds at once: the other workers stay free
IDLE_POLL_S = 0.05  # how often a queued background build looks for idle workers
SERVED = (
    Status.HIT,
    Status.FETCHED,
    Status.REMOTE_HIT,
    Status.UNCACHED,
    Status.DISK_READ,
)
Key = tuple[str, int, str, str]  # (dataset, generation, variant key, version)
Job = tuple[Dataset, int, Item]


class VariantBuilds:
    """Serves, builds and schedules the augmented variants of a store's chunks.

    Args:
        table: where base chunks are found and variants admitted.
        misses: the miss path (``MissResolver.get``), for a base chunk not held.
        stats: counters per ``(dataset, generation)``.
        build: builds one chunk or variant and returns ``(reference, report)``.
    """

    def __init__(
        self,
        *,
        table: HeldTable,
        misses: MissResolver,
        stats: StatsBuffer,
        build: Builder,
    ):
        self._table = table
        self._misses = misses
        self._stats = stats
        self._build = build
        self._inflight: dict[Key, asyncio.Future[Result]] = {}
        self._queue: deque[Job] = deque()
        self._queued: set[Key] = set()
        self._runner: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()  # background builds
        self._urgent = 0  # builds a rank is waiting for
        # Bytes promised to builds in flight: their variants are admitted only
        # when done, and a room check must not promise the same room twice.
        self._reserved = 0

    def __len__(self) -> int:
        """Variant builds in flight or queued."""
        return len(self._inflight) + len(self._queue) + len(self._running)

    async def get(
        self, ds: Dataset, generation: int, items: list[Item]
    ) -> list[Result]:
        """The result of every variant item (all missed in the table), in order."""
        return list(
            await asyncio.gather(*(self._one(ds, generation, it) for it in items))
        )

    async def _one(self, ds: Dataset, generation: int, item: Item) -> Result:
        key, version, _ = item
        _, variant = parse_variant_key(key)
        # 1. The base form: held here, else through the miss path.
        base_key, base_version, size = base_item(item)
        held = self._table.hit(ds.name, base_key, base_version, generation)
        if held is not None:
            base: Result = (Status.HIT, held.ref)
        else:
            (base,) = await self._misses.get(
                ds, generation, [(base_key, base_version, size)], forwarded=False
            )
            if base[0] not in SERVED:
                return base
            held = self._table.get(ds.name, base_key)
        # The caller found the variant missing, but awaited since (the base
        # above, the disk tier before): a request that found the base held
        # may have built and admitted it meanwhile. Never build it twice.
        done = self._table.hit(ds.name, key, version, generation)
        if done is not None:
            return (_origin(base[0]), done.ref)
        # 2. No room, or another augment than the one installed: the base form.
        spec = ds.variants
        nbytes = held.nbytes if held is not None else 0  # a variant's, about
        if (
            spec is None
            or variant is None
            or variant >= spec.k
            or spec.fingerprint != version_fingerprint(version)
            or base[0] in (Status.UNCACHED, Status.DISK_READ)
            or not (
                (ds.name, generation, key, version) in self._inflight
                or self._fits(ds.name, key, nbytes)
            )
        ):
            self._stats.add((ds.name, generation), "variant_fallbacks")
            return base
        # 3. Build it (or join the build in flight) and admit it.
        self._urgent += 1
        try:
            built = await asyncio.shield(
                self._start(ds, generation, item, base[1], nbytes)
            )
        finally:
            self._urgent -= 1
        # 4. The chunk's other variants, in the background.
        self._queue_others(ds, generation, item, variant)
        if built[0] == Status.HIT:
            return (_origin(base[0]), built[1])
        return built

    def _fits(self, dataset: str, chunk: str, nbytes: int) -> bool:
        """Room for one more variant of about ``nbytes``, after the builds in flight."""
        return self._table.variant_room(
            nbytes + self._reserved, replacing=(dataset, chunk)
        )

    def _start(
        self, ds: Dataset, generation: int, item: Item, base_ref: Any, nbytes: int
    ) -> asyncio.Future[Result]:
        """The future of the variant build of ``item``: the one in flight, or
        a new one started now (reserving ``nbytes`` of room until it is admitted)."""
        key = (ds.name, generation, item[0], item[1])
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._inflight[key] = fut
            self._reserved += nbytes
            asyncio.get_running_loop().create_task(
                self._build_and_admit(ds, generation, item, base_ref, key, nbytes)
            )
        return fut

    async def _build_and_admit(
        self,
        ds: Dataset,
        generation: int,
        item: Item,
        base_ref: Any,
        key: Key,
        nbytes: int,
    ) -> None:
        chunk_name, version, _ = item
        chunk, variant = parse_variant_key(chunk_name)
        spec = ds.variants
        assert spec is not None and variant is not None
        counts = (ds.name, generation)
        try:
            lo, _ = ds.manifest.layout.bounds(chunk)
            req = VariantRequest(
                ds.name, base_ref, lo, variant, spec.seed, spec.augment
            )
            try:
                ref, report = await self._build(req)
            finally:
                self._reserved -= nbytes
            self._stats.add(counts, "variant_builds")
            self._stats.add(counts, "variant_build_ms", report["build_ms"])
            self._stats.add(counts, "errors", len(report["errors"]))
            admitted = (
                not report["errors"]  # rows augment failed on: served, not held
                and self._table.generation[ds.name] == generation
                and self._table.admit(
                    ds.name,
                    chunk_name,
                    Cached(ref, version, generation, report["nbytes"], _NO_ROWS),
                )[0]
            )
            result: Result = (Status.HIT if admitted else Status.UNCACHED, ref)
        except Exception as exc:  # never leave a waiter hanging; report to each
            log.exception("building variant %s of %s failed", chunk_name, ds.name)
            result = (Status.ERROR, type(exc).__name__, f"{chunk_name!r}: {exc}")
        fut = self._inflight.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(result)

    # -- the background ---------------------------------------------------------
    def _queue_others(
        self, ds: Dataset, generation: int, item: Item, asked: int
    ) -> None:
        spec = ds.variants
        assert spec is not None
        base = base_item(item)
        for v in range(spec.k):
            other = spec.item(base, v)
            key = (ds.name, generation, other[0], other[1])
            if v == asked or key in self._queued or key in self._inflight:
                continue
            self._queued.add(key)
            self._queue.append((ds, generation, other))
        if self._queue and (self._runner is None or self._runner.done()):
            self._runner = asyncio.get_running_loop().create_task(self._run_queue())

    def _busy(self) -> bool:
        """A miss or a rank's variant build is in flight: background waits."""
        return len(self._misses) > 0 or self._urgent > 0

    async def _run_queue(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            if self._busy() or len(self._running) >= BACKGROUND_BUILDS:
                await asyncio.sleep(IDLE_POLL_S)
                continue
            task = loop.create_task(self._background(*self._queue.popleft()))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _background(self, ds: Dataset, generation: int, item: Item) -> None:
        """Build one queued variant if it is still wanted and fits."""
        chunk_name, version, _ = item
        key = (ds.name, generation, chunk_name, version)
        self._queued.discard(key)
        held = self._table.get(ds.name, chunk_name)
        if (
            key in self._inflight
            or self._table.generation[ds.name] != generation
            or (held is not None and held.etag == version)
        ):
            return
        base_key, base_version, _ = base_item(item)
        base = self._table.get(ds.name, base_key)
        if base is None or base.etag != base_version or base.generation != generation:
            return  # the base left: a rank asking rebuilds it on demand
        if not self._fits(ds.name, chunk_name, base.nbytes):
            return  # the variants that fit stay; the rest are read as the base
        await self._start(ds, generation, item, base.ref, base.nbytes)


def _origin(base: Status) -> Status:
    """How a held variant is reported: where the rank's samples came from is
    where the base came from (read from the source or a peer for it, or a hit)."""
    return base if base in (Status.FETCHED, Status.REMOTE_HIT) else Status.HIT


_NO_ROWS = np.zeros(0, dtype=np.uint64)  # a variant is never rebuilt row by row

"""The cache store: one per Ray node, owning the ObjectRefs of the chunks it caches.

The unit of everything here (claims, pull-once, eviction, retired
generations, index entries) is a chunk: a run of consecutive samples built
by ``builder.py`` in worker processes of the node. ``CacheShard`` is a plain
class (tests drive it without Ray); ``actor.py`` is the only place it
becomes a Ray actor.

Ownership rule: the shard answers the actor API and serves hits; it owns
the registered datasets and coordinates the rooms that own the rest (the
held table, the miss path, listings, the disk tier, index records, upkeep,
content checks).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from shardcache import keys
from shardcache.errors import BackendError, StaleVersionError
from shardcache.redaction import redact_url
from shardcache.transport.base import Status
from shardcache.variants import VariantSpec, base_item
from shardcache_server.eviction import SamplerOrder, make_policy
from shardcache_server.index import ClusterIndex
from shardcache_server.listing import Lister, list_in_thread, listing_budget
from shardcache_server.settings import ServiceSettings
from shardcache_server.spans import SPAN_BUDGET_SHARE
from shardcache_server.store.checks import ContentChecks
from shardcache_server.store.datasets import Builder, Dataset, Item, Result
from shardcache_server.store.disk_tier import DiskTier
from shardcache_server.store.manifests import Manifests
from shardcache_server.store.misses import MissResolver
from shardcache_server.store.records import IndexRecords
from shardcache_server.store.retired import RetiredGenerations
from shardcache_server.store.spill import Spill
from shardcache_server.store.stats import StatsBuffer
from shardcache_server.store.table import HeldTable
from shardcache_server.store.upkeep import Upkeep
from shardcache_server.store.variants import VariantBuilds

__all__ = ["CacheShard", "Item", "Result"]

log = logging.getLogger(__name__)

RECHECK_S = 5.0  # how long "that generation is not current" is believed


class CacheShard:
    """Caches preprocessed chunks of any number of datasets on one node.

    Args:
        settings: the service settings (budget, eviction, fetch limits, Redis).
        node_id: the Ray node this store serves.
        put: stores a value and returns a reference; ``ray.put`` under Ray.
        get: maps a reference back to its value (or an awaitable of it);
            under Ray the ObjectRef itself, awaited on the event loop.
        peer: returns the store handle of another node, or ``None`` if gone.
        build: builds one chunk and returns ``(reference, report)``; under
            Ray a task pinned to this node (``builder.RayChunkBuilder``).
        lister: lists a dataset's source. Defaults to listing in a thread of
            this process (``listing.list_in_thread``); under Ray a task.
    """

    def __init__(
        self,
        settings: dict[str, Any] | ServiceSettings,
        node_id: str,
        *,
        put: Callable[[Any], Any],
        get: Callable[[Any], Any],
        peer: Callable[[str], Any],
        build: Builder,
        lister: Lister | None = None,
    ):
        self.settings = (
            settings
            if isinstance(settings, ServiceSettings)
            else ServiceSettings(**settings)
        )
        self.node_id = node_id
        self.incarnation = uuid.uuid4().hex[:8]
        self.me = f"{node_id}/{self.incarnation}"
        self._datasets: dict[str, Dataset] = {}
        # (dataset, generation) below this store's -> when the index last
        # said it is not current (see _rebase_if_index_restarted).
        self._lower_checked: dict[tuple[str, int], float] = {}
        self._stats = StatsBuffer()
        self._records = IndexRecords(node_id, self.me, self.settings.preprocess_workers)
        self._table = HeldTable(
            make_policy(self.settings.eviction, self.settings.cache_bytes),
            RetiredGenerations(self.settings.retire_grace_s),
        )
        self._manifests = Manifests(
            node_id,
            self._records,
            peer=peer,
            get=get,
            lister=lister
            or list_in_thread(
                put, listing_budget(self.settings), self.settings.stream_after_s
            ),
            span_budget_bytes=int(self.settings.cache_bytes * SPAN_BUDGET_SHARE),
        )
        self._spill = (
            Spill(
                DiskTier(
                    self.settings.disk_dir,
                    self.settings.namespace,
                    self.settings.disk_bytes,
                ),
                put=put,
                get=get,
                datasets=self._datasets,
                table=self._table,
                records=self._records,
                stats=self._stats,
            )
            if self.settings.disk_dir
            else None
        )
        self._misses = MissResolver(
            self.settings,
            table=self._table,
            spill=self._spill,
            manifests=self._manifests,
            records=self._records,
            stats=self._stats,
            peer=peer,
            build=build,
        )
        self._variants = VariantBuilds(
            table=self._table, misses=self._misses, stats=self._stats, build=build
        )
        self._checks = ContentChecks(
            table=self._table,
            spill=self._spill,
            misses=self._misses,
            records=self._records,
            datasets=self._datasets,
            get=get,
            peer=peer,
        )
        self._upkeep = Upkeep(
            self.settings,
            table=self._table,
            datasets=self._datasets,
            manifests=self._manifests,
            records=self._records,
            stats=self._stats,
            info=self.info,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._loop is not None:
            return
        # Connected before the store counts as started: a store that could
        # not reach Redis tries again at the next call, never serves without
        # an index (IndexUnavailable, with the redacted URL, reaches the caller).
        index = ClusterIndex.from_url(self.settings.redis_url, self.settings.namespace)
        self._loop = asyncio.get_running_loop()
        self._records.index = index
        # A new incarnation means the previous one (if any) lost its cache.
        self._records.event("store_start", "", incarnation=self.incarnation)
        loops = self._upkeep.start()
        if self._spill is not None:  # adopt what a previous store left on disk
            loops.append(self._spill.start())
        self._tasks += [self._loop.create_task(c) for c in loops]

    async def ping(self) -> str:
        """Start background work and return ``node_id/incarnation``."""
        self._ensure_started()
        return self.me

    async def redis_location(self) -> str:
        """The Redis this store uses, its password redacted: a process asking
        with another one learns it without either secret crossing."""
        return redact_url(self.settings.redis_url)

    async def settings_in_use(self) -> dict[str, Any]:
        """The settings this store started with, without the Redis URL and
        the storage options (they may hold secrets)."""
        return self.settings.model_dump(exclude={"redis_url", "storage_options"})

    async def close(self) -> None:
        """Flush stats and stop background work (tests, graceful shutdown)."""
        self._upkeep.stop()
        for t in self._tasks:
            t.cancel()
        await self.flush_disk()
        await self._upkeep.flush_once()
        self._records.close()

    # -- public API ------------------------------------------------------------
    async def install(
        self,
        spec: dict[str, Any],
        preprocess: Callable[[bytes], Any],
        target: Callable[[str], Any] | None = None,
    ) -> int:
        """Learn how to build a dataset's chunks; returns its generation.

        ``spec["manifest"]`` is the digest of the listing the caller reads;
        this store maps that manifest (from its holder) before answering. The
        callables come from the job that registered the dataset (through
        Ray), never from Redis.
        """
        self._ensure_started()
        name = keys.validate_name("dataset name", spec["name"])
        manifest = await self._manifests.by_digest(name, spec["manifest"], spec)
        if spec.get("order"):  # the rank's sampler: clairvoyant eviction plans on it
            self._table.policy.learn(
                name, SamplerOrder.from_spec(spec["order"], manifest.layout.sizes())
            )
        generation = int(spec["generation"])
        held = self._datasets.get(name)
        if (
            held is not None
            and generation == self._table.generation[name]
            and held.fingerprint != spec["fingerprint"]
        ) or generation < self._table.generation[name]:
            # A new fingerprint always gets a new generation, and generations
            # only grow, unless the index started over. Once per job: asked.
            await self._rebase_if_index_restarted(name, generation, recheck=True)
        # Advance first: the generation being retired keeps its own spec.
        self._upkeep.advance(name, generation)
        self._datasets[name] = Dataset(
            name,
            spec["protocol"],
            spec["fingerprint"],
            preprocess,
            dict(spec.get("storage_options") or {}),
            manifest,
            spec["manifest"],
            target,
            spec.get("urls", ""),
            spec.get("source_object"),
            {k: v for k, v in spec.items() if k not in ("order", "source_object")},
            VariantSpec.from_install(spec.get("variants")),
        )
        return self._table.generation[name]

    async def _rebase_if_index_restarted(
        self, dataset: str, generation: int, *, recheck: bool = False
    ) -> bool:
        """Whether the index says ``generation`` is current although this store
        numbered ``dataset`` otherwise (later, or the same for another
        fingerprint); if so, everything held under the old numbers is dropped
        (``HeldTable.rebase``). An index that cannot answer changes nothing."""
        index = self._records.index
        if index is None:
            return False
        # Ranks finishing an epoch on an invalidated generation ask with it in
        # every batch: one question per generation every few seconds, not one
        # Redis read per batch per rank.
        now = time.monotonic()
        last = self._lower_checked.get((dataset, generation), -1e9)
        if not recheck and now - last < RECHECK_S:
            return False
        try:
            current = await asyncio.to_thread(index.generation, dataset)
        except BackendError:
            return False
        if current != generation:
            self._lower_checked[(dataset, generation)] = now
            return False  # a late caller of a generation since invalidated
        held = self._table.generation[dataset]
        dropped = self._table.rebase(dataset, generation)
        for key in [k for k in self._lower_checked if k[0] == dataset]:
            del self._lower_checked[key]
        self._records.event(
            "index_restarted",
            dataset,
            generation=generation,
            store_generation=held,
            dropped=dropped,
        )
        log.warning(
            "the index numbers dataset %r generation %d where this store held %d: "
            "Redis lost its records; %d chunks held under the old numbering are "
            "dropped and will be read again",
            dataset, generation, held, dropped,
        )  # fmt: skip
        return True

    async def installed(self, dataset: str) -> list[Any]:
        """``[spec, preprocess, target]`` of ``dataset`` as a job registered it
        here, or ``[]``: ``shardcache warm --like`` warms with exactly that."""
        ds = self._datasets.get(dataset)
        if ds is None or ds.spec is None:
            return []
        return [dict(ds.spec), ds.preprocess, ds.target]

    async def manifest(
        self,
        spec: dict[str, Any],
        token: str = "",
        *,
        forwarded: bool = False,
        early: bool = False,
    ) -> list[Any]:
        """``[reference, digest]`` of the dataset's published manifest.

        Listed once per cluster: the store holding the claim in Redis lists
        (again for each new refresh ``token``; ``""`` takes any listing);
        every other store forwards to it. The reference is wrapped in a list
        so Ray hands it over unresolved. ``early``: a listing that runs
        longer than ``stream_after_s`` may answer with its first whole
        chunks (a manifest whose ``is_prefix`` is true); :meth:`leading`
        gives the longer prefixes that follow and, once it ends, this
        method the whole listing.
        """
        self._ensure_started()
        name = keys.validate_name("dataset name", spec["name"])
        return await self._manifests.published(
            name, spec, token, forwarded=forwarded, early=early
        )

    async def leading(self, dataset: str, digest: str) -> list[Any]:
        """``[reference, digest, state]``: what follows prefix ``digest`` of
        ``dataset``'s listing: its longest prefix so far (``"listing"``), the
        finished listing (``"done"``), or ``"failed"``; ``[]`` if unknown."""
        return await self._manifests.leading(dataset, digest)

    async def take_span(self, dataset: str, version: str) -> list[Any]:
        """``[reference]`` of the bytes this store's listing kept for unit
        ``version`` (no longer held here), or ``[]``: a peer's build asks."""
        return self._manifests.take_kept(dataset, version)

    async def manifest_of(self, dataset: str, digest: str) -> list[Any]:
        """``[reference]`` of a manifest this store holds, or ``[]`` (peers ask)."""
        return self._manifests.held_ref(dataset, digest)

    async def get(
        self,
        dataset: str,
        generation: int,
        items: list[Item],
        *,
        forwarded: bool = False,
        digest: str | None = None,
        files: bool = False,
        prefer_files: bool = False,
        reader: str = "",
    ) -> list[Result]:
        """Return a chunk reference (or an error record) for every item, in order.

        Hits cost nothing but a dict lookup. Misses are claimed in Redis: this
        store builds the chunks it owns and asks the owner store for the
        rest, so each object is read from the source once per cluster.
        ``digest`` names the listing the caller's chunk versions come from.

        ``files``: the caller runs on this node and can map chunk files. A
        chunk not in memory whose file on this node's disk tier matches is
        then answered ``(Status.DISK, path)`` instead of being reloaded whole
        into the object store, unless it fits the memory budget's free room
        (used + retired + chunk <= budget): then it is re-admitted (nothing
        is evicted for it), so a dataset that fits in memory ends up there,
        while one larger than the budget is read row by row from its files
        and never churns the object store.

        An item whose key names an augmented variant (``c<n>.v<k>``) is
        served by ``store/variants.py``: held, built here from the base, or
        answered with the base form when the budget cannot hold it.

        ``prefer_files`` (with ``files``): the caller keeps no chunk from
        memory between batches (its hold budget is spent), so a held chunk
        whose file is on the disk tier is answered with the file too: the
        caller keeps a mapped file for its epoch without pinning memory and
        asks for it once an epoch instead of once a batch.

        ``reader``: the reading the caller asks for (``job:epoch``, or "").
        A held chunk built from the source for that same reading is answered
        ``FETCHED``, not ``HIT``: every rank of the job that reads rows of it
        in that epoch counts them as source reads, so the ranks' source
        counts add up to the reads made (a chunk split between two ranks is
        built once, for whichever asked first).
        """
        self._ensure_started()
        ds = self._datasets.get(dataset)
        if ds is None:
            return [(Status.UNINSTALLED,)] * len(items)
        if digest is not None and digest != ds.digest:
            try:
                manifest = await self._manifests.by_digest(
                    dataset,
                    digest,
                    {"urls": ds.urls, "storage_options": ds.storage_options},
                )
            except StaleVersionError as exc:
                return [(Status.ERROR, "StaleVersionError", str(exc))] * len(items)
            ds = replace(ds, manifest=manifest, digest=digest)
        known = self._table.generation[dataset]
        if generation < known and await self._rebase_if_index_restarted(
            dataset, generation
        ):
            known = generation
        if generation < known:
            retired = self._table.retired.spec(dataset, generation)
            if retired is not None:
                # An invalidated generation is served in its base form only
                # (the rank counts it as a fallback): its variants are gone.
                base = [base_item(it) for it in items]
                return await self._misses.serve_retired(retired, generation, base)
            msg = (
                f"dataset {dataset!r} generation {generation} was invalidated; "
                f"the current generation is {known}. Re-read the generation and retry."
            )
            return [(Status.ERROR, "StaleVersionError", msg)] * len(items)
        if generation > known:
            self._upkeep.advance(dataset, generation)
        if not forwarded:  # one call is one batch of a local rank
            self._table.policy.observe([(dataset, url) for url, _, _ in items])
        counts = (dataset, generation)
        results: list[Result | None] = [None] * len(items)
        missed: list[int] = []
        held_bytes: dict[int, int] = {}  # served from memory: bytes_served
        built_here: set[int] = set()  # held, built for this reading (FETCHED)
        for i, (url, etag, _) in enumerate(items):
            cached = self._table.hit(dataset, url, etag, generation)
            if cached is None:
                missed.append(i)
                continue
            if reader and cached.built_for == reader:
                built_here.add(i)
                results[i] = (Status.FETCHED, cached.ref)
            else:
                results[i] = (Status.HIT, cached.ref)
            if not forwarded:
                self._stats.add(counts, "hits")
                held_bytes[i] = cached.nbytes
        # Variants are built here from the base (store/variants.py), never
        # claimed, forwarded or written to the disk tier.
        variants = [i for i in missed if keys.is_variant_key(items[i][0])]
        missed = [i for i in missed if not keys.is_variant_key(items[i][0])]
        if files and not forwarded and self._spill is not None:
            # A chunk built for this reading stays a reference: as a file the
            # rank would count its rows as disk reads, not the source's.
            held = [
                i
                for i in held_bytes
                if prefer_files
                and not keys.is_variant_key(items[i][0])
                and i not in built_here
            ]
            if held or missed:
                missed = await self._serve_files(
                    ds, generation, items, missed, results, held=held
                )
        for i, nbytes in held_bytes.items():
            res = results[i]
            if res is not None and res[0] != Status.DISK:  # not handed as its file
                self._stats.add(counts, "bytes_served", nbytes)
        if missed or variants:
            bases, views = await asyncio.gather(
                self._misses.get(
                    ds,
                    generation,
                    [items[i] for i in missed],
                    forwarded=forwarded,
                    reader=reader,
                ),
                self._variants.get(ds, generation, [items[i] for i in variants]),
            )
            for i, res in zip(missed + variants, bases + views, strict=True):
                results[i] = res
                if not forwarded and res[0] != Status.ERROR:
                    # A variant built from (or answered by) a held base read
                    # nothing from the source: a hit, as a peer's chunk is.
                    is_hit = res[0] in (Status.REMOTE_HIT, Status.DISK_READ) or (
                        res[0] == Status.HIT and i in variants
                    )
                    self._stats.add(counts, "hits" if is_hit else "misses")
        return [r for r in results if r is not None]

    async def _serve_files(
        self,
        ds: Dataset,
        generation: int,
        items: list[Item],
        missed: list[int],
        results: list[Result | None],
        *,
        held: list[int],
    ) -> list[int]:
        """Answer missed items with their disk-tier file where that is the
        better choice (see :meth:`get`), and ``held`` items (in memory,
        already counted as hits; ``prefer_files``) whenever their file is
        written, with one look at the disk tier; returns the items still
        missed."""
        assert self._spill is not None
        if generation != self._table.generation[ds.name]:
            return missed
        asked = missed + held
        found = await self._spill.files(
            ds, generation, [items[i] for i in asked], settle=len(missed)
        )
        policy, retired = self._table.policy, self._table.retired
        counts = (ds.name, generation)
        rest = []
        for j, (i, file) in enumerate(zip(asked, found, strict=True)):
            is_held = j >= len(missed)
            if file is None:
                if not is_held:
                    rest.append(i)
                continue
            path, nbytes = file
            room = policy.used_bytes + retired.nbytes + nbytes <= policy.budget_bytes
            if room and not is_held:
                rest.append(i)  # room to spare: back into memory (miss path)
                continue
            results[i] = (Status.DISK, path)
            if not is_held:
                self._stats.add(counts, "hits")
            self._stats.add(counts, "disk_files")
        return rest

    async def rows_read(
        self, dataset: str, generation: int, chunks: list[str]
    ) -> dict[str, int]:
        """Of ``chunks`` held here, how many rows their builds read from the
        source (a partial rebuild reads only its changed members): what
        ``shardcache warm`` reports as fetched."""
        out = {}
        for chunk in chunks:
            cached = self._table.get(dataset, chunk)
            if (
                cached is not None
                and cached.generation == generation
                and cached.sourced_rows is not None
            ):
                out[chunk] = cached.sourced_rows
        return out

    async def drop(self, dataset: str, urls: list[str] | None = None) -> int:
        """Forget cached values of a dataset (all, or only ``urls``)."""
        victims = [
            k
            for k, _ in self._table.items()
            if k[0] == dataset and (urls is None or k[1] in urls)
        ]
        for k in victims:
            self._table.evict(k)
        if urls is None:
            self._table.retired.drop(dataset)
            if self._spill is not None:
                await asyncio.to_thread(self._spill.disk.drop, dataset)
        elif self._spill is not None:
            for url in urls:
                await asyncio.to_thread(self._spill.disk.remove, dataset, url)
        return len(victims)

    async def flush_disk(self) -> dict[str, int]:
        """Wait for the disk writes in flight (tests, graceful shutdown)."""
        return await self._spill.flush() if self._spill is not None else {}

    # -- content checks (checks.py) ---------------------------------------------
    async def verify_contents(
        self, dataset: str, repair: bool = False
    ) -> dict[str, Any]:
        """Check the contents of every chunk of ``dataset`` this store holds, in
        memory and on disk, against the checksum written when it was built.

        With ``repair`` each bad chunk is dropped and built again, once (from
        the source, or from its disk file when that still verifies), and the
        rebuilt chunk is checked too. Returns ``{"node", "checked", "bad",
        "repaired", "still_bad"}``; ``bad`` lists chunk keys (a disk file
        only: ``"c3 (disk)"``).
        """
        self._ensure_started()
        return await self._checks.verify(dataset, repair)

    async def drop_corrupt(
        self, dataset: str, generation: int, chunk: str, *, forwarded: bool = False
    ) -> bool:
        """A rank found ``chunk`` failing its checksum: forget it here (or at
        its owner) so that the next request builds it again. True if dropped.

        The rank and the store map the same object-store pages, so the rank's
        finding is the store's too; a disk file is kept only if it verifies.
        """
        self._ensure_started()
        return await self._checks.drop_corrupt(
            dataset, generation, chunk, forwarded=forwarded
        )

    # -- what is held ----------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        """What this store holds: bytes, entries, per-dataset counts."""
        policy = self._table.policy
        return {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "used_bytes": policy.used_bytes,
            "budget_bytes": policy.budget_bytes,
            "entries": len(self._table),
            "eviction": self.settings.eviction,
            "bytes_by_dataset": self._table.bytes_by_dataset(),
            "generations": dict(self._table.generation),
            "dropped_stat_flushes": self._stats.dropped_flushes,
            "inflight": len(self._misses),
            "variant_builds": len(self._variants),
            **self._table.retired.summary(),
            **(self._spill.disk.summary() if self._spill is not None else {}),
        }

    async def snapshot(self, dataset: str) -> dict[str, dict[str, Any]]:
        """What this store holds for ``dataset``: chunk -> etag, generation,
        bytes and tier, in memory or only in the disk tier (a chunk evicted
        from memory keeps its index entry while its file serves it)."""
        held = {
            url: {
                "etag": c.etag,
                "generation": c.generation,
                "nbytes": c.nbytes,
                "tier": "memory",
            }
            for (ds, url), c in self._table.items()
            if ds == dataset
        }
        if self._spill is not None:
            disk = self._spill.disk
            for chunk in disk.chunks(dataset):
                if chunk in held:
                    continue
                meta = await asyncio.to_thread(disk.header, dataset, chunk)
                if meta is not None:
                    held[chunk] = {
                        "etag": meta.get("version"),
                        "generation": meta.get("generation"),
                        "nbytes": meta["nbytes"],
                        "tier": "disk",
                    }
        return held

"""The cache store: one per Ray node, owning the ObjectRefs of the chunks it caches.

The unit of everything here (claims, pull-once, eviction, retired
generations, index entries) is a chunk: a run of consecutive samples built
by ``builder.py`` in worker processes of the node. ``CacheShard`` is a plain
class (tests drive it without Ray); ``start_shard`` is the only place it
becomes a Ray actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardcache import keys
from shardcache.checksum import is_intact
from shardcache.errors import (
    BackendError,
    ChunkFileError,
    ConfigError,
    ShardCacheError,
    StaleVersionError,
)
from shardcache.manifest import Manifest
from shardcache.packed_manifest import PackedManifest
from shardcache_server.builder import BuildRequest, RayChunkBuilder
from shardcache_server.disk_tier import DiskTier
from shardcache_server.eviction import SamplerOrder, make_policy
from shardcache_server.formats import FORMATS
from shardcache_server.index import ClusterIndex as RedisIndex
from shardcache_server.listing import Listed, Listings, RayLister, list_in_thread
from shardcache_server.retired import RetiredGenerations
from shardcache_server.settings import ServiceSettings
from shardcache_server.spans import SPAN_BUDGET_SHARE
from shardcache_server.stats import StatsBuffer

__all__ = ["CacheShard", "Item", "Result", "ray_namespace", "start_shard", "store_name"]

log = logging.getLogger(__name__)

Item = tuple[str, str, int]  # (chunk key, chunk version, source bytes)
# ("hit"|"fetched"|"remote-hit"|"uncached", ref) or ("error", class, message)
# or ("unregistered",) when the store lost the dataset's preprocess (restart).
Builder = Callable[[BuildRequest], Awaitable[tuple[Any, dict[str, Any]]]]
Result = tuple[Any, ...]
RESYNC_BACKOFF_S = 1.0  # pause between Redis reconnect attempts of the listener
DISK_WRITES = 2  # chunk files written at once per store (sequential disk bandwidth)


def store_name(node_id: str) -> str:
    return f"store-{node_id}"


def ray_namespace(ns: str) -> str:
    return f"shardcache-{ns}"


@dataclass
class _Cached:
    ref: Any
    etag: str  # the chunk's version
    generation: int
    nbytes: int
    hashes: np.ndarray  # member (url, etag) hashes: which rows a rebuild may reuse


@dataclass
class _Dataset:
    name: str
    protocol: str
    fingerprint: str
    preprocess: Callable[[bytes], Any]
    storage_options: dict[str, Any]
    manifest: Manifest
    digest: str
    target: Callable[[str], Any] | None = None
    urls: Any = ""  # the source (prefix, glob or list), to list it again
    source: Any = None  # a user's map-style Dataset (``from_dataset``), via Ray
    spec: dict[str, Any] | None = None  # as registered (``warm --like`` copies it)


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
    """

    def __init__(
        self,
        settings: dict[str, Any] | ServiceSettings,
        node_id: str,
        *,
        put: Callable[[Any], Any] | None = None,
        get: Callable[[Any], Any] | None = None,
        peer: Callable[[str], Any] | None = None,
        build: Builder | None = None,
    ):
        self.settings = (
            settings
            if isinstance(settings, ServiceSettings)
            else ServiceSettings(**settings)
        )
        self.node_id = node_id
        self.incarnation = uuid.uuid4().hex[:8]
        self.me = f"{node_id}/{self.incarnation}"
        self._put = put or _ray_put
        self._get = get or _awaitable_ref
        self._peer = peer or (lambda node: _ray_peer(self.settings.namespace, node))
        self._build = build
        self._policy = make_policy(self.settings.eviction, self.settings.cache_bytes)
        self._retired = RetiredGenerations(self.settings.retire_grace_s)
        self._disk = (
            DiskTier(
                self.settings.disk_dir,
                self.settings.namespace,
                self.settings.disk_bytes,
            )
            if self.settings.disk_dir
            else None
        )
        self._disk_writes: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._disk_slots: asyncio.Semaphore | None = None
        # Under Ray (no build function given) listings run in a task too.
        self._listings = Listings(
            self._get,
            list_in_thread(self._put) if build is not None else self._ray_lister,
            int(self.settings.cache_bytes * SPAN_BUDGET_SHARE),
        )
        # The node whose store listed each dataset: it holds the units'
        # bytes that listing kept (tar), which builds here ask it for.
        self._listed_on: dict[str, str] = {}
        self._table: dict[tuple[str, str], _Cached] = {}
        self._datasets: dict[str, _Dataset] = {}
        self._generation: dict[str, int] = defaultdict(int)
        self._inflight: dict[tuple[str, int, str, str], asyncio.Future[Result]] = {}
        self._stats = StatsBuffer()
        self._pool = ThreadPoolExecutor(
            self.settings.preprocess_workers, thread_name_prefix="index-writes"
        )
        self._index: RedisIndex | None = None
        self._index_dirty = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _ray_lister(
        self, spec: dict[str, Any], previous: Any, room_bytes: int
    ) -> Listed:
        return await RayLister(self.node_id)(spec, previous, room_bytes)

    # -- lifecycle -------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self._build is None:
            self._build = RayChunkBuilder(
                self.settings, self.node_id, _build_workers(self.settings, self.node_id)
            ).build
        self._index = RedisIndex.from_url(
            self.settings.redis_url, self.settings.namespace
        )
        # A new incarnation means the previous one (if any) lost its cache.
        self._event("store_start", "", incarnation=self.incarnation)
        self._tasks.append(self._loop.create_task(self._flush_forever()))
        self._tasks.append(self._loop.create_task(self._release_predecessors()))
        if self._disk is not None:  # adopt what a previous store left on disk
            self._disk_slots = asyncio.Semaphore(DISK_WRITES)
            self._tasks.append(self._loop.create_task(self._scan_disk()))
        threading.Thread(
            target=self._listen_forever, name="invalidations", daemon=True
        ).start()

    async def ping(self) -> str:
        """Start background work and return ``node_id/incarnation``."""
        self._ensure_started()
        return self.me

    async def close(self) -> None:
        """Flush stats and stop background work (tests, graceful shutdown)."""
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await self.flush_disk()
        await self._flush_once()
        self._pool.shutdown(wait=False)

    # -- public API ------------------------------------------------------------
    async def register(
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
        manifest = await self._manifest_by_digest(name, spec["manifest"], spec)
        if spec.get("order"):  # the rank's sampler: clairvoyant eviction plans on it
            self._policy.learn(
                name, SamplerOrder.from_spec(spec["order"], manifest.layout.sizes())
            )
        # Advance first: the generation being retired keeps its own spec.
        self._advance(name, int(spec["generation"]))
        self._datasets[name] = _Dataset(
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
        )
        return self._generation[name]

    async def registered(self, dataset: str) -> list[Any]:
        """``[spec, preprocess, target]`` of ``dataset`` as a job registered it
        here, or ``[]``: ``shardcache warm --like`` warms with exactly that."""
        ds = self._datasets.get(dataset)
        if ds is None or ds.spec is None:
            return []
        return [dict(ds.spec), ds.preprocess, ds.target]

    async def manifest(
        self, spec: dict[str, Any], token: str = "", *, forwarded: bool = False
    ) -> list[Any]:
        """``[reference, digest]`` of the dataset's published manifest.

        Listed once per cluster: the store holding the claim in Redis lists
        (again for each new refresh ``token``; ``""`` takes any listing);
        every other store forwards to it. The reference is wrapped in a list
        so Ray hands it over unresolved.
        """
        self._ensure_started()
        assert self._index is not None
        name = keys.validate_name("dataset name", spec["name"])
        mine = self._listings.published(name, token)
        if mine is not None:
            return [mine[0], mine[1]]
        holder = ""
        if not forwarded:
            try:
                record = await asyncio.to_thread(self._index.manifest_record, name)
                holder = record.get("owner", "")
                if holder and holder != self.me:
                    found = await self._manifest_from(holder, spec, token)
                    if found is not None:
                        return found
                holder = await asyncio.to_thread(
                    self._index.claim_manifest, name, holder, self.me
                )
                if holder != self.me:  # another store won the race: it lists
                    found = await self._manifest_from(holder, spec, token)
                    if found is not None:
                        return found
                    await asyncio.to_thread(
                        self._index.claim_manifest, name, holder, self.me
                    )
            except BackendError:
                self._index_dirty = True  # Redis down: list here, at worst twice
        ref, digest, manifest = await self._listings.publish(spec, token)
        await self._publish_listing(name, digest, manifest)
        return [ref, digest]

    async def take_span(self, dataset: str, version: str) -> list[Any]:
        """``[reference]`` of the bytes this store's listing kept for unit
        ``version`` (no longer held here), or ``[]``: a peer's build asks."""
        ref = self._listings.spans.take(dataset, version)
        return [] if ref is None else [ref]

    async def manifest_of(self, dataset: str, digest: str) -> list[Any]:
        """``[reference]`` of a manifest this store holds, or ``[]`` (peers ask)."""
        found = self._listings.held(dataset, digest)
        return [] if found is None else [found[0]]

    async def _manifest_from(
        self, holder: str, spec: dict[str, Any], token: str
    ) -> list[Any] | None:
        handle = self._peer(holder.split("/", 1)[0])
        if handle is None:
            return None
        try:
            ref, digest = await handle.manifest.remote(spec, token, forwarded=True)
        except Exception as exc:  # the holder died: whoever asks next lists
            if type(exc).__module__.split(".")[0] != "ray":
                raise
            return None
        await self._listings.adopt(spec["name"], digest, ref)
        self._listed_on[spec["name"]] = holder.split("/", 1)[0]
        return [ref, digest]

    async def _manifest_by_digest(
        self, dataset: str, digest: str, spec: dict[str, Any]
    ) -> Manifest:
        found = self._listings.held(dataset, digest)
        if found is not None:
            return found[1]
        assert self._index is not None
        record = await asyncio.to_thread(self._index.manifest_record, dataset)
        holder = record.get("owner", "")
        handle = self._peer(holder.split("/", 1)[0]) if holder else None
        if handle is not None and holder != self.me:
            refs = await handle.manifest_of.remote(dataset, digest)
            if refs:
                self._listed_on[dataset] = holder.split("/", 1)[0]
                return await self._listings.adopt(dataset, digest, refs[0])
        # Nobody holds that listing any more (holder restarted): list again;
        # a different result means the caller must re-read it.
        ref, got, manifest = await self._listings.publish({**spec, "name": dataset})
        await self._publish_listing(dataset, got, manifest)
        if got != digest:
            raise StaleVersionError(
                f"the listing of dataset {dataset!r} the rank read ({digest}) is gone "
                f"and the source now lists {got}. Call refresh() on every rank."
            )
        return manifest

    async def _publish_listing(
        self, name: str, digest: str, manifest: Manifest
    ) -> None:
        """Record the new listing and drop index entries of chunks that changed."""
        assert self._index is not None
        self._listed_on[name] = self.node_id
        over = self._listings.over_budget.pop(name, None)
        if over is not None:
            self._event("spans_over_budget", name, **over)
        layout = manifest.layout
        try:
            await asyncio.to_thread(
                self._index.publish_manifest,
                name,
                self.me,
                digest=digest,
                objects=len(manifest),
                chunks=len(layout),
                listed_at=time.time(),
            )
            generation = await asyncio.to_thread(self._index.generation, name)
            if generation > 0:
                current = {
                    key: version
                    for key, version, _ in manifest.chunk_items(range(len(layout)))
                }
                await asyncio.to_thread(
                    self._index.invalidate_changed, name, generation, current
                )
        except BackendError:
            self._index_dirty = True

    async def get(
        self,
        dataset: str,
        generation: int,
        items: list[Item],
        *,
        forwarded: bool = False,
        digest: str | None = None,
    ) -> list[Result]:
        """Return a chunk reference (or an error record) for every item, in order.

        Hits cost nothing but a dict lookup. Misses are claimed in Redis: this
        store builds the chunks it owns and asks the owner store for the
        rest, so each object is read from the source once per cluster.
        ``digest`` names the listing the caller's chunk versions come from.
        """
        self._ensure_started()
        ds = self._datasets.get(dataset)
        if ds is None:
            return [("unregistered",)] * len(items)
        if digest is not None and digest != ds.digest:
            try:
                manifest = await self._manifest_by_digest(
                    dataset,
                    digest,
                    {"urls": ds.urls, "storage_options": ds.storage_options},
                )
            except StaleVersionError as exc:
                return [("error", "StaleVersionError", str(exc))] * len(items)
            ds = replace(ds, manifest=manifest, digest=digest)
        known = self._generation[dataset]
        if generation < known:
            retired = self._retired.spec(dataset, generation)
            if retired is not None:
                return await self._serve_retired(retired, generation, items)
            msg = (
                f"dataset {dataset!r} generation {generation} was invalidated; "
                f"the current generation is {known}. Re-read the generation and retry."
            )
            return [("error", "StaleVersionError", msg)] * len(items)
        if generation > known:
            self._advance(dataset, generation)
        if not forwarded:  # one call is one batch of a local rank
            self._policy.observe([(dataset, url) for url, _, _ in items])
        results: list[Result | None] = [None] * len(items)
        waiting: dict[int, asyncio.Future[Result]] = {}
        to_load: list[Item] = []
        for i, (url, etag, size) in enumerate(items):
            cached = self._table.get((dataset, url))
            if (
                cached is not None
                and cached.etag == etag
                and cached.generation == generation
            ):
                self._policy.touch((dataset, url))
                results[i] = ("hit", cached.ref)
                if not forwarded:
                    self._stats.add((dataset, generation), "hits")
                    self._stats.add(
                        (dataset, generation), "bytes_served", cached.nbytes
                    )
                continue
            key = (dataset, generation, url, etag)
            fut = self._inflight.get(key)
            if fut is None:
                fut = asyncio.get_running_loop().create_future()
                self._inflight[key] = fut
                to_load.append((url, etag, size))
            waiting[i] = fut
        if to_load:
            asyncio.get_running_loop().create_task(
                self._resolve(ds, generation, to_load, forwarded=forwarded)
            )
        for i, fut in waiting.items():
            res = await asyncio.shield(fut)
            results[i] = res
            if not forwarded and res[0] != "error":
                self._stats.add(
                    (dataset, generation),
                    "hits" if res[0] == "remote-hit" else "misses",
                )
        return [r for r in results if r is not None]

    async def drop(self, dataset: str, urls: list[str] | None = None) -> int:
        """Forget cached values of a dataset (all, or only ``urls``)."""
        victims = [
            k for k in self._table if k[0] == dataset and (urls is None or k[1] in urls)
        ]
        for k in victims:
            self._evict_local(k)
        if urls is None:
            self._retired.drop(dataset)
            if self._disk is not None:
                await asyncio.to_thread(self._disk.drop, dataset)
        elif self._disk is not None:
            for url in urls:
                await asyncio.to_thread(self._disk.remove, dataset, url)
        return len(victims)

    # -- content checks (checksum.py) --------------------------------------------
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
        bad: list[str] = []
        checked = 0
        for (ds, chunk), cached in list(self._table.items()):
            if ds != dataset:
                continue
            checked += 1
            if not await self._is_intact(cached.ref):
                bad.append(chunk)
        if self._disk is not None:
            for chunk in self._disk.chunks(dataset):
                if (dataset, chunk) in self._table:
                    continue  # its file is a copy of what was checked above
                checked += 1
                if not await asyncio.to_thread(self._disk.is_intact, dataset, chunk):
                    bad.append(f"{chunk} (disk)")
                    if repair:  # nothing in memory to rebuild: the next read does
                        self._disk.remove(dataset, chunk)
        repaired: list[str] = []
        still_bad: list[str] = []
        if repair:
            for chunk in [c for c in bad if not c.endswith("(disk)")]:
                if await self._rebuild(dataset, chunk):
                    repaired.append(chunk)
                else:
                    still_bad.append(chunk)
        if bad:
            self._event("corrupt_chunks", dataset, chunks=bad, repaired=repaired)
        return {
            "node": self.node_id,
            "checked": checked,
            "bad": bad,
            "repaired": repaired,
            "still_bad": still_bad,
        }

    async def drop_corrupt(
        self, dataset: str, generation: int, chunk: str, *, forwarded: bool = False
    ) -> bool:
        """A rank found ``chunk`` failing its checksum: forget it here (or at
        its owner) so that the next request builds it again. True if dropped.

        The rank and the store map the same object-store pages, so the rank's
        finding is the store's too; a disk file is kept only if it verifies.
        """
        self._ensure_started()
        if (dataset, chunk) in self._table:
            self._forget_corrupt(dataset, chunk)
            self._event("corrupt_chunks", dataset, chunks=[chunk], repaired=[])
            return True
        if forwarded or self._index is None:
            return False
        try:
            (owner,) = await asyncio.to_thread(
                self._index.claim_owners, dataset, generation, [chunk], self.me
            )
        except BackendError:
            return False
        if owner == self.me:
            return False
        handle = self._peer(owner.split("/", 1)[0])
        if handle is None:
            return False
        return bool(
            await handle.drop_corrupt.remote(dataset, generation, chunk, forwarded=True)
        )

    async def _is_intact(self, ref: Any) -> bool:
        columns = self._get(ref)
        if inspect.isawaitable(columns):
            columns = await columns
        return await asyncio.to_thread(is_intact, columns)

    def _forget_corrupt(self, dataset: str, chunk: str) -> None:
        self._evict_local((dataset, chunk))
        if self._disk is not None and not self._disk.is_intact(dataset, chunk):
            self._disk.remove(dataset, chunk)

    async def _rebuild(self, dataset: str, chunk: str) -> bool:
        """Drop a corrupt chunk and build it again under the current listing;
        True if what is held now verifies."""
        self._forget_corrupt(dataset, chunk)
        ds = self._datasets.get(dataset)
        index = _chunk_index(chunk)
        if ds is None or not 0 <= index < len(ds.manifest.layout):
            return True  # dropped; nothing here can build it, the next read will
        generation = self._generation[dataset]
        (item,) = ds.manifest.chunk_items([index])
        await self._load(ds, generation, item)
        cached = self._table.get((dataset, chunk))
        return cached is None or await self._is_intact(cached.ref)

    async def info(self) -> dict[str, Any]:
        """What this store holds: bytes, entries, per-dataset counts."""
        per_ds: dict[str, int] = defaultdict(int)
        for (ds, _), c in self._table.items():
            per_ds[ds] += c.nbytes
        return {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "used_bytes": self._policy.used_bytes,
            "budget_bytes": self._policy.budget_bytes,
            "entries": len(self._table),
            "eviction": self.settings.eviction,
            "bytes_by_dataset": dict(per_ds),
            "generations": dict(self._generation),
            "dropped_stat_flushes": self._stats.dropped_flushes,
            "inflight": len(self._inflight),
            **self._retired.summary(),
            **(self._disk.summary() if self._disk is not None else {}),
        }

    async def snapshot(self, dataset: str) -> dict[str, dict[str, Any]]:
        """What this store holds for ``dataset``: url -> etag, generation, bytes."""
        return {
            url: {"etag": c.etag, "generation": c.generation, "nbytes": c.nbytes}
            for (ds, url), c in self._table.items()
            if ds == dataset
        }

    async def _serve_retired(
        self, ds: _Dataset, generation: int, items: list[Item]
    ) -> list[Result]:
        """Serve a generation invalidated mid-epoch to the ranks still reading it.

        Kept chunks are hits; anything else is built once more with that
        generation's preprocess and not cached ("uncached"): the cache
        belongs to the new generation.
        """
        key = (ds.name, generation)

        async def serve(chunk: str, version: str, size: int) -> Result:
            ref = self._retired.lookup(ds.name, generation, chunk, version)
            if ref is not None:
                self._stats.add(key, "hits")
                return ("hit", ref)
            ref, report = await self._build_chunk(ds, chunk, version, None)
            self._count_build(key, report)
            self._stats.add(key, "misses")
            room = (
                self._policy.budget_bytes
                - self._policy.used_bytes
                - self._retired.nbytes
            )
            if not report["errors"] and report["nbytes"] <= room:
                # Kept with the retired generation (first to go when a new
                # entry needs room): the next rank asking reads no source.
                self._retired.keep(
                    ds.name, generation, chunk, ref, version, report["nbytes"]
                )
            return ("uncached", ref)

        return list(await asyncio.gather(*(serve(*it) for it in items)))

    # -- miss path -------------------------------------------------------------
    async def _resolve(
        self, ds: _Dataset, generation: int, items: list[Item], *, forwarded: bool
    ) -> None:
        by_url = {it[0]: it for it in items}
        try:
            mine, remote = await self._split_by_owner(
                ds.name, generation, list(by_url), forwarded
            )
            jobs = [self._load(ds, generation, by_url[u]) for u in mine]
            jobs += [
                self._forward(ds, generation, owner, [by_url[u] for u in urls])
                for owner, urls in remote.items()
            ]
            outcomes = await asyncio.gather(*jobs, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        except Exception as exc:  # never leave a waiter hanging; report to each
            log.exception("resolving %d items of %s failed", len(items), ds.name)
            for url, etag, _ in items:
                self._settle(
                    (ds.name, generation, url, etag),
                    ("error", type(exc).__name__, f"{url!r}: {exc}"),
                )

    async def _split_by_owner(
        self, dataset: str, generation: int, urls: list[str], forwarded: bool
    ) -> tuple[list[str], dict[str, list[str]]]:
        if forwarded:
            return urls, {}  # the caller already decided we own these; never ping-pong
        assert self._index is not None
        try:
            owners = await asyncio.to_thread(
                self._index.claim_owners, dataset, generation, urls, self.me
            )
        except BackendError:
            # Redis down: keep training. Fetch locally without a claim; at worst
            # another node reads the same object once more.
            self._index_dirty = True
            return urls, {}
        mine, remote = [], defaultdict(list)
        inherited: dict[str, list[str]] = defaultdict(list)
        for url, owner in zip(urls, owners, strict=False):
            node = owner.split("/", 1)[0]
            if owner == self.me:
                mine.append(url)
            elif node == self.node_id:  # an earlier incarnation of this store
                inherited[owner].append(url)
            else:
                remote[owner].append(url)
        for owner, paths in inherited.items():
            await asyncio.to_thread(
                self._index.take_over, dataset, generation, paths, owner, self.me
            )
            mine += paths
        return mine, remote

    async def _forward(
        self, ds: _Dataset, generation: int, owner: str, items: list[Item]
    ) -> None:
        node = owner.split("/", 1)[0]
        handle = self._peer(node)
        results: list[Result] | None = None
        if handle is not None:
            try:
                results = await asyncio.wait_for(
                    handle.get.remote(
                        ds.name, generation, items, forwarded=True, digest=ds.digest
                    ),
                    self.settings.fetch_timeout_s * (self.settings.fetch_retries + 1),
                )
                if results and results[0][0] == "unregistered":
                    spec = {
                        "name": ds.name,
                        "protocol": ds.protocol,
                        "fingerprint": ds.fingerprint,
                        "storage_options": ds.storage_options,
                        "generation": generation,
                        "manifest": ds.digest,
                        "urls": ds.urls,
                    }
                    await handle.register.remote(spec, ds.preprocess, ds.target)
                    results = await handle.get.remote(
                        ds.name, generation, items, forwarded=True, digest=ds.digest
                    )
            except Exception as exc:  # the owner died, hangs, or its node is gone
                is_ray = type(exc).__module__.split(".")[0] == "ray"
                if not is_ray and not isinstance(exc, TimeoutError):
                    raise
                log.warning(
                    "owner store on %s unreachable (%s); taking over %d items",
                    node,
                    type(exc).__name__,
                    len(items),
                )
                results = None
        if results is None:
            assert self._index is not None
            await asyncio.to_thread(
                self._index.take_over,
                ds.name,
                generation,
                [url for url, _, _ in items],
                owner,
                self.me,
            )
            await asyncio.gather(*(self._load(ds, generation, it) for it in items))
            return
        for (url, etag, _), res in zip(items, results, strict=False):
            if res[0] in ("hit", "fetched"):
                res = ("remote-hit" if res[0] == "hit" else "fetched", res[1])
            self._settle((ds.name, generation, url, etag), res)

    async def _load(self, ds: _Dataset, generation: int, item: Item) -> None:
        chunk, version, _ = item
        key = (ds.name, generation, chunk, version)
        if self._disk is not None and await self._load_from_disk(ds, generation, item):
            return
        base = self._table.get((ds.name, chunk))
        try:
            ref, report = await self._build_chunk(ds, chunk, version, base)
        except ShardCacheError as exc:  # the whole chunk failed (e.g. mixed dtypes)
            self._stats.add((ds.name, generation), "errors")
            await self._forget_claim(ds.name, generation, [chunk])
            self._event(
                "fetch_error",
                ds.name,
                key=chunk,
                error=type(exc).__name__,
                message=str(exc),
            )
            self._settle(key, ("error", type(exc).__name__, str(exc)))
            return
        self._count_build((ds.name, generation), report)
        if report["errors"]:
            # Served with the failed rows marked, never cached: the next
            # epoch retries them, and the rest of the chunk is not lost now.
            row, (kind, message) = next(iter(report["errors"].items()))
            await self._forget_claim(ds.name, generation, [chunk])
            self._event("fetch_error", ds.name, key=chunk, error=kind, message=message)
            self._settle(key, ("uncached", ref))
            return
        lo, hi = ds.manifest.layout.bounds(_chunk_index(chunk))
        admitted = self._generation[ds.name] == generation and self._admit(
            ds.name,
            generation,
            chunk,
            _Cached(
                ref,
                version,
                generation,
                report["nbytes"],
                ds.manifest.row_hashes(lo, hi).copy(),
            ),
            ds.manifest.chunk_source_bytes(_chunk_index(chunk)),
        )
        # "uncached" tells the reader not to hold on to the value: the budget is
        # full (static policy, or a chunk larger than the whole budget).
        self._settle(key, ("fetched" if admitted else "uncached", ref))

    async def _build_chunk(
        self, ds: _Dataset, chunk: str, version: str, base: _Cached | None
    ) -> tuple[Any, dict[str, Any]]:
        """Build one chunk, re-reading only the members that changed since
        ``base``; a packed unit whose bytes the listing kept is not read."""
        assert self._build is not None
        index = _chunk_index(chunk)
        layout = ds.manifest.layout
        if not 0 <= index < len(layout):
            raise ConfigError(
                f"chunk {chunk!r} is not in dataset {ds.name!r} ({len(layout)} chunks); "
                "the rank and the store read different listings. Call refresh()."
            )
        lo, hi = layout.bounds(index)
        # Rebuild from ``base`` when it has this chunk's rows and some are unchanged.
        changed: list[int] = []
        base_ref = None
        if base is not None and len(base.hashes) == hi - lo:
            changed = ds.manifest.changed_rows(lo, hi, base.hashes).tolist()
            if len(changed) < hi - lo:
                base_ref = base.ref
        held = self._listings.held(ds.name, ds.digest)
        req = BuildRequest(
            ds.name,
            ds.protocol,
            ds.storage_options,
            held[0] if held is not None else ds.manifest.to_object(),
            lo,
            hi,
            ds.preprocess,
            ds.target,
            base_ref,
            changed,
            ds.source,
            await self._take_span(ds, version),
        )
        return await self._build(req)

    async def _take_span(self, ds: _Dataset, version: str) -> Any:
        """The unit's bytes the listing kept (a reference), or None: here if
        this store listed, else from the store that did (one call)."""
        manifest = ds.manifest
        if not isinstance(manifest, PackedManifest):
            return None
        fmt = FORMATS.get(manifest.format)
        if fmt is None or not fmt.keeps_spans:
            return None
        node = self._listed_on.get(ds.name, self.node_id)
        if node == self.node_id:
            return self._listings.spans.take(ds.name, version)
        handle = self._peer(node)
        if handle is None:
            return None
        try:
            found = await handle.take_span.remote(ds.name, version)
        except Exception as exc:  # the listing store is gone: read the source
            if type(exc).__module__.split(".")[0] != "ray":
                raise
            return None
        return found[0] if found else None

    def _count_build(self, key: tuple[str, int], report: dict[str, Any]) -> None:
        self._stats.add(key, "remote_reads", report["reads"])
        self._stats.add(key, "bytes_read", report["bytes_read"])
        self._stats.add(key, "fetch_ms_total", report["build_ms"])
        self._stats.add(key, "errors", len(report["errors"]))

    def _admit(
        self,
        dataset: str,
        generation: int,
        chunk: str,
        value: _Cached,
        size: int,
        *,
        on_disk: bool = False,
    ) -> bool:
        overflow = (
            self._policy.used_bytes
            + self._retired.nbytes
            + value.nbytes
            - self._policy.budget_bytes
        )
        if overflow > 0:
            self._retired.free(overflow)
        admitted, evicted = self._policy.admit((dataset, chunk), value.nbytes)
        for victim in evicted:
            self._evict_local(victim)
        self._stats.add((dataset, generation), "evictions", len(evicted))
        if not admitted:
            self._stats.add((dataset, generation), "uncached")
            return False
        self._table[(dataset, chunk)] = value
        if self._disk is not None and not on_disk:
            self._spill_soon(dataset, generation, chunk, value)
        entry = {
            "etag": value.etag,
            "size": size,
            "samples": len(value.hashes),
            "owner": self.node_id,
            "generation": generation,
            "cached_at": time.time(),
            "nbytes": value.nbytes,
        }
        evicted_keys: dict[str, list[str]] = defaultdict(list)
        for ds, k in evicted:
            # A chunk whose file is on this node's disk is still served from
            # here: its entry and claim stay.
            if self._disk is None or not self._on_disk(ds, k):
                evicted_keys[ds].append(k)
        self._index_write(
            lambda idx: (
                idx.record_entries(dataset, generation, {chunk: entry}),
                [
                    idx.release(ds, self._generation[ds], ks, self.me)
                    for ds, ks in evicted_keys.items()
                ],
            )
        )
        return True

    # -- disk tier -------------------------------------------------------------
    async def _scan_disk(self) -> None:
        assert self._disk is not None
        found = await asyncio.to_thread(self._disk.scan)
        if found:
            self._event("disk_adopted", "", files=found)

    async def _load_from_disk(self, ds: _Dataset, generation: int, item: Item) -> bool:
        """Serve a chunk from this node's disk tier if its file matches the
        version, generation and preprocess asked for; False if it does not."""
        assert self._disk is not None
        chunk, version, size = item
        writing = self._disk_writes.get((ds.name, chunk))
        if writing is not None:  # evicted before its file was written: wait
            await asyncio.wait([writing])
        expect = {
            "version": version,
            "generation": generation,
            "fingerprint": ds.fingerprint,
        }
        columns = await asyncio.to_thread(self._disk.read, ds.name, chunk, expect)
        if columns is None:
            return False
        if not await asyncio.to_thread(is_intact, columns):
            # Never served: the file's bytes changed since it was written (or
            # it predates checksums). Build the chunk from the source instead.
            log.warning(
                "chunk file %s/%s fails its checksum; rebuilding", ds.name, chunk
            )
            self._stats.add((ds.name, generation), "corrupt_chunks")
            self._disk.remove(ds.name, chunk)
            return False
        # Into the object store (one copy of the mapped pages), so the rank's
        # read path is the same as for a chunk built from the source.
        ref = await asyncio.to_thread(self._put, columns)
        self._stats.add((ds.name, generation), "disk_hits")
        lo, hi = ds.manifest.layout.bounds(_chunk_index(chunk))
        value = _Cached(
            ref,
            version,
            generation,
            int(sum(v.nbytes for v in columns.values())),
            ds.manifest.hashes[lo:hi].copy(),
        )
        admitted = self._generation[ds.name] == generation and self._admit(
            ds.name, generation, chunk, value, size, on_disk=True
        )
        self._settle(
            (ds.name, generation, chunk, version),
            ("hit" if admitted else "uncached", ref),
        )
        return True

    def _spill_soon(
        self, dataset: str, generation: int, chunk: str, value: _Cached
    ) -> None:
        """Write a newly cached chunk to the disk tier in the background."""
        if self._loop is None:
            return
        key = (dataset, chunk)
        task = self._loop.create_task(self._spill(dataset, generation, chunk, value))
        self._disk_writes[key] = task
        task.add_done_callback(
            lambda t: (
                self._disk_writes.pop(key, None)
                if self._disk_writes.get(key) is t
                else None
            )
        )

    def _on_disk(self, dataset: str, chunk: str) -> bool:
        """The chunk has a file, or one being written."""
        assert self._disk is not None
        return (dataset, chunk) in self._disk_writes or self._disk.has(dataset, chunk)

    async def _spill(
        self, dataset: str, generation: int, chunk: str, value: _Cached
    ) -> None:
        assert self._disk is not None and self._disk_slots is not None
        ds = self._datasets.get(dataset)
        if ds is None:
            return
        async with self._disk_slots:
            columns = self._get(value.ref)
            if inspect.isawaitable(columns):
                columns = await columns
            meta = {
                "version": value.etag,
                "generation": generation,
                "fingerprint": ds.fingerprint,
            }
            try:
                dropped = await asyncio.to_thread(
                    self._disk.write, dataset, chunk, columns, meta
                )
            except (ChunkFileError, OSError) as exc:  # served from memory only
                self._stats.add((dataset, generation), "disk_errors")
                log.warning("chunk %s/%s not written to disk: %s", dataset, chunk, exc)
                return
        self._stats.add((dataset, generation), "disk_writes")
        gone: dict[str, list[str]] = defaultdict(list)
        for ds_name, k in dropped:  # deleted for the disk budget, not in memory
            if (ds_name, k) not in self._table:
                gone[ds_name].append(k)
        for ds_name, ks in gone.items():
            self._index_write(
                lambda idx, d=ds_name, ks=ks: idx.release(
                    d, self._generation[d], ks, self.me
                )
            )

    async def flush_disk(self) -> dict[str, int]:
        """Wait for the disk writes in flight (tests, graceful shutdown)."""
        while self._disk_writes:
            await asyncio.gather(
                *list(self._disk_writes.values()), return_exceptions=True
            )
        return self._disk.summary() if self._disk is not None else {}

    def _settle(self, key: tuple[str, int, str, str], result: Result) -> None:
        fut = self._inflight.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(result)

    async def _forget_claim(
        self, dataset: str, generation: int, urls: list[str]
    ) -> None:
        if self._index is None:
            return
        with contextlib.suppress(BackendError):
            await asyncio.to_thread(
                self._index.release, dataset, generation, urls, self.me
            )

    # -- invalidation ----------------------------------------------------------
    def _advance(self, dataset: str, generation: int) -> None:
        """Move to ``generation``; older values are retired (kept a while) or freed."""
        previous = self._generation[dataset]
        if generation <= previous:
            return
        self._generation[dataset] = generation
        if dataset in self._datasets:
            self._retired.retire(dataset, previous, self._datasets[dataset])
        for k in [
            k
            for k, c in self._table.items()
            if k[0] == dataset and c.generation < generation
        ]:
            c = self._table[k]
            self._retired.keep(dataset, c.generation, k[1], c.ref, c.etag, c.nbytes)
            self._evict_local(k)

    def _evict_local(self, key: tuple[str, str]) -> None:
        self._policy.remove(key)
        self._table.pop(key, None)

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
        if generation > self._generation[dataset]:
            self._listings.spans.drop(dataset)  # invalidated: read the source again
        self._advance(dataset, generation)

    def _listen_forever(self) -> None:
        """Pub/sub listener thread; reconnects and resyncs after Redis outages."""
        channel = keys.invalidation_channel(self.settings.namespace)
        while not self._stop.is_set():
            try:
                index = RedisIndex.from_url(
                    self.settings.redis_url, self.settings.namespace
                )
                pubsub = index.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(channel)
                # Anything invalidated while we were away: catch up from the records.
                for name in list(self._datasets):
                    gen = index.generation(name)
                    self._call_soon(self._advance, name, gen)
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
                self._index_dirty = True
                time.sleep(RESYNC_BACKOFF_S)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # -- stats and index writes -------------------------------------------------
    def _index_write(self, write: Callable[[RedisIndex], Any]) -> None:
        if self._index is None:
            return
        index = self._index

        def run() -> None:
            try:
                write(index)
            except BackendError:
                self._index_dirty = True

        self._pool.submit(run)

    def _event(self, kind: str, dataset: str, **detail: Any) -> None:
        self._index_write(
            lambda idx: idx.push_event(kind, dataset, node=self.node_id, **detail)
        )

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stats_flush_s)
            await self._flush_once()

    async def _flush_once(self) -> None:
        self._retired.expire()
        if self._index is None:
            return
        counts = self._stats.take()
        info = await self.info()
        info["ts"] = time.time()
        try:
            if counts:
                await asyncio.to_thread(self._index.flush_stats, counts, self.node_id)
            await asyncio.to_thread(self._index.heartbeat, self.node_id, info)
            self._stats.flushed()
            if self._index_dirty:
                await self._resync_index()
        except BackendError:
            self._stats.restore(counts)
            self._index_dirty = True

    async def _release_predecessors(self) -> None:
        """Drop the index entries of this node's dead earlier store, so no
        reader is pointed at values that died with it. Best effort: with Redis
        down, lookups still find the dead owner and take it over by
        compare-and-set (``_split_by_owner``)."""
        assert self._index is not None
        try:
            dropped = await asyncio.to_thread(
                self._index.release_predecessors, self.node_id, self.me
            )
        except BackendError:
            return
        if dropped:
            self._event("predecessor_released", "", entries=dropped)

    async def _resync_index(self) -> None:
        """After a Redis outage, re-record what this store holds."""
        assert self._index is not None
        by_ds: dict[tuple[str, int], dict[str, dict[str, Any]]] = defaultdict(dict)
        for (ds, url), c in self._table.items():
            by_ds[(ds, c.generation)][url] = {
                "etag": c.etag,
                "nbytes": c.nbytes,
                "samples": len(c.hashes),
                "owner": self.node_id,
                "generation": c.generation,
            }
        waiting = False
        for (ds, gen), entries in by_ds.items():
            current = await asyncio.to_thread(self._index.generation, ds)
            if current == 0:
                # Redis came back empty and no rank has registered the dataset
                # again yet: try again at the next flush, not never.
                waiting = True
                continue
            if current != gen:
                continue
            await asyncio.to_thread(self._index.record_entries, ds, gen, entries)
            await asyncio.to_thread(
                self._index.take_over, ds, gen, list(entries), "", self.me
            )
        self._index_dirty = waiting


def _ray_put(value: Any) -> Any:
    import ray

    return ray.put(value)


def _awaitable_ref(ref: Any) -> Any:
    return ref  # an ObjectRef is awaitable inside the async actor


def _chunk_index(chunk: str) -> int:
    try:
        return int(chunk[1:]) if chunk.startswith("c") else -1
    except ValueError:
        return -1


def _build_workers(settings: ServiceSettings, node_id: str) -> int:
    """Chunk builds in flight: the setting, else the node's CPUs."""
    if settings.build_workers:
        return settings.build_workers
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return max(1, int(node.get("Resources", {}).get("CPU", 1)))
    return 1


def _ray_peer(ns: str, node_id: str) -> Any:
    import ray

    # A store pinned (soft=False) to a node that left the cluster can never be
    # rescheduled: calling it would hang, so a dead node means "no peer".
    if not any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
        return None
    try:
        return ray.get_actor(store_name(node_id), namespace=ray_namespace(ns))
    except ValueError:
        return None


def start_shard(settings: ServiceSettings, node_id: str) -> Any:
    """Start (or find) the detached store actor pinned to ``node_id``.

    Raises:
        ConfigError: the settings are invalid.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not node_id:
        raise ConfigError("node_id must be a Ray node id hex string.")
    actor_cls = ray.remote(CacheShard)
    return actor_cls.options(
        name=store_name(node_id),
        namespace=ray_namespace(settings.namespace),
        lifetime="detached",
        get_if_exists=True,
        max_restarts=settings.max_restarts,
        max_concurrency=1000,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(settings.model_dump(), node_id)

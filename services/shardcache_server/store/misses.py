"""The miss path: every chunk not held here is built once per cluster.

Ownership rule: the resolver owns the misses in flight, one future per
``(dataset, generation, chunk, version)``, and settles each exactly once.
A miss is claimed in Redis; this store loads the chunks it owns (from its
disk, else built from the source) and admits them to the table; the owner
store serves the rest, and an owner that is gone is taken over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from shardcache.errors import BackendError, ConfigError, ShardCacheError
from shardcache.keys import chunk_key, is_variant_key, parse_chunk_key
from shardcache.transport.base import Status
from shardcache_server.builder import BuildRequest
from shardcache_server.settings import ServiceSettings
from shardcache_server.store.datasets import Builder, Dataset, Item, Result
from shardcache_server.store.manifests import Manifests
from shardcache_server.store.records import IndexRecords
from shardcache_server.store.spill import Spill
from shardcache_server.store.stats import StatsBuffer
from shardcache_server.store.table import Cached, HeldTable, failed_rows

__all__ = ["MissResolver"]

log = logging.getLogger(__name__)

# Chunks searched for a chunk's rows held already: its earlier build, then
# its neighbours (an object added or removed before a chunk moves its rows
# into the next or previous chunk).
NEAR = (0, -1, 1, -2, 2)

# Member failures the same version of an object gives every time it is read
# (its bytes do not decode, it is gone): a chunk whose only failures are these
# is cached with them marked. A failure that may not come back (a connection,
# a timeout, a GET throttled past its retries, a body cut short) or that says
# the object changed since the listing (the next listing reads it anew) leaves
# the chunk uncached, to be read again next epoch.
SETTLED_FAILURES = frozenset({"PreprocessError", "SourceFormatError", "SourceNotFound"})

Key = tuple[str, int, str, str]  # (dataset, generation, chunk, version)


class MissResolver:
    """Claims, forwards, takes over and builds the chunks a store misses.

    Args:
        settings: the service settings (fetch timeout and retries).
        table: where loaded chunks are admitted.
        spill: this node's chunk files, or ``None`` without a disk tier.
        manifests: the listings builds read (and the bytes they kept).
        records: the index link: claims, take-overs, entries, events.
        stats: counters per ``(dataset, generation)``.
        peer: returns the store handle of another node, or ``None`` if gone.
        build: builds one chunk and returns ``(reference, report)``.
    """

    def __init__(
        self,
        settings: ServiceSettings,
        *,
        table: HeldTable,
        spill: Spill | None,
        manifests: Manifests,
        records: IndexRecords,
        stats: StatsBuffer,
        peer: Callable[[str], Any],
        build: Builder,
    ):
        self.settings = settings
        self.node_id = records.node_id
        self.me = records.me
        self._table = table
        self._spill = spill
        self._manifests = manifests
        self._records = records
        self._stats = stats
        self._peer = peer
        self._build = build
        self._inflight: dict[Key, asyncio.Future[Result]] = {}
        self._readers: dict[Key, str] = {}  # the reading each miss is built for

    def __len__(self) -> int:
        """Misses in flight."""
        return len(self._inflight)

    async def get(
        self,
        ds: Dataset,
        generation: int,
        items: list[Item],
        *,
        forwarded: bool,
        reader: str = "",
    ) -> list[Result]:
        """The result of every missed item, in order: a miss already in
        flight is joined, the others are resolved together in one task.

        ``reader`` (``job:epoch`` or ""): the reading this request is for. A
        build is recorded for the reading that started it; another reading
        that joins it is answered ``HIT`` (``REMOTE_HIT`` where another
        node's store built it), since its job made no read (two jobs asking
        at once both counted the one GET before)."""
        loop = asyncio.get_running_loop()
        # Each item's future, and its key if it joined another reading's build.
        waiting: list[tuple[asyncio.Future[Result], Key | None]] = []
        to_load: list[Item] = []
        for url, etag, size in items:
            key = (ds.name, generation, url, etag)
            fut = self._inflight.get(key)
            joined_other = False
            if fut is None:
                fut = loop.create_future()
                self._inflight[key] = fut
                self._readers[key] = reader
                to_load.append((url, etag, size))
            else:
                builder = self._readers.get(key, "")
                joined_other = bool(reader and builder) and builder != reader
            waiting.append((fut, key if joined_other else None))
        if to_load:
            loop.create_task(
                self.resolve(
                    ds, generation, to_load, forwarded=forwarded, reader=reader
                )
            )
        out = []
        for fut, joined in waiting:
            res = await asyncio.shield(fut)
            if joined is not None and res[0] == Status.FETCHED:
                # Held here, or by the owner store the build was asked of.
                _, _, url, etag = joined
                held = self._table.hit(ds.name, url, etag, generation) is not None
                res = (Status.HIT if held else Status.REMOTE_HIT, res[1])
            out.append(res)
        return out

    async def resolve(
        self,
        ds: Dataset,
        generation: int,
        items: list[Item],
        *,
        forwarded: bool,
        reader: str = "",
    ) -> None:
        """Settle every item; any failure settles them all with the error.

        1. claim: which chunks this store owns (taking over its own earlier
           incarnation's), and which owner store holds each of the others;
        2. each owned chunk: ``load`` (disk, else build; admit; settle);
        3. the others: ask their owner, or take over an owner that is gone.
        """
        by_url = {it[0]: it for it in items}
        try:
            mine, remote = await self._claim(
                ds.name, generation, list(by_url), forwarded
            )
            jobs = [self.load(ds, generation, by_url[u], reader) for u in mine]
            jobs += [
                self._forward(ds, generation, owner, [by_url[u] for u in urls], reader)
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
                    (Status.ERROR, type(exc).__name__, f"{url!r}: {exc}"),
                )

    async def load(
        self, ds: Dataset, generation: int, item: Item, reader: str = ""
    ) -> None:
        """Settle one chunk this store owns (built for ``reader``, if built).

        1. this node's disk, if its file matches (``spill.load``);
        2. else build it from the source (only the members that changed
           since the chunk held now, if any);
        3. admit it to the table: ``(admitted, evicted)``, recorded in the index;
        4. settle: HIT/FETCHED if held, UNCACHED if not.
        """
        chunk, version, size = item
        key = (ds.name, generation, chunk, version)
        if self._spill is not None:
            value = await self._spill.load(ds, generation, item)
            if value is not None:
                admitted = self._table.generation[
                    ds.name
                ] == generation and self._admit(
                    ds.name, generation, chunk, value, size, on_disk=True
                )
                # Not held (larger than the budget): still no source read.
                self._settle(
                    key, (Status.HIT if admitted else Status.DISK_READ, value.ref)
                )
                return
        try:
            ref, report = await self._build_chunk(ds, generation, chunk, version)
        except ShardCacheError as exc:  # the whole chunk failed (e.g. mixed dtypes)
            self._stats.add((ds.name, generation), "errors")
            await self._records.release(ds.name, generation, [chunk])
            self._records.event(
                "fetch_error",
                ds.name,
                key=chunk,
                error=type(exc).__name__,
                message=str(exc),
            )
            self._settle(key, (Status.ERROR, type(exc).__name__, str(exc)))
            return
        self._count_build((ds.name, generation), report)
        if report["errors"]:
            row, (kind, message) = next(iter(report["errors"].items()))
            self._records.event(
                "fetch_error", ds.name, key=chunk, error=kind, message=message
            )
            if not {k for k, _ in report["errors"].values()} <= SETTLED_FAILURES:
                # Served with the failed rows marked, not cached: a read that
                # may work next time is retried next epoch.
                await self._records.release(ds.name, generation, [chunk])
                self._settle(key, (Status.UNCACHED, ref))
                return
            # Every failure is one this object version gives again: the chunk
            # is cached with those rows marked, so a bad file costs one read,
            # not its whole chunk's every epoch.
        index = parse_chunk_key(chunk)
        lo, hi = ds.manifest.layout.bounds(index)
        admitted = self._table.generation[ds.name] == generation and self._admit(
            ds.name,
            generation,
            chunk,
            Cached(
                ref,
                version,
                generation,
                report["nbytes"],
                ds.manifest.row_hashes(lo, hi).copy(),
                failed_rows(report["errors"]),
                reader,
                report["sourced_rows"],
            ),
            ds.manifest.chunk_source_bytes(index),
        )
        # UNCACHED tells the reader not to hold on to the value: the budget is
        # full (static policy, or a chunk larger than the whole budget).
        self._settle(key, (Status.FETCHED if admitted else Status.UNCACHED, ref))

    async def serve_retired(
        self, ds: Dataset, generation: int, items: list[Item]
    ) -> list[Result]:
        """Serve a generation invalidated mid-epoch to the ranks still reading it.

        Kept chunks are hits; anything else is built once more with that
        generation's preprocess and not cached (UNCACHED): the cache
        belongs to the new generation.
        """
        key = (ds.name, generation)
        retired = self._table.retired
        policy = self._table.policy

        async def serve(chunk: str, version: str, size: int) -> Result:
            ref = retired.lookup(ds.name, generation, chunk, version)
            if ref is not None:
                self._stats.add(key, "hits")
                return (Status.HIT, ref)
            ref, report = await self._build_chunk(ds, generation, chunk, version)
            self._count_build(key, report)
            self._stats.add(key, "misses")
            room = policy.budget_bytes - policy.used_bytes - retired.nbytes
            if not report["errors"] and report["nbytes"] <= room:
                # Kept with the retired generation (first to go when a new
                # entry needs room): the next rank asking reads no source.
                retired.keep(ds.name, generation, chunk, ref, version, report["nbytes"])
            return (Status.UNCACHED, ref)

        return list(await asyncio.gather(*(serve(*it) for it in items)))

    async def _claim(
        self, dataset: str, generation: int, urls: list[str], forwarded: bool
    ) -> tuple[list[str], dict[str, list[str]]]:
        """``(mine, {owner: chunks})``: claim each chunk or learn its owner."""
        if forwarded:
            return urls, {}  # the caller already decided we own these; never ping-pong
        index = self._records.index
        assert index is not None
        try:
            owners = await asyncio.to_thread(
                index.claim_owners, dataset, generation, urls, self.me
            )
        except BackendError:
            # Redis down: keep training. Fetch locally without a claim; at worst
            # another node reads the same object once more.
            self._records.dirty = True
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
                index.take_over, dataset, generation, paths, owner, self.me
            )
            mine += paths
        return mine, remote

    async def _forward(
        self,
        ds: Dataset,
        generation: int,
        owner: str,
        items: list[Item],
        reader: str = "",
    ) -> None:
        """Settle ``items`` with the owner's results, or load them here after
        taking over an owner that is unreachable."""
        node = owner.split("/", 1)[0]
        results = await self._ask_owner(ds, generation, node, items, reader)
        if results is None:
            index = self._records.index
            assert index is not None
            await asyncio.to_thread(
                index.take_over,
                ds.name,
                generation,
                [url for url, _, _ in items],
                owner,
                self.me,
            )
            await asyncio.gather(
                *(self.load(ds, generation, it, reader) for it in items)
            )
            return
        for (url, etag, _), res in zip(items, results, strict=False):
            if res[0] in (Status.HIT, Status.DISK_READ):
                res = (Status.REMOTE_HIT, res[1])  # the owner's, not the source's
            self._settle((ds.name, generation, url, etag), res)

    async def _ask_owner(
        self, ds: Dataset, generation: int, node: str, items: list[Item], reader: str
    ) -> list[Result] | None:
        """The owner store's results (registering the dataset there first if
        it lost it), or ``None`` if it is gone, dead or hangs."""
        handle = self._peer(node)
        if handle is None:
            return None
        try:
            results: list[Result] = await asyncio.wait_for(
                handle.get.remote(
                    ds.name,
                    generation,
                    items,
                    forwarded=True,
                    digest=ds.digest,
                    reader=reader,
                ),
                self.settings.fetch_timeout_s * (self.settings.fetch_retries + 1),
            )
            if results and results[0][0] == Status.UNINSTALLED:
                spec = {
                    "name": ds.name,
                    "protocol": ds.protocol,
                    "fingerprint": ds.fingerprint,
                    "storage_options": ds.storage_options,
                    "generation": generation,
                    "manifest": ds.digest,
                    "urls": ds.urls,
                }
                await handle.install.remote(spec, ds.preprocess, ds.target)
                results = await handle.get.remote(
                    ds.name,
                    generation,
                    items,
                    forwarded=True,
                    digest=ds.digest,
                    reader=reader,
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
            return None
        return results

    async def _build_chunk(
        self, ds: Dataset, generation: int, chunk: str, version: str
    ) -> tuple[Any, dict[str, Any]]:
        """Build one chunk of ``generation``, reading only the members no
        chunk held for it has; a packed unit whose bytes the listing kept is
        not read.

        Raises:
            ConfigError: the chunk is not in the dataset's listing.
        """
        index = parse_chunk_key(chunk)
        layout = ds.manifest.layout
        if index >= len(layout):
            raise ConfigError(
                f"chunk {chunk!r} is not in dataset {ds.name!r} ({len(layout)} chunks); "
                "the rank and the store read different listings. Call refresh()."
            )
        lo, hi = layout.bounds(index)
        bases, reuse = self._held_rows(ds, generation, index, lo, hi)
        req = BuildRequest(
            ds.name,
            ds.protocol,
            ds.storage_options,
            self._manifests.build_source(ds),
            lo,
            hi,
            ds.preprocess,
            ds.target,
            bases=bases,
            reuse=reuse,
            source=ds.source,
            span=await self._manifests.kept_for_build(ds, version),
        )
        ref, report = await self._build(req)
        # Rows read from the source: all but those copied from held chunks.
        report["sourced_rows"] = (hi - lo) - (0 if reuse is None else len(reuse))
        return ref, report

    def _held_rows(
        self, ds: Dataset, generation: int, index: int, lo: int, hi: int
    ) -> tuple[list[Any], np.ndarray | None]:
        """The rows of chunk ``[lo, hi)`` that held chunks of ``generation``
        already have (the same URL and ETag): ``(their references, (row,
        base, base row) per row)``. Searched in this chunk's earlier build
        (objects rewritten in place) and its neighbours, since an object
        added or removed before a chunk moves its rows by one or a few
        positions into the next or previous chunk; only what is in none of
        them is read. Only the same generation: a retired generation's build
        (another preprocess) copies nothing from the current one's chunks.
        """
        want = ds.manifest.row_hashes(lo, hi)
        found = np.full((hi - lo, 2), -1, np.int64)  # (base, base row) per row
        bases: list[Any] = []
        near = [
            self._table.get(ds.name, chunk_key(index + d))
            for d in NEAR
            if index + d >= 0
        ]
        for held in near:
            todo = found[:, 0] < 0
            if (
                held is None
                or held.generation != generation
                or not len(held.hashes)
                or not todo.any()
            ):
                continue
            order = np.argsort(held.hashes, kind="stable")
            ranked = held.hashes[order]
            at = np.minimum(np.searchsorted(ranked, want), len(ranked) - 1)
            hit = todo & (ranked[at] == want)
            if hit.any():
                found[hit, 0] = len(bases)
                found[hit, 1] = order[at[hit]]
                bases.append(held.ref)
        rows = np.flatnonzero(found[:, 0] >= 0)
        if not len(rows):
            return [], None
        return bases, np.column_stack([rows, found[rows]])

    def _admit(
        self,
        dataset: str,
        generation: int,
        chunk: str,
        value: Cached,
        size: int,
        *,
        on_disk: bool = False,
    ) -> bool:
        """Admit ``value`` to the table; if held, spill it and record its
        index entry (and release the evicted chunks that have no file).

        A chunk memory cannot hold (larger than the whole budget, or a full
        static budget) still gets its file and its entry when there is a disk
        tier: the next epoch reads it from this node's disk, not the source.
        Returns whether memory holds it.
        """
        admitted, evicted = self._table.admit(dataset, chunk, value)
        self._stats.add((dataset, generation), "evictions", len(evicted))
        if not admitted:
            self._stats.add((dataset, generation), "uncached")
        # A variant is held only in free room (table.py), never on disk alone.
        if not admitted and (self._spill is None or is_variant_key(chunk)):
            return False
        if self._spill is not None and not on_disk:
            self._spill.soon(dataset, generation, chunk, value)
        entry = {
            "etag": value.etag,
            "size": size,
            "samples": len(value.hashes),
            "owner": self.node_id,
            "generation": generation,
            "cached_at": time.time(),
            "nbytes": value.nbytes,
            **value.failure_fields(),
        }
        released: dict[str, list[str]] = defaultdict(list)
        for ds, k in evicted:
            # A chunk whose file is on this node's disk is still served from
            # here: its entry and claim stay. A variant never had either.
            if is_variant_key(k):
                continue
            if self._spill is None or not self._spill.has(ds, k):
                released[ds].append(k)
        gen = self._table.generation
        self._records.write(
            lambda idx: (
                idx.record_entries(dataset, generation, {chunk: entry}),
                [idx.release(ds, gen[ds], ks, self.me) for ds, ks in released.items()],
            )
        )
        return admitted

    def _count_build(self, key: tuple[str, int], report: dict[str, Any]) -> None:
        self._stats.add(key, "remote_reads", report["reads"])
        self._stats.add(key, "bytes_read", report["bytes_read"])
        self._stats.add(key, "fetch_ms_total", report["build_ms"])
        self._stats.add(key, "errors", len(report["errors"]))

    def _settle(self, key: Key, result: Result) -> None:
        fut = self._inflight.pop(key, None)
        self._readers.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(result)

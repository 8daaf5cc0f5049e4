"""Content checks: what this store holds against the checksums written at build.

Ownership rule: checks own nothing; they read the table and the disk tier,
drop what fails its checksum (here, or at the owner store a rank names),
and build it again through the miss path when asked to repair.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from shardcache.checksum import is_intact
from shardcache.errors import BackendError
from shardcache.keys import is_variant_key, parse_chunk_key
from shardcache_server.store.datasets import Dataset
from shardcache_server.store.misses import MissResolver
from shardcache_server.store.records import IndexRecords
from shardcache_server.store.spill import Spill
from shardcache_server.store.table import HeldTable

__all__ = ["ContentChecks"]


class ContentChecks:
    """Verifies and repairs one store's chunks (``shardcache verify``).

    Args:
        table: the chunks held in memory.
        spill: this node's chunk files, or ``None`` without a disk tier.
        misses: rebuilds a dropped chunk.
        records: the index link (owners) and event log.
        datasets: the registered datasets.
        get: maps a reference back to its value (or an awaitable of it).
        peer: returns the store handle of another node, or ``None`` if gone.
    """

    def __init__(
        self,
        *,
        table: HeldTable,
        spill: Spill | None,
        misses: MissResolver,
        records: IndexRecords,
        datasets: Mapping[str, Dataset],
        get: Callable[[Any], Any],
        peer: Callable[[str], Any],
    ):
        self._table = table
        self._spill = spill
        self._misses = misses
        self._records = records
        self._datasets = datasets
        self._get = get
        self._peer = peer

    async def verify(self, dataset: str, repair: bool = False) -> dict[str, Any]:
        """See ``CacheShard.verify_contents``."""
        bad: list[str] = []
        checked = 0
        for (ds, chunk), cached in self._table.items():
            if ds != dataset:
                continue
            checked += 1
            if not await self._is_intact(cached.ref):
                bad.append(chunk)
        if self._spill is not None:
            disk = self._spill.disk
            for chunk in disk.chunks(dataset):
                if (dataset, chunk) in self._table:
                    continue  # its file is a copy of what was checked above
                checked += 1
                if not await asyncio.to_thread(disk.is_intact, dataset, chunk):
                    bad.append(f"{chunk} (disk)")
                    if repair:  # nothing in memory to rebuild: the next read does
                        disk.remove(dataset, chunk)
        repaired: list[str] = []
        still_bad: list[str] = []
        if repair:
            for chunk in [c for c in bad if not c.endswith("(disk)")]:
                if await self._rebuild(dataset, chunk):
                    repaired.append(chunk)
                else:
                    still_bad.append(chunk)
        if bad:
            self._records.event(
                "corrupt_chunks", dataset, chunks=bad, repaired=repaired
            )
        return {
            "node": self._records.node_id,
            "checked": checked,
            "bad": bad,
            "repaired": repaired,
            "still_bad": still_bad,
        }

    async def drop_corrupt(
        self, dataset: str, generation: int, chunk: str, *, forwarded: bool = False
    ) -> bool:
        """See ``CacheShard.drop_corrupt``."""
        if (dataset, chunk) in self._table:
            self._forget_corrupt(dataset, chunk)
            self._records.event("corrupt_chunks", dataset, chunks=[chunk], repaired=[])
            return True
        index = self._records.index
        if forwarded or index is None or is_variant_key(chunk):
            return False  # a variant is built on the rank's node: never elsewhere
        try:
            (owner,) = await asyncio.to_thread(
                index.claim_owners, dataset, generation, [chunk], self._records.me
            )
        except BackendError:
            return False
        if owner == self._records.me:
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
        self._table.evict((dataset, chunk))
        if is_variant_key(chunk):
            return  # never on disk
        disk = self._spill.disk if self._spill is not None else None
        if disk is not None and not disk.is_intact(dataset, chunk):
            disk.remove(dataset, chunk)

    async def _rebuild(self, dataset: str, chunk: str) -> bool:
        """Drop a corrupt chunk and build it again under the current listing;
        True if what is held now verifies."""
        self._forget_corrupt(dataset, chunk)
        if is_variant_key(chunk):
            return True  # dropped; the next read builds it again from the base
        ds = self._datasets.get(dataset)
        index = parse_chunk_key(chunk)
        if ds is None or index >= len(ds.manifest.layout):
            return True  # dropped; nothing here can build it, the next read will
        generation = self._table.generation[dataset]
        (item,) = ds.manifest.chunk_items([index])
        await self._misses.load(ds, generation, item)
        cached = self._table.get(dataset, chunk)
        return cached is None or await self._is_intact(cached.ref)

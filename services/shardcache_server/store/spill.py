"""The disk tier as the store uses it: chunk files written behind the table.

Ownership rule: spill owns this node's chunk files and the writes in
flight; it writes a file for each chunk the table admits, in the
background, and ``load`` maps a file back if its header matches. It never
admits or settles: ``load`` returns the value and the miss path decides.
``files`` checks the headers of files a local rank may map itself (the
store decides, in ``shard.py``, whether to hand over the file or reload it).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import defaultdict
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from shardcache.checksum import is_intact
from shardcache.chunks import row_errors
from shardcache.errors import ChunkFileError
from shardcache.keys import parse_chunk_key
from shardcache_server.store.datasets import Dataset, Item
from shardcache_server.store.disk_tier import DiskTier
from shardcache_server.store.records import IndexRecords
from shardcache_server.store.stats import StatsBuffer
from shardcache_server.store.table import Cached, HeldTable, failed_rows

__all__ = ["DISK_WRITES", "Spill"]

log = logging.getLogger(__name__)

DISK_WRITES = 2  # chunk files written at once per store (sequential disk bandwidth)


class Spill:
    """Writes admitted chunks to ``disk`` and serves them back.

    Args:
        disk: this node's chunk files.
        put: stores a value and returns a reference (``ray.put`` under Ray).
        get: maps a reference back to its value (or an awaitable of it).
        datasets: the store's registered datasets (their fingerprints head
            each file).
        table: the held chunks (a file dropped for the disk budget keeps
            its index entry while the chunk is still in memory).
        records: where releases of dropped files are written.
        stats: counters of disk hits, writes and errors.
    """

    def __init__(
        self,
        disk: DiskTier,
        *,
        put: Callable[[Any], Any],
        get: Callable[[Any], Any],
        datasets: Mapping[str, Dataset],
        table: HeldTable,
        records: IndexRecords,
        stats: StatsBuffer,
    ):
        self.disk = disk
        self._put = put
        self._get = get
        self._datasets = datasets
        self._table = table
        self._records = records
        self._stats = stats
        self._writes: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> Coroutine[Any, Any, None]:
        """Begin writing on the running loop; returns the scan that adopts
        what a previous store left on disk (the store runs it as a task)."""
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(DISK_WRITES)
        return self._scan()

    async def _scan(self) -> None:
        found = await asyncio.to_thread(self.disk.scan)
        if found:
            self._records.event("disk_adopted", "", files=found)

    def has(self, dataset: str, chunk: str) -> bool:
        """The chunk has a file, or one being written."""
        return (dataset, chunk) in self._writes or self.disk.has(dataset, chunk)

    async def files(
        self,
        ds: Dataset,
        generation: int,
        items: list[Item],
        *,
        settle: int = 0,
    ) -> list[tuple[str, int] | None]:
        """``(path, column bytes)`` per item whose file is written and matches
        the version, generation and preprocess asked for, else ``None`` (no
        file, one still being written, or one that does not match, which is
        deleted). Headers only: no column page is read here, and no checksum
        (a rank's ``verify_reads`` samples check what it maps).

        The writes in flight of the first ``settle`` items are waited for:
        chunks not in memory, which the miss path would otherwise wait for
        and then reload whole from the same file.
        """
        writing = [
            task
            for chunk, _, _ in items[:settle]
            if (task := self._writes.get((ds.name, chunk))) is not None
        ]
        if writing:
            await asyncio.wait(writing)
        wanted = [
            (i, chunk, version)
            for i, (chunk, version, _) in enumerate(items)
            if (ds.name, chunk) not in self._writes and self.disk.has(ds.name, chunk)
        ]
        out: list[tuple[str, int] | None] = [None] * len(items)
        if not wanted:
            return out

        def check() -> None:
            for i, chunk, version in wanted:
                out[i] = self.disk.check(
                    ds.name,
                    chunk,
                    {
                        "version": version,
                        "generation": generation,
                        "fingerprint": ds.fingerprint,
                    },
                )

        await asyncio.to_thread(check)
        return out

    async def load(self, ds: Dataset, generation: int, item: Item) -> Cached | None:
        """The chunk from its file, put into the object store, if the file
        matches the version, generation and preprocess asked for; else ``None``."""
        chunk, version, _ = item
        writing = self._writes.get((ds.name, chunk))
        if writing is not None:  # evicted before its file was written: wait
            await asyncio.wait([writing])
        expect = {
            "version": version,
            "generation": generation,
            "fingerprint": ds.fingerprint,
        }
        columns = await asyncio.to_thread(self.disk.read, ds.name, chunk, expect)
        if columns is None:
            return None
        if not await asyncio.to_thread(is_intact, columns):
            # Never served: the file's bytes changed since it was written (or
            # it predates checksums). Build the chunk from the source instead.
            log.warning(
                "chunk file %s/%s fails its checksum; rebuilding", ds.name, chunk
            )
            self._stats.add((ds.name, generation), "corrupt_chunks")
            self.disk.remove(ds.name, chunk)
            return None
        # Into the object store (one copy of the mapped pages), so the rank's
        # read path is the same as for a chunk built from the source.
        ref = await asyncio.to_thread(self._put, columns)
        self._stats.add((ds.name, generation), "disk_hits")
        lo, hi = ds.manifest.layout.bounds(parse_chunk_key(chunk))
        return Cached(
            ref,
            version,
            generation,
            int(sum(v.nbytes for v in columns.values())),
            ds.manifest.hashes[lo:hi].copy(),
            failed_rows(row_errors(columns)),
        )

    def soon(self, dataset: str, generation: int, chunk: str, value: Cached) -> None:
        """Write a newly cached chunk to disk in the background."""
        if self._loop is None:
            return
        key = (dataset, chunk)
        task = self._loop.create_task(self._write(dataset, generation, chunk, value))
        self._writes[key] = task
        task.add_done_callback(
            lambda t: (
                self._writes.pop(key, None) if self._writes.get(key) is t else None
            )
        )

    async def _write(
        self, dataset: str, generation: int, chunk: str, value: Cached
    ) -> None:
        assert self._slots is not None
        ds = self._datasets.get(dataset)
        if ds is None:
            return
        async with self._slots:
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
                    self.disk.write, dataset, chunk, columns, meta
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
        gen = self._table.generation
        for ds_name, ks in gone.items():
            self._records.write(
                lambda idx, d=ds_name, ks=ks: idx.release(
                    d, gen[d], ks, self._records.me
                )
            )

    async def flush(self) -> dict[str, int]:
        """Wait for the writes in flight; returns the disk's summary."""
        while self._writes:
            await asyncio.gather(*list(self._writes.values()), return_exceptions=True)
        return self.disk.summary()

"""A rank's view of the cache: the chunks it holds, resolves and prefetches.

Per batch the reader maps sample indices to ``(chunk, row)`` with one
vectorised search, makes sure the chunks are held (a warm batch: none to
fetch, no Ray or Redis call), and copies rows into one preallocated batch
tensor. A background thread resolves the chunks the coming batches need, in
the order they are first needed, several store calls in flight, and maps
them (``ray.get``, or ``mmap`` of what the node-local endpoint hands over)
off the training loop.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from shardcache.checksum import check_resolved
from shardcache.chunk_file import will_need
from shardcache.chunks import Chunk
from shardcache.daemon_pool import DaemonPool
from shardcache.manifest import Manifest
from shardcache.transport.base import Status, Transport
from shardcache.usage.totals import ORIGINS  # where a delivered sample came from
from shardcache.variants import VariantSpec

__all__ = ["ChunkReader", "origin_counts"]

log = logging.getLogger("shardcache")

PREFETCH_GROUP = 4  # chunks per store call while prefetching
PREFETCH_DEPTH = 4  # store calls in flight per rank
TRANSIENT_KEPT = (
    32  # chunks not held (store did not cache them) kept for the next batches
)
# Disk-tier files kept mapped for the epoch: page cache, no memory of the
# process's own, one mapping each (far below vm.max_map_count, 65,530).
MAPS_KEPT = 4096
SMALL_BATCH = 256  # up to this many samples a batch is counted in Python (_per_chunk)


def origin_counts() -> dict[str, int]:
    """Samples and bytes served per origin, all 0: ``stats()["served"]``'s keys.

    >>> origin_counts()["source"], origin_counts()["local_bytes"]
    (0, 0)
    """
    return {o: 0 for o in ORIGINS} | {f"{o}_bytes": 0 for o in ORIGINS}


class ChunkReader:
    """Holds, resolves and prefetches one process's chunks of one dataset.

    Args:
        client: this process's transport (``shardcache.transport``): the Ray
            path, the node-local endpoint, or a remote worker.
        name: the dataset. manifest: the listing the rank reads.
        digest: that listing's digest. hold_bytes: chunk bytes kept mapped.
        timeout_s: how long one resolution may wait.
        verify_reads: share of resolved chunks checked against their checksum.
        variants: the dataset's augmented variants, if any: chunks are then
            asked for as the variant :meth:`use_variant` names.
    """

    def __init__(
        self,
        client: Transport,
        name: str,
        manifest: Manifest,
        digest: str,
        hold_bytes: int,
        timeout_s: float,
        verify_reads: float = 0.0,
        variants: VariantSpec | None = None,
    ):
        self.client, self.name = client, name
        self.variants = variants
        self.variant: int | None = None  # the variant this epoch reads
        # Chunks served in their base form instead of the variant asked for.
        self._fallback: set[int] = set()
        self._warned_fallback = False
        self.variant_counts = {"variant_samples": 0, "base_fallback": 0}
        self.verify_reads = verify_reads
        self.timeout_s, self.hold_bytes = timeout_s, hold_bytes
        self.set_manifest(manifest, digest)
        self.generation = -1
        self._lock = threading.Lock()
        self._held: dict[int, Chunk] = {}
        self._held_bytes = 0
        self._transient: OrderedDict[int, Chunk] = OrderedDict()
        self._transient_bytes = 0
        # Disk-tier files kept mapped for the epoch: page cache, not memory
        # of this process's own, so kept by count apart from the byte budget.
        self._maps: OrderedDict[int, Chunk] = OrderedDict()
        self._largest = 0  # the largest chunk resolved, as held (decoded) bytes
        # Where each chunk's samples count from, for chunks that are not
        # "local" (disk, peer, source): a warm batch from held chunks finds
        # it empty and is counted in one step (``count``).
        self._origin: dict[int, str] = {}
        # Per chunk read from the source this epoch, its rows not yet counted
        # as source (all of them, or a partial rebuild's): 1 byte a row.
        self._sourced: dict[int, bytearray] = {}
        self._disk_sampled: set[int] = set()  # disk-tier files checked this epoch
        self._pending: dict[int, Future[None]] = {}
        self.saw_uncached = False  # the stores could not cache a chunk this generation
        self._background: DaemonPool | None = None  # the look-ahead
        self._reports: ThreadPoolExecutor | None = None
        self.counts = origin_counts()
        # The reading this process's requests are for (``job:epoch``, set by
        # the session): a chunk another rank of the job had built from the
        # source in this epoch comes back FETCHED, so its rows here count as
        # source too. "" where the epoch may be stale (a persistent
        # DataLoader worker's copy of the sampler): a build counts for the
        # request that made it only.
        self.reads_for = ""

    # -- listing and generation ---------------------------------------------------------
    def set_manifest(self, manifest: Manifest, digest: str) -> None:
        self.manifest, self.digest = manifest, digest
        self.layout = manifest.layout
        self.versions = manifest.chunk_versions(self.layout)

    def drop_chunks(self, chunks: Sequence[int]) -> None:
        """Forget held chunks (their members changed upstream)."""
        with self._lock:
            for c in chunks:
                chunk = self._held.pop(int(c), None)
                if chunk is not None:
                    self._held_bytes -= chunk.nbytes
                dropped = self._transient.pop(int(c), None)
                if dropped is not None:
                    self._transient_bytes -= dropped.nbytes
                self._maps.pop(int(c), None)

    def use_generation(self, generation: int) -> None:
        """Switch to ``generation``; what was held belongs to the old one."""
        if generation == self.generation:
            return
        with self._lock:
            self._forget_held()
            self._disk_sampled.clear()
            self.saw_uncached = False
            self.generation = generation

    def use_variant(self, variant: int) -> None:
        """Read augmented variant ``variant`` from now on; what was held is
        another view of the samples (the epoch before read another variant)."""
        if variant == self.variant:
            return
        with self._lock:
            self._forget_held()
            self._fallback.clear()
            self.variant = variant

    def _forget_held(self) -> None:
        """Drop every chunk held, kept or on its way (under the lock)."""
        self._held.clear()
        self._held_bytes = 0
        self._transient.clear()
        self._transient_bytes = 0
        self._maps.clear()
        self._origin.clear()
        self._sourced.clear()
        self._pending.clear()

    def new_epoch(self) -> None:
        """Held chunks are local from now on: their samples count as local hits.

        Chunks kept only for the coming batches (the stores did not cache
        them) are dropped: the next epoch asks the stores again, so their
        eviction policy, not this process, decides what stays.
        """
        with self._lock:
            # A held chunk mapped from the disk tier is still read from there.
            self._origin = {
                c: "disk" for c in self._held if self._origin.get(c) == "disk"
            }
            self._sourced.clear()
            self._disk_sampled.clear()
            self._transient.clear()
            self._transient_bytes = 0
            self._maps.clear()
            self.saw_uncached = False

    # -- batches ---------------------------------------------------------------------------
    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(chunk, row)`` of every sample index, vectorised."""
        chunks = self.layout.chunk_of(indices)
        return chunks, indices - self.layout.starts[chunks]

    def chunks_for(self, chunk_ids: np.ndarray) -> dict[int, Chunk]:
        """The chunks of one batch, resolving (one store call) what is not held."""
        wanted = set(chunk_ids.tolist())  # np.unique's fixed cost is 2x
        held = self._held
        # (keys() >= wanted walks the batch's chunks; issubset(held) would
        # first copy every held chunk id into a set.)
        if held.keys() >= wanted:  # a warm batch: every chunk held
            try:
                return {c: held[c] for c in wanted}
            except KeyError:  # a new generation dropped one meanwhile
                pass
        found: dict[int, Chunk] = {}
        missing = []
        for c in sorted(wanted):
            chunk = self._kept(c)
            if chunk is None:
                missing.append(c)
            else:
                found[c] = chunk
        for c in list(missing):
            fut = self._pending.get(c)
            if fut is not None:
                fut.result(timeout=self.timeout_s)  # never raises: see _prefetch_group
                chunk = self._kept(c)
                if chunk is not None:
                    found[c] = chunk
                    missing.remove(c)
        if missing:
            found.update(self._resolve(missing, self.generation))
        return found

    def _kept(self, c: int) -> Chunk | None:
        """Chunk ``c`` if held or kept for the coming batches."""
        for kept in (self._held, self._transient, self._maps):
            chunk = kept.get(c)
            if chunk is not None:
                return chunk
        return None

    def count(self, chunk_ids: np.ndarray, indices: np.ndarray) -> dict[str, int]:
        """Count one batch's samples by where their chunk came from (per chunk);
        returns this batch's counts and adds them to the running ``counts``."""
        sizes = self.manifest.sample_bytes(indices, chunk_ids)
        batch = dict.fromkeys(self.counts, 0)
        if not self._origin and self.variant is None:
            # Every chunk local (a warm epoch): one sum, not a pass over the
            # rows by chunk (~10 us of a 64-sample batch).
            batch["local"], batch["local_bytes"] = len(indices), int(sizes.sum())
            self.counts["local"] += batch["local"]
            self.counts["local_bytes"] += batch["local_bytes"]
            return batch
        for c, n, nbytes in _per_chunk(chunk_ids, sizes):
            if self.variant is not None:
                form = "base_fallback" if c in self._fallback else "variant_samples"
                self.variant_counts[form] += n
            origin = self._origin.get(c, "local")
            batch[origin] += n
            batch[f"{origin}_bytes"] += nbytes
        if batch["source"]:
            again, again_bytes = self._delivered_before(chunk_ids, indices, sizes)
            batch["source"] -= again
            batch["source_bytes"] -= again_bytes
            batch["local"] += again
            batch["local_bytes"] += again_bytes
        for key, value in batch.items():
            self.counts[key] += value
        return batch

    def _delivered_before(
        self, chunk_ids: np.ndarray, indices: np.ndarray, sizes: np.ndarray
    ) -> tuple[int, int]:
        """Of this batch's samples from chunks read from the source, those
        that were not: delivered before in this epoch (a sample asked for
        again, drop_last's padding, ``ds[i]`` after the loop), or not among
        the rows a partial rebuild read. ``(samples, bytes)``; they count as
        local, so source samples stay the GETs made. Plain Python over the
        batch: a few numpy calls per chunk cost more than this at 64 samples
        over ~30 chunks (a cold batch under full shuffle)."""
        again = again_bytes = 0
        origin, sourced, starts = self._origin, self._sourced, self.layout.starts
        for c, i, size in zip(
            chunk_ids.tolist(), indices.tolist(), sizes.tolist(), strict=True
        ):
            if origin.get(c) != "source":
                continue
            mask = sourced.get(c)
            if mask is None:  # the whole chunk was read: every row once
                first, end = self.layout.bounds(c)
                mask = sourced[c] = bytearray(b"\x01") * (end - first)
            row = i - int(starts[c])
            if mask[row]:
                mask[row] = 0
            else:
                again += 1
                again_bytes += size
        return again, again_bytes

    # -- resolution ---------------------------------------------------------------------
    def _resolve(self, chunks: list[int], generation: int) -> dict[int, Chunk]:
        variant = self.variant  # a prefetch thread may outlive it: checked below
        items = self.manifest.chunk_items(chunks, self.versions)
        if self.variants is not None and variant is not None:
            items = [self.variants.item(it, variant) for it in items]
        # Past the hold budget a chunk from memory is asked for again in every
        # batch that touches it; its disk-tier file, kept mapped, once an epoch.
        # Decoded sizes once any chunk was seen (source sizes may be smaller).
        largest = self._largest or max((it[2] for it in items), default=0)
        spent = self.hold_bytes - self._held_bytes < largest
        results = self.client.resolve(
            self.name,
            generation,
            items,
            self.digest,
            prefer_files=spent,
            reader=self.reads_for,
        )
        # A disk-tier file is mapped again on every resolve (it is not held):
        # sampled once per epoch, as a held chunk is once, since a check
        # reads the whole file where the batch reads a few rows.
        fresh = [
            j
            for j, (c, (status, _)) in enumerate(zip(chunks, results, strict=True))
            if status != Status.DISK or c not in self._disk_sampled
        ]
        checked = check_resolved(
            self.client, self.name, generation, self.digest,
            [items[j] for j in fresh], [results[j] for j in fresh],
            self.verify_reads, self.reads_for,
        )  # fmt: skip
        for j, res in zip(fresh, checked, strict=True):
            results[j] = res
            if res[0] == Status.DISK:
                self._disk_sampled.add(chunks[j])
        if self.client.remote:
            # Bytes streamed from another node and the time spent receiving
            # them: the remote read rate in stats()["served"].
            self.counts["remote_bytes"] = self.client.received_bytes
            self.counts["remote_us"] = int(self.client.received_s * 1e6)
        out: dict[int, Chunk] = {}
        with self._lock:
            current = generation == self.generation and variant == self.variant
            for c, (status, value) in zip(chunks, results, strict=True):
                chunk = Chunk(value)
                out[c] = chunk
                self._largest = max(self._largest, chunk.nbytes)
                if not current:
                    continue
                # Asked for a variant, served the base form: the stores could
                # not hold the variant. Kept for the next few batches only,
                # never held, so the epoch asks again later.
                fallback = variant is not None and chunk.variant != variant
                if fallback:
                    self._fallback.add(c)
                    self._warn_fallback()
                else:
                    self._fallback.discard(c)
                # A chunk read from the source in this epoch counts as
                # source for the whole epoch, even when a later call finds
                # it in the store (a prefetch built it, or hold_bytes=0
                # keeps nothing): a hit means "not read from the source in
                # this epoch", as a user reads it.
                if self._origin.get(c) != "source":
                    origin = Status(status).origin
                    if origin == "local":
                        self._origin.pop(c, None)
                    else:
                        self._origin[c] = origin
                    if origin == "source" and chunk.sourced is not None:
                        self._sourced[c] = bytearray(
                            np.asarray(chunk.sourced, dtype=np.uint8).tobytes()
                        )
                unheld = status in (Status.UNCACHED, Status.DISK_READ)
                if (
                    not unheld
                    and not fallback
                    and self._held_bytes + chunk.nbytes <= self.hold_bytes
                ):
                    self._held[c] = chunk
                    self._held_bytes += chunk.nbytes
                else:
                    # Not kept for the generation (the store did not cache it, or
                    # this process's hold budget is spent): kept for the next
                    # few batches only, so the store's policy stays in charge.
                    self.saw_uncached = self.saw_uncached or unheld
                    # A mapped disk-tier file costs no memory of this process's
                    # own (clean page-cache pages the kernel may reclaim): kept
                    # for the epoch by count only, so hold_bytes=0 reuses it.
                    if status == Status.DISK:
                        self._keep_map(c, chunk)
                    else:
                        self._keep_transient(c, chunk)
        return out

    def _warn_fallback(self) -> None:
        """Once per process: the stores served a chunk in its base form, as
        the README says they do when their budget cannot hold the variant;
        a run whose every epoch reads un-augmented should not learn it from
        stats() alone."""
        if self._warned_fallback:
            return
        self._warned_fallback = True
        log.warning(
            "shardcache: dataset %s: the stores' memory budget cannot hold this "
            "epoch's augmented variant of some chunks; they are read in their base "
            "form (counted in stats()['variants']['base_fallback']). Raise the "
            "stores' budget (SHARDCACHE_CACHE_BYTES, the chart's cache.cacheBytes) "
            "to read every sample augmented",
            self.name,
        )

    def _keep_transient(self, c: int, chunk: Chunk) -> None:
        """Keep a chunk from memory for the next few batches: ``TRANSIENT_KEPT``
        at most, within the hold budget (``hold_bytes=0`` keeps none: every
        batch asks the store again). Oldest go first."""
        old = self._transient.pop(c, None)
        if old is not None:
            self._transient_bytes -= old.nbytes
        self._transient[c] = chunk
        self._transient_bytes += chunk.nbytes
        while self._transient and (
            len(self._transient) > TRANSIENT_KEPT
            or self._transient_bytes > self.hold_bytes
        ):
            _, dropped = self._transient.popitem(last=False)
            self._transient_bytes -= dropped.nbytes

    def _keep_map(self, c: int, chunk: Chunk) -> None:
        """Keep a mapped disk-tier file for the epoch, ``MAPS_KEPT`` at most
        (oldest go first); a chunk from memory never drops one."""
        self._maps.pop(c, None)
        self._maps[c] = chunk
        while len(self._maps) > MAPS_KEPT:
            self._maps.popitem(last=False)

    def read_ahead(self, upcoming: np.ndarray) -> int:
        """Start reading the rows of ``upcoming`` samples from the disk-tier
        files this process keeps mapped (``chunk_file.will_need``), so their
        pages arrive while the current batch is used; rows of chunks in
        memory are left alone.

        Returns:
            How many leading samples are settled: every one before the first
            whose chunk was not asked for yet this epoch (ask again later).
        """
        settled = len(upcoming)
        if settled == 0 or not self._maps:
            return settled  # nothing read from files (yet): nothing to wait for
        chunk_ids, rows = self.locate(upcoming)
        pairs = zip(chunk_ids.tolist(), rows.tolist(), strict=True)
        for j, (c, row) in enumerate(pairs):
            mapped = self._maps.get(c)
            if mapped is None:
                if settled == len(upcoming) and self._kept(c) is None:
                    settled = j  # not asked for yet: its file may come
                continue
            sample = mapped.sample(row)
            for array in sample.values() if isinstance(sample, dict) else [sample]:
                will_need(array)
        return settled

    def prefetch(self, upcoming: np.ndarray) -> None:
        """Resolve the chunks of ``upcoming`` sample indices in the background,
        in the order they are first needed, ``PREFETCH_DEPTH`` calls in flight."""
        if len(upcoming) == 0 or self._held_bytes >= self.hold_bytes:
            return
        # Distinct chunks in the order first needed (a dict keeps it).
        ordered = dict.fromkeys(self.layout.chunk_of(upcoming).tolist())
        todo = [
            c
            for c in ordered
            if c not in self._held
            and c not in self._pending
            and c not in self._transient
            and c not in self._maps
        ]
        if not todo:
            return
        generation = self.generation
        pool = self._pool()
        for i in range(0, len(todo), PREFETCH_GROUP):
            group = todo[i : i + PREFETCH_GROUP]
            fut = pool.submit(self._prefetch_group, group, generation)
            for c in group:
                self._pending[c] = fut

    def _prefetch_group(self, group: list[int], generation: int) -> None:
        try:
            # Past an uncached chunk, reading far ahead would only read chunks
            # twice: they could not be kept until the loop reaches them.
            if generation == self.generation and not self.saw_uncached:
                self._resolve(group, generation)
        except self.client.retryable_errors:
            pass  # the training loop asks again and raises with full context
        finally:
            for c in group:
                self._pending.pop(c, None)

    def _pool(self) -> DaemonPool:
        # Daemon threads: at exit the process does not wait for the builds
        # it asked for ahead (daemon_pool.py); the stores finish them.
        if self._background is None:
            self._background = DaemonPool(PREFETCH_DEPTH, "shardcache-prefetch")
        return self._background

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` off the training loop (stats reports, which the
        process does finish at exit)."""
        if self._reports is None:
            self._reports = ThreadPoolExecutor(
                1, thread_name_prefix="shardcache-report"
            )
        self._reports.submit(fn, *args)

    def close(self) -> None:
        if self._background is not None:
            self._background.shutdown(wait=True, cancel_futures=True)
            self._background = None
        if self._reports is not None:
            # Queued reports dropped, as before: the final report is written
            # already, and an older one must not overwrite it.
            self._reports.shutdown(wait=True, cancel_futures=True)
            self._reports = None

    @property
    def held_bytes(self) -> int:
        return self._held_bytes


def _per_chunk(chunk_ids: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int, int]]:
    """``(chunk, samples, bytes)`` per distinct chunk of a batch, by chunk.

    Every batch pays for this: a dict over the rows costs ~10 us for 64
    samples where ``np.unique`` with inverse and counts costs ~27 (its
    fixed cost), and numpy wins only past ~300 samples.
    """
    if len(chunk_ids) > SMALL_BATCH:
        uniq, inverse, counts = np.unique(
            chunk_ids, return_inverse=True, return_counts=True
        )
        nbytes = np.bincount(inverse, weights=sizes, minlength=len(uniq))
        return list(
            zip(
                uniq.tolist(),
                counts.tolist(),
                nbytes.astype(np.int64).tolist(),
                strict=True,
            )
        )
    acc: dict[int, list[int]] = {}
    for c, size in zip(chunk_ids.tolist(), sizes.tolist(), strict=True):
        entry = acc.get(c)
        if entry is None:
            acc[c] = [1, size]
        else:
            entry[0] += 1
            entry[1] += size
    return sorted((c, n, int(b)) for c, (n, b) in acc.items())

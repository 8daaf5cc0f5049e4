"""RankSession: one process's attachment to the cache (its client, mapped listing, chunk reader, counters and usage reports) and the batch path it runs.

Every process that reads makes its own: the one that built the dataset,
and each DataLoader worker (forked, or unpickled with spawn). Nothing here
travels between processes; what does (the spec, the sampler, the
generation) is shared with the dataset and read, never owned, here.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from shardcache import block_advice, delivery
from shardcache.chunks import Chunk
from shardcache.epoch_board import EpochBoard, Post
from shardcache.errors import (
    ConfigError,
    IndexUnavailable,
    StaleVersionError,
    TransformError,
)
from shardcache.flusher import at_exit, keep_flushed, retire
from shardcache.generations import Generations
from shardcache.job import JobId
from shardcache.keys import chunk_key
from shardcache.manifest import Manifest
from shardcache.reader import ChunkReader, origin_counts
from shardcache.sampler import ShardSampler
from shardcache.spec import DatasetSpec
from shardcache.usage import ORIGINS, UsageReader, UsageReporter
from shardcache.waits import WaitRecorder
from shardcache.warmup import warm_chunks

__all__ = ["RankSession"]

RANK_REPORT_EVERY = 50  # batches between looks at the clock for a rank report
# A rank report is a percentile summary on the loop's thread and a Redis write
# in the background: at thousands of warm batches a second, every 50 batches
# was ~40 a second, each one handing the GIL to the writer mid-batch (slow
# batches in the p99 tail, bench/loader.py). The dashboard reads once a second.
RANK_REPORT_MIN_S = 1.0
STALE_RETRIES = 3  # generations a batch may try before the stores' error stands
_BYTES_KEYS = tuple((o, f"{o}_bytes") for o in ORIGINS)  # a batch's counts by origin
READ_AHEAD_BATCHES = 2  # batches whose rows in mapped files are read ahead
log = logging.getLogger("shardcache")


def _order_of(sampler: ShardSampler) -> dict[str, Any]:
    """The sampler's order is a pure function of these: a store plans its
    eviction on it (``clairvoyant``)."""
    return {
        "rank": sampler.rank,
        "world_size": sampler.world_size,
        "seed": sampler.seed,
        "shuffle": "global" if sampler.mode == "global" else sampler.shuffle,
        "drop_last": sampler.drop_last,
        "epoch": sampler.epoch,
        "block": sampler.block,
    }


class RankSession:
    """One process's attachment to the cache and its batch path.

    Args:
        spec: what the dataset reads (settled).
        job: this run's id. rank: this process's rank (for its reports).
        sampler: the rank's order (shared with the dataset).
        generations: which generation and listing a batch reads (shared).
        client: this process's cache client (:func:`open_for_this_process`).
        manifest: the listing, when this process has it mapped already (the
            constructing process, a forked worker); ``None`` maps it by digest
            at the first batch.
    """

    def __init__(
        self,
        spec: DatasetSpec,
        job: JobId,
        rank: int,
        sampler: ShardSampler,
        generations: Generations,
        client: Any,
        manifest: Manifest | None,
        board: EpochBoard | None = None,
    ):
        self.pid = os.getpid()
        self.board = board
        self._followed: str | None = None  # the board's text a worker last acted on
        self.spec, self.job, self.rank = spec, job, rank
        self.sampler, self.generations = sampler, generations
        self.client, self.manifest = client, manifest
        self.reader: ChunkReader | None = None
        self.waits = WaitRecorder()
        self.counts = {
            "hits": 0,
            "misses": 0,
            "remote_reads": 0,
            "bytes": 0,
            "samples": 0,
            "generation_switches": 0,
            "skipped": 0,
        }
        self.index_errors = 0
        self.consumed = 0  # samples this process handed out this epoch
        self.cursor = 0  # where in the epoch's order the next batch starts
        self.batch_size = 0  # the first batch's, for the prefetch window
        # The largest read of this epoch in this process: a drop_last tail
        # handed out and never read is less than it (slot.py's resume check).
        self.epoch_batch = 0
        # (epoch, batch): the saved epoch's largest read a resume brought (its
        # state's "batch"); slot.py's workers-read check uses it.
        self.resumed_batch = (-1, 0)
        self._read_ahead_to = (-1, 0)  # (epoch, position) read ahead up to
        self._prefetched_to: tuple[Any, int] = (None, 0)  # (epoch..., position)
        self.epoch_reported = False
        self._rank_reported_at = 0.0  # time.monotonic() of the last report
        self.warned_skip = False
        # The reader's served counts when this epoch began, and the shuffle
        # block the last warm epoch suggested (block_advice.py; 0: none).
        self._served_at_start: dict[str, int] = {}
        self._full_epochs = 0  # whole epochs in a row, the last one read as:
        self._read_as: tuple[str, int] | None = None  # (listing digest, generation)
        # What this epoch's batches read: the first's (digest, generation),
        # and whether a later batch read another (a refresh or invalidate).
        self._epoch_read: tuple[str, int] | None = None
        self._epoch_mixed = False
        self.suggested_block = 0
        generations.renew()
        # The reporter reaches the client, never the session: the finalizer
        # below holds the reporter, and must not keep the session alive.
        self.usage = UsageReporter(
            lambda: client.index.client,
            spec.config.namespace,
            spec.name,
            job.id,
            rank,
            redis_url=client.redis_url if spec.config.redis_url else "",
        )
        keep_flushed(self.usage)
        at_exit(self.final_report)
        # Collected before the process ends (a dataset built in main(), taken
        # by the cyclic GC once main returns: a README trial lost a whole
        # job's counts so), the session still makes its last report.
        last = functools.partial(
            _report_collected, self.pid, self.usage, client, spec.name, job.id,
            rank, self.counts, self.waits, generations,
        )  # fmt: skip
        self._collected = weakref.finalize(self, retire, self.usage, last, self.pid)
        self._collected.atexit = False  # at exit a live session reports itself

    @property
    def is_current(self) -> bool:
        """This session belongs to the running process (not inherited by fork)."""
        return self.pid == os.getpid()

    # -- attachment ------------------------------------------------------------------
    def store_spec(self) -> dict[str, Any]:
        """What the stores are told at registration: the listing, the
        generation and the rank's order."""
        spec = {
            **self.spec.listing(),
            "fingerprint": self.spec.fingerprint,
            "generation": self.generations.generation,
            "manifest": self.generations.digest,
            "order": _order_of(self.sampler),
        }
        if self.spec.variants is not None:
            spec["variants"] = self.spec.variants.install()
        return spec

    def attach(self) -> ChunkReader:
        """This process's reader: registers with the node's store (ships the
        preprocess) and maps the listing, once per process."""
        if self.reader is not None:
            return self.reader
        self.client.install(self.store_spec(), self.spec.preprocess, self.spec.target)
        if self.manifest is None:
            self.manifest = self.client.map_manifest(
                self.client.manifest_of(self.spec.name, self.generations.digest)
            )
        config = self.spec.config
        self.reader = ChunkReader(
            self.client,
            self.spec.name,
            self.manifest,
            self.generations.digest,
            config.hold_bytes,
            config.request_timeout_s,
            config.verify_reads,
            self.spec.variants,
        )
        self.reader.reads_for = self._reading()
        return self.reader

    def _reading(self) -> str:
        """What this process's requests read for: ``job:epoch``; in a
        DataLoader worker, what its rank's process posted (a persistent
        worker keeps the sampler's epoch of its start, so its own copy
        cannot say which epoch it reads). "" for a job id a later run may
        carry too (``job=nightly`` run again: its epoch 0 would count the
        chunks the last run built as source reads)."""
        if get_worker_info() is not None:
            return Post.decode(self.board.read() if self.board else "").reading
        if not self.job.one_launch:
            return ""
        return f"{self.job.id}:{self.sampler.epoch}"

    @property
    def follows_board(self) -> bool:
        """This process is a DataLoader worker: it follows its rank's posts."""
        return get_worker_info() is not None

    def follow_board(self) -> None:
        """:meth:`_follow_board` now, outside a batch."""
        self._follow_board(self.attach())

    def _follow_board(self, reader: ChunkReader) -> None:
        """In a DataLoader worker, before each batch: what the rank posted
        since the last one. A new reading is a new epoch here too (a
        persistent worker lives through several); a new listing (the rank's
        ``refresh()``) is read from now on; and after either, or the rank's
        ``invalidate()``, the generation is read anew."""
        text = "" if self.board is None else self.board.read()
        if text == self._followed:
            return
        post = Post.decode(text)
        if post.listing and post.listing != self.generations.digest:
            found = self.generations.follow(self.client, reader.manifest, post.listing)
            self.use_listing(found.manifest, found.digest, found.stale_chunks)
            if not self.sampler.listing.complete:
                # This worker's copy of the sampler follows its rank to a
                # longer prefix of a listing still being listed (the rank's
                # own sampler is moved by the dataset, last).
                new = found.manifest
                self.sampler.extend(
                    new.layout.sizes(), new.prefix_ends, not new.is_prefix
                )
        if post.moves_generation(Post.decode(self._followed or "")):
            self.generations.renew()
        self._followed = text  # only once followed: a failed move is tried again
        if post.reading != reader.reads_for:
            if reader.reads_for:
                reader.new_epoch()
            reader.reads_for = post.reading

    def announce(self) -> None:
        """Post this rank's reading, listing and invalidations for its
        DataLoader workers (at each epoch start, after refresh and invalidate)."""
        if self.board is None or not self.is_current or get_worker_info() is not None:
            return
        generations = self.generations
        post = Post(
            self._reading(),
            self.sampler.epoch,
            generations.digest,
            generations.invalidations,
        )
        self.board.post(post.encode())

    def use_listing(self, manifest: Manifest, digest: str, stale: list[int]) -> None:
        """Read ``manifest`` from now on (a refresh): chunks built from changed
        objects are dropped and the stores learn the new listing."""
        self.manifest = manifest
        if self.reader is not None:
            self.reader.set_manifest(manifest, digest)
            self.reader.drop_chunks(stale)
            self.client.install(
                self.store_spec(), self.spec.preprocess, self.spec.target
            )

    def generation(self) -> int:
        """The generation the next batch reads (see ``Generations.read``)."""
        try:
            return self.generations.read(self.client.index, self.manifest)
        except IndexUnavailable:
            # Redis down: keep serving what we hold under the last known
            # generation; counted so the outage is visible in stats().
            self.index_errors += 1
            return self.generations.generation

    # -- the batch path ----------------------------------------------------------------
    def read_batch(
        self, indices: Sequence[int], *, collate: bool, pin_memory: bool = False
    ) -> Any:
        """One batch of ``indices``: a list of samples, or (``collate``) one
        tensor per field gathered in one copy. Down once, back once."""
        started = time.perf_counter()
        # 1. Attach: this process's reader (its first batch maps the listing).
        reader = self.attach()
        if get_worker_info() is not None:
            self._follow_board(reader)
        # 2. Locate: every sample index -> (chunk, row), vectorised.
        idx = np.asarray(indices, dtype=np.int64)
        chunk_ids, rows = reader.locate(idx)
        # 3. Fetch the chunks, all of one generation.
        chunks = self._chunks_of_one_generation(reader, chunk_ids)
        # 4. on_error="skip": a sample that could not be read or built is
        #    replaced by another of its batch (every rank keeps its steps).
        #    Its slot is still counted as its own sample's (step 6): that
        #    object was read (a GET made), the stand-in was delivered already.
        asked_chunks, asked = chunk_ids, idx
        if self.spec.on_error == "skip":
            chunk_ids, rows, idx, skipped = delivery.substitute_failed(
                chunks, chunk_ids, rows, idx, reader.manifest.url
            )
            if skipped:
                self._note_skipped(skipped)
        # 5. Gather: straight into the batch tensor, unless samples go one by
        #    one (a list was asked for, or the transform runs per sample).
        transform, url_of = self.spec.transform, reader.manifest.url
        if collate and transform is None:
            batch = delivery.collate(chunks, chunk_ids, rows, idx, pin_memory, url_of)
            batch = delivery.as_tuple(batch)
        else:
            batch = delivery.samples(chunks, chunk_ids, rows, idx, url_of)
            if batch and delivery.is_tuple_sample(batch[0]):
                batch = [delivery.as_tuple(s) for s in batch]
            if transform is not None:
                batch = [
                    self._transform(i, s)
                    for i, s in zip(idx.tolist(), batch, strict=True)
                ]
            if collate:
                batch = torch.utils.data.default_collate(batch)
        # 6. Account: where the samples came from, what the batch waited.
        delta = reader.count(asked_chunks, asked)
        self._account(delta, len(idx), time.perf_counter() - started)
        # 7. Look ahead: resolve the coming batches' chunks, report the rank.
        self._look_ahead(reader)
        return batch

    def _chunks_of_one_generation(
        self, reader: ChunkReader, chunk_ids: np.ndarray
    ) -> dict[int, Chunk]:
        self._use_variant(reader)
        for attempt in range(STALE_RETRIES):
            reader.use_generation(self.generation())
            try:
                return reader.chunks_for(chunk_ids)
            except StaleVersionError:
                if attempt == STALE_RETRIES - 1:
                    raise
                # The snapshot expired on the stores: move to the newest
                # generation at this batch boundary, never within a batch.
                self.generations.renew()
                self.counts["generation_switches"] += 1
        raise AssertionError("unreachable")

    def _note_skipped(self, skipped: list[int]) -> None:
        self.counts["skipped"] += len(skipped)
        self.usage.skipped(len(skipped))
        if not self.warned_skip:
            self.warned_skip = True
            assert self.manifest is not None
            log.warning(
                "shardcache: dataset %s: skipping samples that could not be read "
                "or built (on_error='skip'), first %s; each is replaced by another "
                "sample of its batch and counted as skipped in stats()",
                self.spec.name,
                ", ".join(repr(self.manifest.url(i)) for i in skipped[:3]),
            )

    def _transform(self, idx: int, sample: Any) -> Any:
        transform = self.spec.transform
        assert transform is not None and self.manifest is not None
        try:
            return transform(sample)
        except Exception as exc:  # user code
            raise TransformError(
                f"transform {getattr(transform, '__qualname__', transform)!r} raised "
                f"{type(exc).__name__} on {self.manifest.url(idx)!r}: {exc}"
            ) from exc

    def _account(self, delta: dict[str, int], n: int, waited: float) -> None:
        served = served_bytes = 0
        for origin, bytes_key in _BYTES_KEYS:  # (no f-strings: every batch)
            if delta[origin]:
                served += delta[origin]
                served_bytes += delta[bytes_key]
                self.usage.served(origin, delta[origin], delta[bytes_key])
        self.counts["hits"] += served - delta["source"]
        self.counts["misses"] += delta["source"]
        self.counts["remote_reads"] += delta["source"]
        self.counts["bytes"] += served_bytes
        self.waits.record(waited)
        self.usage.waited(waited, self.sampler.epoch)
        reading = (self.generations.digest, self.generations.generation)
        self.usage.reading(*reading)
        if self._epoch_read is None:
            self._epoch_read = reading
        elif reading != self._epoch_read:
            self._epoch_mixed = True
        self.counts["samples"] += n
        self.consumed += n
        self.batch_size = self.batch_size or n
        self.epoch_batch = max(self.epoch_batch, n)
        self.cursor += n

    def _look_ahead(self, reader: ChunkReader) -> None:
        prefetch_batches = self.spec.config.prefetch_batches
        if prefetch_batches:
            order = self.sampler.known_order()
            # The next batches' rows in mapped disk-tier files: read from the
            # disk while this batch is used (a page cache smaller than the
            # data would otherwise fault them in one by one in the gather).
            ahead = self.cursor + READ_AHEAD_BATCHES * self.batch_size
            epoch, done = self._read_ahead_to
            same = epoch == self.sampler.epoch  # rows before ``done`` are asked
            start = max(self.cursor, done) if same else self.cursor
            settled = reader.read_ahead(order[start:ahead])
            self._read_ahead_to = (self.sampler.epoch, start + settled)
            window = prefetch_batches * self.batch_size
            # The first batch asks for the whole rest of the epoch: a cold
            # epoch then keeps every core of the node's stores busy (the
            # reader stops early when the stores cannot cache what it asks).
            whole = self.waits.batches == 1 and not reader.saw_uncached
            end = self.cursor + (len(order) if whole else window)
            # Only the samples the window did not cover at the last batch:
            # the rest were asked for already (~15 us a batch of chunk
            # lookups otherwise). A new epoch, generation or variant asks
            # for the whole window again.
            key = (self.sampler.epoch, reader.generation, reader.variant)
            asked_key, asked = self._prefetched_to
            start = max(self.cursor, asked) if asked_key == key else self.cursor
            if start < end:
                reader.prefetch(order[start:end])
            self._prefetched_to = (key, max(end, start))
        if (
            not self.epoch_reported
            and self.sampler.listing.complete  # (else the epoch's end is not known)
            and self.cursor >= len(self.sampler)
            and get_worker_info() is None  # a worker sees only part of it
        ):
            # The rank's share of the epoch is delivered: its numbers go out
            # now, not whenever the next epoch (or the exit) comes. Once.
            self.epoch_reported = True
            reader.submit(self.usage.flush)
            self.report_rank(in_background=True)
        elif (
            self.waits.batches % RANK_REPORT_EVERY == 0
            and time.monotonic() - self._rank_reported_at >= RANK_REPORT_MIN_S
        ):
            self.report_rank(in_background=True)

    # -- the cache around this rank -------------------------------------------------------
    def warm(
        self,
        order: np.ndarray,
        start: int,
        steps: int,
        batch_size: int,
        *,
        progress: bool,
    ) -> dict[str, int]:
        """Hold on this node the chunks of the ``steps`` batches of ``order``
        from ``start``.

        Raises:
            ConfigError: ``steps`` or ``batch_size`` < 1.
        """
        if not all(isinstance(v, int) and v >= 1 for v in (steps, batch_size)):
            raise ConfigError(
                f"steps and batch_size must be integers >= 1, got {steps!r}, "
                f"{batch_size!r}."
            )
        upcoming = order[start : start + steps * batch_size]
        reader = self.attach()
        self._use_variant(reader)
        reader.use_generation(self.generation())
        return warm_chunks(reader, upcoming, progress=progress)

    def _use_variant(self, reader: ChunkReader) -> None:
        """Read this epoch's augmented variant (``variants=K``); a resumed
        epoch reads the same one (it is a function of the epoch alone)."""
        variants = self.spec.variants
        if variants is not None:
            reader.use_variant(variants.of_epoch(self.sampler.epoch))

    def cached_locality(self, shard: np.ndarray) -> dict[str, int]:
        """How many of ``shard``'s samples each node holds (from the index)."""
        assert self.manifest is not None
        chunk_ids, counts = np.unique(
            self.manifest.layout.chunk_of(shard), return_counts=True
        )
        keys = [chunk_key(c) for c in chunk_ids.tolist()]
        generation = self.generations.generation
        entries = self.client.index.entries(self.spec.name, generation, keys)
        out: dict[str, int] = {}
        for key, n in zip(keys, counts.tolist(), strict=True):
            entry = entries.get(key)
            if entry is not None:
                owner = str(entry.get("owner"))
                out[owner] = out.get(owner, 0) + n
        return out

    # -- epochs and reports --------------------------------------------------------------
    def start_epoch(self, resuming: bool) -> None:
        """A new epoch of this process: last epoch's numbers go out, the
        counters restart (a pending resume keeps its position)."""
        self.epoch_reported = False
        self.report_rank()
        self._advise_block()
        if not resuming:
            self.consumed = 0
            self.cursor = 0
        self.epoch_batch = 0
        self.waits.reset()
        if not self.is_current:
            return
        reading = self._reading()
        self.announce()  # for this process's workers
        if self.reader is not None:
            self.reader.new_epoch()
            self.reader.reads_for = reading

    def _advise_block(self) -> None:
        """After a warm epoch under a full shuffle that rebuilt many evicted
        chunks from the source, say once which ``shuffle_block`` fits and
        that a disk tier keeps them (block_advice.py)."""
        reader, sampler = self.reader, self.sampler
        if reader is None or not self.is_current or self.consumed == 0:
            return  # no batch since the last call (set_epoch twice): nothing new
        served = {
            o: reader.counts[o] - self._served_at_start.get(o, 0) for o in ORIGINS
        }
        self._served_at_start = {o: reader.counts[o] for o in ORIGINS}
        # Source reads mean evictions only in a whole epoch that read, every
        # batch of it, the listing and generation the whole epoch before it
        # read: otherwise they are first builds (a cold or cut-short epoch)
        # or a change upstream (a refresh or invalidate between or during
        # them; the listing as of now would hide one made before set_epoch).
        read_as = None if self._epoch_mixed else self._epoch_read
        self._epoch_read, self._epoch_mixed = None, False
        was_built = (
            self._full_epochs > 0 and read_as is not None and read_as == self._read_as
        )
        # Whole: every batch but a last one a drop_last loader leaves out.
        is_whole = self.consumed > sampler.num_samples - max(self.epoch_batch, 1)
        self._full_epochs = self._full_epochs + 1 if is_whole else 0
        self._read_as = read_as
        total = sum(served.values())
        if (
            self.suggested_block
            or sampler.mode != "shard"
            or not sampler.shuffle
            or sampler.block
            or total == 0
            or not (was_built and is_whole)  # first builds say nothing of memory
        ):
            return
        # Disk-tier files are kept mapped for the epoch (reader.py): only
        # rebuilds cost the full shuffle. Peer reads are another node's.
        _, per_chunk = np.unique(
            sampler.layout.chunk_of(sampler.shard), return_counts=True
        )
        block = block_advice.suggest_block(served["local"], served["source"], per_chunk)
        if block:
            self.suggested_block = block
            block_advice.warn_once(self.spec.name, block, served)

    def report_rank(self, in_background: bool = False) -> None:
        if self.waits.batches == 0:
            return
        self._rank_reported_at = time.monotonic()
        report = _rank_report(
            self.counts, self.waits, self.sampler.epoch, self.generations.generation
        )
        if in_background and self.reader is not None:
            # The report is built here (the wait deque is not thread-safe to
            # read); only the Redis write leaves the training loop's path.
            self.reader.submit(self._write_rank_report, report)
        else:
            self._write_rank_report(report)

    def _write_rank_report(self, report: dict[str, Any]) -> None:
        try:
            self.client.index.record_rank(
                self.spec.name, self.job.id, self.rank, report
            )
        except IndexUnavailable:
            self.index_errors += 1

    def stats(self, rank: int, moved_on_resume: float) -> dict[str, Any]:
        """This process's counters and wait percentiles, plus the dataset's
        cluster totals (``DistributedCachedDataset.stats``)."""
        reader = self.reader
        out: dict[str, Any] = {
            "rank": rank,
            "dataset": self.spec.name,
            "job": self.job.id,
            "job_source": self.job.source,
            # The counters below are this process's; DataLoader workers count
            # (and report) their own: "job_totals" is every process of the job.
            "counts": "this process",
            "generation": self.generations.generation,
            **self.counts,
            "batches": self.waits.batches,
            "index_errors": self.index_errors,
            "held_bytes": reader.held_bytes if reader is not None else 0,
            # Every origin from the start: 0 before the first batch (and in
            # a rank whose DataLoader workers read), never a missing key.
            "served": dict(reader.counts) if reader is not None else origin_counts(),
            "moved_on_resume": moved_on_resume,
            "suggested_shuffle_block": self.suggested_block,
            **self.waits.summary(),
        }
        if self.spec.variants is not None:
            # Samples served as this epoch's variant, and those served the
            # base form instead (the stores could not hold the variant).
            out["variants"] = {
                "k": self.spec.variants.k,
                "variant": self.spec.variants.of_epoch(self.sampler.epoch),
                "variant_samples": 0,
                "base_fallback": 0,
                **(reader.variant_counts if reader is not None else {}),
            }
        total = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / total if total else 0.0
        try:
            totals = UsageReader(self.client.index.client, self.spec.config.namespace)
            self.usage.flush()  # so job_totals include this process's last batch
            out["cluster"] = totals.totals(self.spec.name).as_dict()
            out["job_totals"] = totals.job_totals(self.spec.name, self.job.id).as_dict()
        except IndexUnavailable:
            out["cluster"] = out["job_totals"] = None
        return out

    def final_report(self) -> None:
        """At process exit (``shardcache.flusher``): the last rank report;
        the usage counts are flushed right after."""
        if get_worker_info() is not None:
            # A DataLoader worker: its counts are flushed under the rank's
            # name, but the rank's report and its end are the rank's own.
            self.usage.owns_rank = False
            return
        if self.is_current:
            self.report_rank()

    def close_reader(self) -> None:
        """Stop this process's prefetch pool (the world or the process changed)."""
        if self.reader is not None and self.is_current:
            self.reader.close()

    def abandon(self) -> None:
        """Replaced before it delivered anything (a new world, or a forked
        worker's copy of its rank's): nothing to report when collected."""
        self._collected.detach()

    def close(self) -> None:
        """Report final stats, stop the prefetch threads, flush usage."""
        self._collected.detach()  # reported here, not again when collected
        self.report_rank()
        if self.reader is not None:
            self.reader.close()
        self.usage.close()


def _rank_report(
    counts: dict[str, int], waits: WaitRecorder, epoch: int, generation: int
) -> dict[str, Any]:
    """A rank's report: its counts, wait percentiles, epoch and generation."""
    return {
        **counts,
        **waits.summary(),
        "batches": waits.batches,
        "epoch": epoch,
        "generation": generation,
        "ts": time.time(),
    }


def _report_collected(
    pid: int,
    usage: UsageReporter,
    client: Any,
    name: str,
    job_id: str,
    rank: int,
    counts: dict[str, int],
    waits: WaitRecorder,
    generations: Generations,
) -> bool:
    """:meth:`RankSession.final_report` of a session collected before its
    process ended, from the parts it left (the flusher's thread runs it).
    Returns whether to close its reporter (stamping the rank ``ended``, as
    the exit hook does: a rank whose DataLoader workers deliver has no
    batches of its own); a session replaced unused is abandoned instead."""
    if pid != os.getpid():
        return False
    if get_worker_info() is not None:  # a worker's rank reports for itself
        usage.owns_rank = False
        return True
    if waits.batches == 0:
        return True
    epoch = usage.last_epoch
    report = _rank_report(counts, waits, epoch or 0, generations.generation)
    try:
        client.index.record_rank(name, job_id, rank, report)
    except IndexUnavailable:
        pass  # as report_rank: the usage counts still go (reporter.close)
    return True

"""DistributedCachedDataset: the front door, a map-style Dataset whose samples come from the cluster cache.

Its verbs are thin: what to read is a :class:`~shardcache.spec.DatasetSpec`
(validated once), which generation and listing a batch reads is
:class:`~shardcache.generations.Generations`, and this process's attachment
and batch path is a :class:`~shardcache.session.RankSession` (one per
process: DataLoader workers make their own).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from shardcache.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_SAMPLES
from shardcache.decoders import as_arrays
from shardcache.embedded import joins_embedded_head
from shardcache.errors import ConfigError, IndexUnavailable, SampleIndexError
from shardcache.fingerprint import fingerprint as object_fingerprint
from shardcache.generations import Generations, open_listing
from shardcache.job import resolve_job
from shardcache.listing_feed import POLL_S, ListingFeed
from shardcache.loader import BatchLoader
from shardcache.resume import gather_states, merge_states
from shardcache.sampler import ShardSampler, check_order
from shardcache.segments import GrowingListing
from shardcache.session import RankSession
from shardcache.slot import SessionSlot
from shardcache.source import check_local_paths
from shardcache.spec import DatasetSpec, check_source_dataset
from shardcache.transport.read_path import open_for_this_process
from shardcache.world import World

__all__ = ["DistributedCachedDataset"]

log = logging.getLogger("shardcache")

DEFAULT_DATASET_CHUNK_SAMPLES = 256  # from_dataset: sample sizes are unknown at listing


class DistributedCachedDataset(Dataset[Any]):
    """Every DDP rank reads a stable shard of a remote dataset from its node's cache.

    What to read:
        urls: an fsspec prefix, glob, or a list of object URLs, prefixes and
            globs (objects joined in key order, each once).
        preprocess: deterministic ``bytes -> array | tensor | dict`` run once per
            object on the cluster. Its fingerprint (its code, bound values and
            the globals it reads, never memory addresses) versions the cache.
            Defaults to the raw bytes as uint8 (``.npy`` objects: their array).
            Checked for picklability here: a ``ConfigError`` names the member
            that cannot travel to the cluster.
        version: your own version of the preprocessing; when set it replaces
            the fingerprint, so only changing it starts a new cache
            generation. Defaults to ``None`` (the fingerprint decides).
        transform: per-sample augmentation on the rank, after the cache (a
            Python call per sample: prefer batch-wise augmentation on the
            collated tensor for small samples).
        augment, variants: cache ``variants=K`` views of every sample, built
            in the stores by ``augment(sample, rng)``; epoch ``e`` reads view
            ``(e + seed % K) % K`` and the rank never calls ``augment``. Views
            repeat every ``K`` epochs (data echoing, K of 4-8 advised:
            ``shardcache.variants``). Default to ``None`` and ``1``.
        storage_options: passed to fsspec (e.g. an S3 endpoint).
        name: dataset namespace in the index. Defaults to one derived from ``urls``.
        target: ``url -> label`` (a number); when set, samples are ``(x, label)``
            pairs. Labels are computed once per object on the cluster and
            cached beside the samples (labels often live in the path, as
            with ImageFolder).

    How it is cached:
        format: a packed source (``"tar"``, ``"parquet"``, ``"hdf5"``,
            ``"lmdb"``, ``"npy"``, or one registered on the cluster), read
            in place with no conversion: many samples per file, the stores
            open the files and ranks never do. Defaults to the format the
            URL's extension names (``*.tar``...), else one object per sample.
            A ``.npy`` file holds one sample or many rows, so only a single
            ``.npy`` URL reads rows; a glob, list or prefix of ``.npy`` files
            reads one sample per file, all three alike (``format="npy"`` for
            rows). A prefix listing only tar/Parquet/HDF5/LMDB files is a
            ``ConfigError`` asking for ``format=``.
            Packed samples are bytes (tar: ``{ext: bytes}``), rows (Parquet:
            ``{column: value}``) or arrays (HDF5, .npy); ``preprocess`` may
            take ``(sample, key)`` and defaults to converting them to arrays.
        format_options: per format: ``{"columns": [...]}`` (Parquet),
            ``{"datasets": [...]}`` (HDF5).
        chunk_bytes, chunk_samples: a chunk (the unit of caching, one Ray
            object, one index entry) is a run of consecutive objects of at
            most ``chunk_samples`` objects and about ``chunk_bytes`` source
            bytes. The first job that lists a dataset fixes its chunks.
            Default to 16 MiB and 4096.

    Where the cache is:
        redis_url, ray_address: ``None`` uses the embedded local defaults.
            A pod outside Ray reads through its node's cache worker instead
            (``SHARDCACHE_ENDPOINT``, see ``shardcache.transport.read_path``).
        allow_remote: with no cache worker on this node, stream chunks from
            one on another node (``SHARDCACHE_REMOTE_URL``, Arrow Flight).
            Defaults to ``SHARDCACHE_ALLOW_REMOTE`` or ``False``.
        namespace: deployment namespace. Defaults to ``SHARDCACHE_NAMESPACE`` or "default".

    How ranks split it:
        rank, world_size: default from torch.distributed, else RANK/WORLD_SIZE, else 0/1.
        shuffle: ``True`` (a stable shard of whole chunks, reshuffled inside
            each epoch), ``"global"`` (DistributedSampler's global
            permutation) or ``False``.
        shuffle_block: shuffle this rank's chunks in blocks of about this
            many samples instead of the whole shard at once (Mosaic's shuffle
            blocks): set it when the node's cache holds less than its ranks'
            shards and no disk tier keeps the rest, so each chunk is built
            once per epoch instead of in every batch (``docs/architecture.md``,
            "Shuffle blocks"); a rank that rebuilt chunks in a warm epoch logs
            the block that fits (``stats()["suggested_shuffle_block"]``).
            Defaults to ``None`` (the whole shard).
        seed, drop_last: as for DistributedSampler.
        prefetch_batches: batches whose chunks are resolved ahead.
        revalidate: when a new job re-lists the source. ``"job"`` (the
            default): once per job, when its ranks construct the dataset
            (one listing answers all of them; objects whose ETag changed
            are re-read, nothing else). ``"never"``: start on the listing
            the cluster already holds (lists only when it holds none), for
            huge immutable datasets. A number N: reuse a listing begun less
            than N seconds ago. A listing costs one LIST request per 1,000
            keys on S3: about 10,000 sequential requests, minutes, for 10M
            objects; packed sources list files, not samples. If the source
            cannot be listed the job stops with the listing's error unless
            ``"never"`` finds a listing to start on.
        on_error: a sample whose object cannot be read or built (gone,
            unreadable, ``preprocess`` raised) raises its error at its batch
            (``"raise"``, the default) or, with ``"skip"``, is replaced by
            another sample of the same batch, so the epoch's length and every
            rank's step count stay equal; skipped samples are counted in
            ``stats()["skipped"]``, ``shardcache stats`` and the dashboard.
            A batch none of whose samples could be built has nothing to stand
            in and raises (``batch_size=1`` makes every bad sample one).
        job: this run's id on the dashboard and for the listing above.
            Defaults to ``SHARDCACHE_JOB``, then the launcher's run id
            (Ray Train, torchrun), then one id made by the first rank and
            shared through torchrun's or the process group's store: two
            runs of one script are two jobs (``shardcache.job``).
        consistency: ``"epoch"`` (the default) reads the generation once at
            ``set_epoch``, so an invalidation from elsewhere mid-epoch takes
            effect at the next epoch and the rank finishes on the bytes it
            started with (the stores keep the old chunks for
            ``retire_grace_s``). ``"batch"`` re-reads it before every batch.
            Either way a batch is never a mix of generations, and this
            dataset's own ``invalidate()`` applies from the next batch.

    Samples from ``ds[i]`` are torch tensors the caller owns: copies of the
    cached rows, so an in-place op never reaches the cache other processes
    read. ``ds.loader(batch_size)`` yields collated batches gathered
    straight into one tensor per field.

    Raises:
        ConfigError: bad arguments (rank out of range, world_size < 1, bad URL).
        EmptyDatasetError: the source lists nothing.
        SourceNotFound: the bucket or prefix does not exist.
        IndexUnavailable: Redis cannot be reached.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        preprocess: Callable[[bytes], Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        redis_url: str | None = None,
        ray_address: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool | str = True,
        shuffle_block: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        name: str | None = None,
        namespace: str | None = None,
        prefetch_batches: int | None = None,
        job: str | None = None,
        target: Callable[[str], Any] | None = None,
        consistency: str = "epoch",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        chunk_samples: int = DEFAULT_CHUNK_SAMPLES,
        format: str | None = None,  # noqa: A002 (the word users know)
        format_options: dict[str, Any] | None = None,
        source_dataset: Any = None,
        source_version: str | None = None,
        allow_remote: bool | None = None,
        version: str | None = None,
        revalidate: str | float = "job",
        on_error: str = "raise",
        augment: Callable[[Any, np.random.Generator], Any] | None = None,
        variants: int = 1,
    ):
        check_order(rank, world_size, shuffle, shuffle_block or 0, seed, drop_last)
        spec = DatasetSpec.validate(
            urls,
            preprocess,
            transform,
            storage_options=storage_options,
            name=name,
            target=target,
            chunk_bytes=chunk_bytes,
            chunk_samples=chunk_samples,
            format=format,
            format_options=format_options,
            source_dataset=source_dataset,
            source_version=source_version,
            version=version,
            revalidate=revalidate,
            on_error=on_error,
            consistency=consistency,
            redis_url=redis_url,
            ray_address=ray_address,
            namespace=namespace,
            prefetch_batches=prefetch_batches,
            allow_remote=allow_remote,
            augment=augment,
            variants=variants,
            seed=seed,
        )
        self._job = resolve_job(job)
        client = open_for_this_process(
            spec.config, ships_objects=source_dataset is not None
        )
        if (
            spec.protocol in ("file", "local")
            and client.needs_ray
            and joins_embedded_head(spec.config.ray_address)
        ):
            # The embedded head's stores see exactly this machine's files: a
            # path that is not here fails now, not after a head start (10-25 s).
            check_local_paths(urls)
        # A listing that runs long answers with its first whole chunks: the
        # first epoch reads them while the rest is listed (segments.py). The
        # global shuffle needs every object first.
        early = shuffle != "global"
        manifest, digest = open_listing(client, spec, self._job.id, early=early)
        self.spec = spec.settle(manifest)
        self._sampler = ShardSampler(
            manifest.layout.sizes(),
            rank,  # None: the sampler reads it at first use
            world_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            shuffle_block=shuffle_block or 0,
            listing=GrowingListing(manifest.prefix_ends, not manifest.is_prefix),
        )
        self._feed: ListingFeed | None = None
        if manifest.is_prefix:
            token = spec.open_token(self._job.id)
            self._feed = ListingFeed(client, self.spec, token, manifest, digest)
            self._sampler.follow(self._grow)
        # Set by a resume that crossed a source change (on_change="new_listing").
        self._resumed_across: dict[str, Any] | None = None
        self._generations = Generations(self.spec, digest)
        self._generations.register(client.index, manifest)
        # The rank is provisional until the sampler reads the world at first
        # use (a dataset may be built before the launcher or process group
        # has said where this process is); the slot follows the final one.
        world = World.provisional(rank, world_size)
        parts = (self.spec, self._job, self._sampler, self._generations, world)
        self._slot = SessionSlot(*parts, client, manifest)

    @classmethod
    def from_dataset(
        cls,
        dataset: Any,
        *,
        name: str,
        version: str | None = None,
        chunk_samples: int = DEFAULT_DATASET_CHUNK_SAMPLES,
        **kwargs: Any,
    ) -> DistributedCachedDataset:
        """Cache an existing map-style Dataset: its ``__getitem__`` runs on the
        cluster, once per index per cluster; ranks read the cached results.

        The Dataset object is shipped to the cache's build workers (through
        Ray, so it must pickle with cloudpickle; open files or DB handles
        must be opened lazily inside ``__getitem__``). Samples may be arrays,
        tensors, numbers, bytes, or a tuple/dict of them (a tuple comes back
        a tuple). ``version`` defaults to a fingerprint of the class's code
        and state; pass one when the data changes under an unchanged object.

        Raises:
            ConfigError: the Dataset cannot be pickled or has no ``__len__``.

        >>> # ds = DistributedCachedDataset.from_dataset(MyImages(root), name="imgs")
        """
        check_source_dataset(dataset)
        return cls(
            f"dataset://{name}",
            kwargs.pop("preprocess", None) or as_arrays,
            name=name,
            chunk_samples=chunk_samples,
            source_dataset=dataset,
            source_version=version or object_fingerprint(dataset),
            **kwargs,
        )

    # -- what it reads: read-only views of the settled spec, listing, generation ---
    name = property(lambda self: self.spec.name)
    urls = property(lambda self: self.spec.urls)
    storage_options = property(lambda self: self.spec.storage_options)
    format = property(lambda self: self.spec.format)
    preprocess = property(lambda self: self.spec.preprocess)
    transform = property(lambda self: self.spec.transform)
    target = property(lambda self: self.spec.target)
    config = property(lambda self: self.spec.config)
    on_error = property(lambda self: self.spec.on_error)
    consistency = property(lambda self: self.spec.consistency)
    job = property(lambda self: self._slot.job.id)  # agreed at first use, maybe
    fingerprint = property(lambda self: self.spec.fingerprint)  # versions the cache
    # The listing this process reads: None in a DataLoader worker until its
    # first batch maps it.
    manifest = property(lambda self: self._session.manifest)
    digest = property(lambda self: self._generations.digest)
    generation = property(lambda self: self._generations.generation)
    # What this process delivered, by origin; flushed to Redis off the loop.
    usage_reporter = property(lambda self: self._session.usage)

    # -- this process: its session lives in the slot ----------------------------------
    rank = property(lambda self: self._slot.rank)
    world_size = property(lambda self: self._slot.world_size)
    # The session of the process that holds this object (it may be stale in
    # a forked worker before its first batch; _here() renews it).
    _session = property(lambda self: self._slot.session)

    def _here(self) -> RankSession:
        return self._slot.here()  # this process's session, renewed if stale

    def __getstate__(self) -> dict[str, Any]:
        # Resolved before anything is pickled: workers must deal this rank's
        # shard, not guess the world on their own (no process group there).
        with contextlib.suppress(ConfigError):  # unknowable yet is fine
            self._sampler.rank  # noqa: B018 (resolves the world)
        # The slot leaves its session behind; workers follow a growing
        # listing through the epoch board, never by a feed of their own.
        return {**self.__dict__, "_feed": None}

    def _grow(self, wait: bool) -> None:
        """More of a listing the stores are still listing (the sampler asks,
        ``wait``ing when it has nothing left to hand out): the sampler, this
        process's session, the stores and the DataLoader workers move to it."""
        feed = self._feed
        if feed is None:
            return
        # What the feed holds is applied first (a move cut short by an error).
        if feed.digest == self._generations.digest and not (
            feed.wait() if wait else feed.poll()
        ):
            return
        manifest, digest = feed.manifest, feed.digest
        session = self._here()
        before = self._generations.digest
        self._generations.digest = digest  # the stores are told this one
        try:
            session.use_listing(manifest, digest, [])
            session.announce()  # this rank's DataLoader workers follow it
        except BaseException:
            self._generations.digest = before  # moved again at the next ask
            raise
        # Last: only now may the sampler hand out the new indices.
        self._sampler.extend(
            manifest.layout.sizes(), manifest.prefix_ends, feed.complete
        )
        if feed.complete:
            self._feed = None
            with contextlib.suppress(IndexUnavailable):  # counted when read again
                self._generations.register(session.client.index, manifest)

    def _reach(self, index: int) -> None:
        """A listing still growing: follow it until it holds ``index`` or ends
        (a DataLoader worker follows its rank through the epoch board)."""
        while index >= self._sampler.n and not self._sampler.listing.complete:
            session = self._here()
            if session.follows_board:
                session.follow_board()
                if index >= self._sampler.n:
                    time.sleep(POLL_S)  # the rank posts the listing it moved to
            else:
                self._sampler.wait_more()

    # -- Dataset protocol -----------------------------------------------------------
    def __len__(self) -> int:
        self._sampler.wait_whole()  # a listing still growing: its end
        return self._sampler.n

    @property
    def sampler(self) -> ShardSampler:
        """Use as ``DataLoader(ds, sampler=ds.sampler)``; ``len`` is this rank's share."""
        return self._sampler

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: reshuffle this rank's order and report last epoch's waits.

        ``ds.sampler.set_epoch(epoch)`` does the same (trainers call that one);
        calling both with one epoch does the work once.
        """
        self._sampler.set_epoch(epoch)  # calls the slot's start_epoch back

    def __getitem__(self, idx: int) -> Any:
        """Sample ``idx``; a negative one counts from the end, as in a list.

        Raises:
            SampleIndexError: ``idx`` is out of range or not an integer (an
                ``IndexError``, so iterating ``ds[i]`` until it raises works).
        """
        try:
            i = operator.index(idx)
        except TypeError:
            raise SampleIndexError(
                f"sample index {idx!r} is a {type(idx).__name__}; pass an integer."
            ) from None
        if i < 0 and -len(self) <= i:  # (len() waits for a listing still growing)
            i += len(self)
        return self.__getitems__([i])[0]  # the range is checked there

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch as a list of zero-copy samples (DataLoader's collate stacks them).

        ``loader()`` is faster: it gathers straight into the batch tensor.

        Raises:
            SampleIndexError: an index is out of range or not an integer.
        """
        idx = self._checked(indices)
        # The batch as asked for (before on_error="skip" stand-ins).
        self._sampler.audit(idx)
        return self._here().read_batch(idx, collate=False)

    def collated(self, indices: Sequence[int], pin_memory: bool = False) -> Any:
        """One collated batch of ``indices``: ``(B, ...)`` tensors gathered from
        the chunks in one copy (a dict of them for dict samples, ``(x, y)``
        with a target).

        Raises:
            CollateError: the samples differ in shape.
            SampleIndexError: an index is out of range or not an integer.
        """
        idx = self._checked(indices)
        return self._here().read_batch(idx, collate=True, pin_memory=pin_memory)

    def _checked(self, indices: Sequence[int]) -> np.ndarray:
        """``indices`` as int64, each in ``[0, len(self))``: a bad one would
        otherwise read a row of the wrong chunk or fail deep in numpy."""
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu" and idx.size:
            raise SampleIndexError(
                f"sample indices must be integers, got {idx.dtype} values "
                f"such as {idx.flat[0]!r}."
            )
        idx = idx.astype(np.int64, copy=False)
        if not idx.size:
            return idx
        low, high = int(idx.min()), int(idx.max())  # each a pass over the batch
        if high >= self._sampler.n:
            self._reach(high)
        n = self._sampler.n  # listed so far: all of it, once the listing ended
        if low < 0 or high >= n:
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise SampleIndexError(
                f"sample index {bad} is out of range for a dataset of "
                f"{n} samples (a batch takes indices 0 to {n - 1})."
            )
        return idx

    def loader(
        self,
        batch_size: int,
        *,
        drop_last: bool = False,
        pin_memory: bool = False,
        device: str | torch.device | None = None,
    ) -> BatchLoader:
        """This rank's batches of the current epoch, collated (the fast path).

        >>> # for epoch in range(3):
        >>> #     ds.set_epoch(epoch)
        >>> #     for x in ds.loader(64): ...
        """
        return BatchLoader(
            self, batch_size, drop_last=drop_last, pin_memory=pin_memory, device=device
        )

    def epoch_indices(self) -> Iterator[np.ndarray]:
        """The rest of this epoch's order (after a resume), for ``loader()``."""
        order = self._sampler.order()
        yield order[self._sampler.take_skip() :]

    # -- stats, generations --------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """This rank's counters and wait percentiles, plus the dataset's cluster totals."""
        moved = self._sampler.moved_on_resume
        out = self._session.stats(self.rank, moved)
        out["listing"] = self.digest
        out["resumed_across_change"] = self._resumed_across
        return out

    def invalidate(self) -> int:
        """Start a new generation now; the next batch re-fetches. Returns it.

        The ranks of a job that all call it at the same point (from the
        same generation, as DDP code does) start one generation together.
        """
        session = self._here()  # the world, and so the job, known
        generation = self._generations.invalidate(
            session.client.index, self._slot.job, self._sampler.epoch
        )
        session.announce()  # for this rank's DataLoader workers
        return generation

    def refresh(self) -> list[str]:
        """Re-list the source (once for all ranks refreshing together); objects
        whose ETag changed are re-read, nothing else. Returns their URLs.

        Call it on every rank (e.g. before ``set_epoch``): a rank reads the
        version its own listing saw, so ranks that have not refreshed keep
        the version they listed, consistently, until they do.

        Raises:
            ConfigError: objects were added or removed (the shards would move).
        """
        self._sampler.wait_whole()  # a refresh re-lists the whole listing
        session = self._here()
        old = (
            session.attach().manifest if session.manifest is None else session.manifest
        )
        found = self._generations.refresh(session.client, old, self.job)
        session.use_listing(found.manifest, found.digest, found.stale_chunks)
        session.announce()  # for this rank's DataLoader workers
        return found.changed

    # -- state (resume) ------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is: O(1) (epoch, seed, world, consumed count, node),
        and what it read: the listing digest (``"manifest"``), the cache
        generation and the sample layout's digest.

        ``consumed`` overrides the count seen by this process (pass it when
        DataLoader workers fetch: the samples this rank took this epoch,
        counted from the epoch's start, a resumed run's count included; or use
        torchdata's ``StatefulDataLoader``, whose state needs no count).
        Merge every rank's state (:meth:`merge_states`, :meth:`gather_state_dict`)
        to resume at another world size.

        Raises:
            ConfigError: no ``consumed``, and DataLoader workers read this
                epoch's samples (this process's sampler handed out a batch or
                more that this process did not read): the workers read ahead
                of the loop, so the count here would replay what it took; or a
                ``consumed`` that is not an integer from 0 to ``len(ds.sampler)``
                (checked now, not when the checkpoint is loaded).
        """
        return self._slot.state(consumed)

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Every old rank's :meth:`state_dict` -> one state to resume at any world size.

        >>> # DistributedCachedDataset.merge_states([torch.load(f) for f in rank_files])
        """
        return merge_states(states)

    def gather_state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The merged state of every rank, on every rank (one ``all_gather_object``
        under torch.distributed): save it from rank 0. A collective: call it
        on every rank. If any rank cannot give its state, every rank raises
        (naming that rank) instead of the others waiting for it.

        >>> # state = ds.gather_state_dict(); if rank == 0: torch.save(state, path)
        """
        return gather_states(lambda: self.state_dict(consumed))

    def load_state_dict(
        self,
        state: dict[str, Any] | Sequence[dict[str, Any]],
        nodes: Sequence[str] | None = None,
        *,
        on_change: str = "error",
    ) -> None:
        """Resume mid-epoch: the next iteration yields exactly the unseen samples.

        ``state`` is this rank's own :meth:`state_dict` (same world), or the
        states of every rank of the saving job (a list, or merged): then the
        world size may differ and the unseen samples are dealt over the new
        ranks, each exactly once, preferring the node that cached them
        (``stats()["moved_on_resume"]`` says what had to move). ``nodes``
        names every new rank's node; by default it is gathered over the
        process group (a collective: call it on every rank).

        After an elastic resume rank lengths may differ by one sample;
        ``loader(B)`` and ``DataLoader(batch_sampler=ds.sampler.batches(B))``
        still give every rank the same number of steps (a plain
        ``batch_size=B`` can leave one rank a one-sample step more).

        ``on_change`` decides a state saved before objects of the source
        changed (this job re-listed them): ``"error"`` (the default) refuses
        and names the changed objects, so a resumed run's data is always
        what the saved run would have read; ``"new_listing"`` finishes the
        saved epoch on today's listing: every sample not yet delivered is
        delivered once, and changed objects among them at their new version
        (those delivered before the save were trained on at the old one).
        It needs the same objects listed (none added or removed).

        Raises:
            ConfigError: the state belongs to another dataset, seed or mode,
                one rank's state is given for another world size, or it was
                saved on another listing (see ``on_change``).
        """
        self._resumed_across = self._slot.resume(state, nodes, on_change)

    # -- the cache around this rank --------------------------------------------------------
    def warm(
        self, steps: int, batch_size: int, *, progress: bool = True
    ) -> dict[str, int]:
        """Hold, on this rank's node, the chunks of this rank's next ``steps``
        batches (resume included) before training starts; the rest streams
        in behind the loop as usual. Returns chunk and sample counts.

        Raises:
            ConfigError: ``steps`` or ``batch_size`` < 1.

        >>> # ds.set_epoch(0); ds.warm(steps=50, batch_size=64)
        """
        return self._slot.warm(steps, batch_size, progress=progress)

    def cached_locality(self) -> dict[str, int]:
        """How many of this rank's shard samples are cached on each node (from the index)."""
        return self._session.cached_locality(self._sampler.shard)

    def close(self) -> None:
        """Report final stats and stop the prefetch threads.

        Never required for the numbers to be right: they are flushed every
        second and at process exit. ``with DistributedCachedDataset(...) as
        ds:`` calls it.
        """
        self._session.close()

    def __enter__(self) -> DistributedCachedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

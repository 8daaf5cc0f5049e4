"""DistributedCachedDataset: a map-style Dataset whose samples come from the cluster cache."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from shardcache.changes import describe_changes
from shardcache.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_SAMPLES
from shardcache.config import ClientConfig
from shardcache.decoders import as_arrays, raw_bytes
from shardcache.errors import (
    ConfigError,
    IndexUnavailable,
    RemoteFetchError,
    ShardUnavailable,
    StaleVersionError,
    TransformError,
)
from shardcache.fingerprint import dataset_fingerprint, fingerprint, log_new_generation
from shardcache.flusher import at_exit, keep_flushed
from shardcache.job import resolve_job
from shardcache.keys import validate_name
from shardcache.loader import BatchLoader
from shardcache.manifest import Manifest
from shardcache.packed_manifest import PackedManifest, format_of, objects_preprocess
from shardcache.picklability import check_picklable
from shardcache.reader import ChunkReader
from shardcache.resume import apply_state, current_node, gather_states, merge_states
from shardcache.sampler import ShardSampler
from shardcache.source import open_remote
from shardcache.transport.read_path import open_client
from shardcache.usage import ORIGINS, UsageReader, UsageReporter
from shardcache.waits import WaitRecorder
from shardcache.warmup import warm_chunks
from shardcache.world import World

__all__ = ["DistributedCachedDataset"]

RANK_REPORT_EVERY = 50  # batches between best-effort rank reports to Redis
DEFAULT_DATASET_CHUNK_SAMPLES = 256  # from_dataset: sample sizes are unknown at listing
CONSISTENCY_MODES = ("epoch", "batch")  # when a rank picks up a new generation
REVALIDATE_MODES = ("job", "never")  # or a number: seconds a listing stays fresh
ON_ERROR_MODES = ("raise", "skip")  # a sample whose object cannot be read or built
log = logging.getLogger("shardcache")


def _open_token(revalidate: str | float, job: str) -> str:
    """The listing token a new dataset sends (``listing.py``): one listing per
    job, none at all, or one no older than N seconds.

    >>> _open_token("job", "abc"), _open_token("never", "abc"), _open_token(600, "x")
    ('open/abc', '', 'max-age/600.0')
    """
    if revalidate == "job":
        return f"open/{job}"
    if revalidate == "never":
        return ""
    if (
        isinstance(revalidate, int | float)
        and not isinstance(revalidate, bool)
        and revalidate > 0
    ):
        return f"max-age/{float(revalidate)}"
    raise ConfigError(
        f"revalidate must be 'job', 'never' or a number of seconds > 0, got "
        f"{revalidate!r}."
    )


def default_name(urls: str | Sequence[str]) -> str:
    """A readable, stable dataset name derived from the URL(s).

    >>> default_name("s3://bucket/train/")
    'bucket-train-365e5c26'
    """
    first = urls if isinstance(urls, str) else "|".join(urls)
    stem = urls if isinstance(urls, str) else urls[0]
    words = (
        re.sub(r"[^A-Za-z0-9]+", "-", stem.split("://", 1)[-1]).strip("-")[:60]
        or "data"
    )
    return f"{words}-{hashlib.sha256(first.encode()).hexdigest()[:8]}"


def _is_tuple_sample(sample: Any) -> bool:
    """A dict whose fields are ``"(0)"``, ``"(1)"``...: a tuple a Dataset returned."""
    return (
        isinstance(sample, dict)
        and bool(sample)
        and all(
            isinstance(k, str) and k.startswith("(") and k.endswith(")") for k in sample
        )
    )


def _as_tuple(sample: Any) -> Any:
    if not _is_tuple_sample(sample):
        return sample
    return tuple(sample[f"({i})"] for i in range(len(sample)))


def _provisional_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The rank and world as far as known now, without raising: the sampler
    resolves (and validates) them at first use."""
    try:
        world = World.detect()
    except ConfigError:
        world = World()
    return (
        world.rank if rank is None else rank,
        world.world_size if world_size is None else world_size,
    )


def _source_summary(urls: str | Sequence[str]) -> str:
    """The source as error messages name it: never a whole URL list (millions
    of lines), never a presigned URL's query (its signature).

    >>> _source_summary(["s3://b/a.npy?X-Amz-Signature=s", "s3://b/c.npy"])
    's3://b/a.npy and 1 more'
    """
    first = urls if isinstance(urls, str) else (list(urls) or [""])[0]
    first = first.split("?", 1)[0]
    more = 0 if isinstance(urls, str) else len(urls) - 1
    return f"{first} and {more} more" if more else first


def _ray_inherited_by_fork() -> bool:
    """In a process that is not the one that built the dataset: is Ray's
    connection inherited (fork) rather than absent (spawn)?"""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _protocol(urls: str | Sequence[str], storage_options: dict[str, Any]) -> str:
    """The scheme of the source, validated (no listing)."""
    first = urls if isinstance(urls, str) else (list(urls) or [""])[0]
    if not isinstance(urls, str) and not list(urls):
        raise ConfigError(
            "urls is an empty list; pass a prefix, a glob or object URLs."
        )
    open_remote(first, storage_options)
    return first.split("://", 1)[0] if "://" in first else "file"


class DistributedCachedDataset(Dataset[Any]):
    """Every DDP rank reads a stable shard of a remote dataset from its node's cache.

    What to read:
        urls: an fsspec prefix, glob, or list of object URLs.
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
            (``SHARDCACHE_ENDPOINT``, see ``shardcache.endpoint``).
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
            shards, so each chunk is read once per epoch instead of in every
            batch (``docs/architecture.md``, "Shuffle blocks"). Defaults to
            ``None`` (the whole shard).
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

    Samples from ``ds[i]`` are torch tensors viewing the Ray object store
    without a copy; they are read-only. ``ds.loader(batch_size)`` yields
    collated batches gathered straight into one tensor per field.

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
    ):
        for label, fn in (
            ("preprocess", preprocess),
            ("target", target),
            ("transform", transform),
        ):
            if fn is not None and not callable(fn):
                raise ConfigError(
                    f"{label} must be callable or None, got {type(fn).__name__}."
                )
            check_picklable(fn, label)
        if on_error not in ON_ERROR_MODES:
            raise ConfigError(
                f"on_error must be one of {', '.join(map(repr, ON_ERROR_MODES))}, "
                f"got {on_error!r}."
            )
        self.on_error = on_error
        if consistency not in CONSISTENCY_MODES:
            raise ConfigError(
                f"consistency must be one of {', '.join(map(repr, CONSISTENCY_MODES))}, "
                f"got {consistency!r}."
            )
        for label, value in (
            ("chunk_bytes", chunk_bytes),
            ("chunk_samples", chunk_samples),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{label} must be an integer >= 1, got {value!r}.")
        self.consistency = consistency
        overrides = {
            k: v
            for k, v in {
                "redis_url": redis_url,
                "ray_address": ray_address,
                "namespace": namespace,
                "prefetch_batches": prefetch_batches,
                "allow_remote": allow_remote,
            }.items()
            if v is not None
        }
        try:
            self.config = ClientConfig(**overrides)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # Provisional until the sampler reads the world at first use (a
        # dataset may be built before the launcher or process group has
        # said where this process is); _use_world brings the final one.
        self.rank, self.world_size = _provisional_world(rank, world_size)
        self.name = (
            validate_name("name", name) if name is not None else default_name(urls)
        )
        self.urls, self.storage_options = urls, dict(storage_options or {})
        self.format = format or (
            None if source_dataset is not None else format_of(urls)
        )
        self.preprocess = preprocess or (as_arrays if self.format else raw_bytes)
        self.transform = transform
        self.target = target
        open_token = _open_token(revalidate, "")  # validated before any I/O
        self._job = resolve_job(job)
        self.job = self._job.id
        if open_token:
            open_token = _open_token(revalidate, self.job)
        self._spec = {
            "name": self.name,
            "urls": urls if isinstance(urls, str) else list(urls),
            "protocol": "dataset"
            if source_dataset is not None
            else _protocol(urls, self.storage_options),
            "storage_options": self.storage_options,
            "chunk_bytes": chunk_bytes,
            "chunk_samples": chunk_samples,
        }
        if self.format:
            self._spec.update(format=self.format, format_options=format_options or {})
        if source_dataset is not None:
            self._spec.update(
                format="dataset",
                source_object=source_dataset,
                source_version=source_version or "",
            )
        self._client = open_client(self.config)
        if source_dataset is not None and not self._client.needs_ray:
            raise ConfigError(
                "from_dataset ships the Dataset object to the cache workers through "
                "Ray, so it needs a process on a Ray node (Ray Train, or torchrun on "
                "the cache's Ray nodes); pods reading through the node-local endpoint "
                "or remotely can read packed files (format=) instead."
            )
        try:
            ref, self.digest = self._client.manifest(self._spec, open_token)
        except (RemoteFetchError, ShardUnavailable) as exc:
            if not open_token.startswith("open/"):
                raise
            # Same type, so callers' handlers still match; the message adds
            # the opt-out a job with an immutable (or huge) source may want.
            raise type(exc)(
                f"{exc} (a new job revalidates the listing of "
                f"{_source_summary(urls)!r}; pass revalidate='never' to start on "
                "the listing the cluster holds)"
            ) from exc
        self.manifest = self._map_manifest(ref)
        if self.format is None and preprocess is None and source_dataset is None:
            # One reading whether the objects came from a prefix, a glob or a
            # list: the listed files' extension picks the default preprocess.
            probe = [self.manifest.url(i) for i in range(min(64, len(self.manifest)))]
            self.preprocess = objects_preprocess(probe, urls) or raw_bytes
        self.fingerprint = dataset_fingerprint(self.preprocess, target, version)
        self._sampler = ShardSampler(
            self.manifest.layout.sizes(),
            rank,  # None: the sampler reads it at first use
            world_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            shuffle_block=shuffle_block or 0,
        )
        self._epoch_started: int | None = None
        self._sampler.bind(self._start_epoch, self._use_world)
        self.generation = self._register_in_index()
        self._refreshes = 0
        self._reset_process_state()

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
        from ray import cloudpickle

        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ConfigError(
                f"from_dataset needs a map-style Dataset with __getitem__ and __len__, "
                f"got {type(dataset).__name__}."
            )
        try:
            cloudpickle.dumps(dataset)
        except Exception as exc:  # whatever pickling raises names the culprit
            raise ConfigError(
                f"{type(dataset).__name__} cannot be pickled ({type(exc).__name__}: "
                f"{exc}), so it cannot be sent to the cache workers. Open files, "
                "sockets or database handles lazily inside __getitem__ instead of "
                "in __init__ (or drop them in __getstate__)."
            ) from exc
        return cls(
            f"dataset://{name}",
            kwargs.pop("preprocess", None) or as_arrays,
            name=name,
            chunk_samples=chunk_samples,
            source_dataset=dataset,
            source_version=version or fingerprint(dataset),
            **kwargs,
        )

    # -- setup --------------------------------------------------------------------
    def _map_manifest(self, ref: Any) -> Manifest:
        return self._client.map_manifest(ref)

    def _register_in_index(self) -> int:
        source = self.urls if isinstance(self.urls, str) else f"{len(self.urls)} urls"
        generation, previous = self._client.index.register_change(
            self.name,
            source,
            self.fingerprint,
            len(self.manifest),
            self.manifest.total_bytes,
        )
        if previous is not None:
            log_new_generation(
                self.name,
                previous,
                self.fingerprint,
                generation,
                self.manifest,
                {"preprocess": self.preprocess, "target": self.target},
            )
        return generation

    def _store_spec(self) -> dict[str, Any]:
        return {
            **self._spec,
            "fingerprint": self.fingerprint,
            "generation": self.generation,
            "manifest": self.digest,
            # The sampler's order is a pure function of these: a store plans
            # its eviction on it (``clairvoyant``).
            "order": {
                "rank": self._sampler.rank,
                "world_size": self._sampler.world_size,
                "seed": self._sampler.seed,
                "shuffle": "global"
                if self._sampler.mode == "global"
                else self._sampler.shuffle,
                "drop_last": self._sampler.drop_last,
                "epoch": self._sampler.epoch,
                "block": self._sampler.block,
            },
        }

    def _reset_process_state(self) -> None:
        old = getattr(self, "_reader", None)
        if old is not None and getattr(self, "_pid", None) == os.getpid():
            old.close()  # its prefetch pool; the world or the process changed
        self._epoch_reported = False
        self._pid = os.getpid()
        self._attached = False
        self._reader: ChunkReader | None = None
        self._snapshot_due = True
        self._waits = WaitRecorder()
        self._counts = {
            "hits": 0,
            "misses": 0,
            "remote_reads": 0,
            "bytes": 0,
            "samples": 0,
            "generation_switches": 0,
            "skipped": 0,
        }
        self._warned_skip = False
        self._consumed = 0
        self._cursor = 0
        self._batch_size = 0
        self._index_errors = 0
        self._usage = UsageReporter(
            lambda: self._client.index.client,
            self.config.namespace,
            self.name,
            self.job,
            self.rank,
            redis_url=self._client.redis_url if self.config.redis_url else "",
        )
        keep_flushed(self._usage)
        at_exit(self._final_report)

    @property
    def usage_reporter(self) -> UsageReporter:
        """What this process delivered, by origin; flushed to Redis off the loop."""
        return self._usage

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get the small description: never the mapped
        # manifest, chunks or threads. Each worker maps them again by digest.
        try:
            # Workers must deal this rank's shard, not guess the world on
            # their own (no process group there); unknowable yet is fine.
            self._sampler.rank  # noqa: B018 (resolves the world)
        except ConfigError:
            pass
        state = self.__dict__.copy()
        for k in ("_reader", "_client", "manifest", "_usage"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sampler.bind(self._start_epoch, self._use_world)
        self._client = open_client(self.config)
        self.manifest = None  # type: ignore[assignment]
        self._reset_process_state()

    def _attach(self) -> ChunkReader:
        if self._attached and self._pid == os.getpid() and self._reader is not None:
            return self._reader
        if self._pid != os.getpid():
            self._client = open_client(self.config)
            if self._client.needs_ray and _ray_inherited_by_fork():
                raise ConfigError(
                    "this DataLoader worker was forked from a process connected to "
                    "Ray, and Ray cannot be used after fork (its calls would hang). "
                    "Pass multiprocessing_context='spawn' (or 'forkserver') to the "
                    "DataLoader, or iterate ds.loader(batch_size) in the rank."
                )
            self._reset_process_state()
        self._client.install(self._store_spec(), self.preprocess, self.target)
        if self.manifest is None:
            self.manifest = self._map_manifest(
                self._client.manifest_of(self.name, self.digest)
            )
        self._reader = ChunkReader(
            self._client,
            self.name,
            self.manifest,
            self.digest,
            self.config.hold_bytes,
            self.config.request_timeout_s,
            self.config.verify_reads,
        )
        self._attached = True
        return self._reader

    # -- Dataset protocol -----------------------------------------------------------
    def __len__(self) -> int:
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
        self._sampler.set_epoch(epoch)  # calls _start_epoch back

    def _use_world(self, world: World) -> None:
        # The sampler read the world (at first use): rank-keyed reporting
        # follows it. Only ever before this process's first batch.
        if (world.rank, world.world_size) == (self.rank, self.world_size):
            return
        self.rank, self.world_size = world.rank, world.world_size
        if self._pid == os.getpid() and self._waits.batches == 0:
            self._reset_process_state()

    def _start_epoch(self, epoch: int, resuming: bool) -> None:
        if epoch == self._epoch_started and self._waits.batches == 0:
            return  # both set_epoch calls of one epoch, or a repeat: once
        self._epoch_started = epoch
        self._epoch_reported = False
        self._report_rank()
        self._sampler.order()  # computed now, not inside the first batch's wait
        self._snapshot_due = True
        if not resuming:
            self._consumed = 0
            self._cursor = 0
        self._waits.reset()
        if self._reader is not None and self._pid == os.getpid():
            self._reader.new_epoch()
        if self.consistency == "epoch" and self._pid == os.getpid():
            # The snapshot is one Redis read; taking it here keeps it out of
            # the first batch's wait (DataLoader workers take their own).
            self._current_generation()

    def __getitem__(self, idx: int) -> Any:
        return self.__getitems__([idx])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch as a list of zero-copy samples (DataLoader's collate stacks them).

        ``loader()`` is faster: it gathers straight into the batch tensor.
        """
        # The batch as asked for (before on_error="skip" stand-ins).
        self._sampler.audit(np.asarray(indices, dtype=np.int64))
        reader, chunks, chunk_ids, rows, idx, started = self._fetch(indices)
        samples = [
            reader.sample(chunks[c], r, i)
            for c, r, i in zip(
                chunk_ids.tolist(), rows.tolist(), idx.tolist(), strict=True
            )
        ]
        if samples and _is_tuple_sample(samples[0]):
            samples = [_as_tuple(s) for s in samples]
        if self.transform is not None:
            samples = [
                self._call_transform(i, s)
                for i, s in zip(idx.tolist(), samples, strict=True)
            ]
        self._finish_batch(reader, chunk_ids, idx, started)
        return samples

    def collated(self, indices: Sequence[int], pin_memory: bool = False) -> Any:
        """One collated batch of ``indices``: ``(B, ...)`` tensors gathered from
        the chunks in one copy (a dict of them for dict samples, ``(x, y)``
        with a target).

        Raises:
            CollateError: the samples differ in shape.
        """
        reader, chunks, chunk_ids, rows, idx, started = self._fetch(indices)
        if self.transform is None:
            batch = reader.collate(chunks, chunk_ids, rows, idx, pin_memory)
            if _is_tuple_sample(batch):
                batch = _as_tuple(batch)
        else:
            samples = [
                self._call_transform(i, _as_tuple(reader.sample(chunks[c], r, i)))
                for c, r, i in zip(
                    chunk_ids.tolist(), rows.tolist(), idx.tolist(), strict=True
                )
            ]
            batch = torch.utils.data.default_collate(samples)
        self._finish_batch(reader, chunk_ids, idx, started)
        return batch

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

    def _fetch(
        self, indices: Sequence[int]
    ) -> tuple[ChunkReader, dict[int, Any], np.ndarray, np.ndarray, np.ndarray, float]:
        started = time.perf_counter()
        reader = self._attach()
        idx = np.asarray(indices, dtype=np.int64)
        chunk_ids, rows = reader.locate(idx)
        for attempt in range(3):
            reader.use_generation(self._current_generation())
            try:
                chunks = reader.chunks_for(chunk_ids)
            except StaleVersionError:
                if attempt == 2:
                    raise
                # The snapshot expired on the stores: move to the newest
                # generation at this batch boundary, never within a batch.
                self._snapshot_due = True
                self._counts["generation_switches"] += 1
                continue
            if self.on_error == "skip":
                chunk_ids, rows, idx, skipped = reader.substitute_failed(
                    chunks, chunk_ids, rows, idx
                )
                if skipped:
                    self._note_skipped(skipped)
            return reader, chunks, chunk_ids, rows, idx, started
        raise AssertionError("unreachable")

    def _note_skipped(self, skipped: list[int]) -> None:
        self._counts["skipped"] += len(skipped)
        self._usage.skipped(len(skipped))
        if not self._warned_skip:
            self._warned_skip = True
            log.warning(
                "shardcache: dataset %s: skipping samples that could not be read "
                "or built (on_error='skip'), first %s; each is replaced by another "
                "sample of its batch and counted as skipped in stats()",
                self.name,
                ", ".join(repr(self.manifest.url(i)) for i in skipped[:3]),
            )

    def _finish_batch(
        self,
        reader: ChunkReader,
        chunk_ids: np.ndarray,
        idx: np.ndarray,
        started: float,
    ) -> None:
        delta = reader.count(chunk_ids, idx)
        self._counts["hits"] += delta["local"] + delta["peer"]
        self._counts["misses"] += delta["source"]
        self._counts["remote_reads"] += delta["source"]
        self._counts["bytes"] += (
            delta["local_bytes"] + delta["peer_bytes"] + delta["source_bytes"]
        )
        waited = time.perf_counter() - started
        self._waits.record(waited)
        for origin in ORIGINS:
            if delta[origin]:
                self._usage.served(origin, delta[origin], delta[f"{origin}_bytes"])
        self._usage.waited(waited, self._sampler.epoch)
        n = len(idx)
        self._counts["samples"] += n
        self._consumed += n
        self._batch_size = self._batch_size or n
        self._cursor += n
        if self.config.prefetch_batches:
            order = self._sampler.order()
            window = self.config.prefetch_batches * self._batch_size
            # The first batch asks for the whole rest of the epoch: a cold
            # epoch then keeps every core of the node's stores busy (the
            # reader stops early when the stores cannot cache what it asks).
            whole = self._waits.batches == 1 and not reader.saw_uncached
            span = len(order) if whole else window
            reader.prefetch(order[self._cursor : self._cursor + span])
        if (
            not self._epoch_reported
            and self._cursor >= len(self._sampler)
            and get_worker_info() is None  # a worker sees only part of it
        ):
            # The rank's share of the epoch is delivered: its numbers go out
            # now, not whenever the next epoch (or the exit) comes. Once.
            self._epoch_reported = True
            reader.submit(self._usage.flush)
            self._report_rank(in_background=True)
        elif self._waits.batches % RANK_REPORT_EVERY == 0:
            self._report_rank(in_background=True)

    def _call_transform(self, idx: int, sample: Any) -> Any:
        assert self.transform is not None
        try:
            return self.transform(sample)
        except Exception as exc:  # user code
            raise TransformError(
                f"transform {getattr(self.transform, '__qualname__', self.transform)!r} raised "
                f"{type(exc).__name__} on {self.manifest.url(idx)!r}: {exc}"
            ) from exc

    # -- generations --------------------------------------------------------------
    def _current_generation(self) -> int:
        if self.consistency == "epoch" and not self._snapshot_due:
            return self.generation
        self._snapshot_due = False
        try:
            generation = self._client.index.generation(self.name)
        except IndexUnavailable:
            # Redis down: keep serving what we hold under the last known
            # generation; counted so the outage is visible in stats().
            self._index_errors += 1
            generation = self.generation
        if generation <= 0:
            generation = self._register_in_index()
        self.generation = generation
        return generation

    # -- stats, state, invalidation ---------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """This rank's counters and wait percentiles, plus the dataset's cluster totals."""
        out: dict[str, Any] = {
            "rank": self.rank,
            "dataset": self.name,
            "job": self.job,
            "job_source": self._job.source,
            # The counters below are this process's; DataLoader workers count
            # (and report) their own: "job_totals" is every process of the job.
            "counts": "this process",
            "generation": self.generation,
            **self._counts,
            "batches": self._waits.batches,
            "index_errors": self._index_errors,
            "held_bytes": self._reader.held_bytes if self._reader is not None else 0,
            "served": dict(self._reader.counts) if self._reader is not None else {},
            "moved_on_resume": self._sampler.moved_on_resume,
            **self._waits.summary(),
        }
        total = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / total if total else 0.0
        try:
            reader = UsageReader(self._client.index.client, self.config.namespace)
            self._usage.flush()  # so job_totals include this process's last batch
            out["cluster"] = reader.totals(self.name).as_dict()
            out["job_totals"] = reader.job_totals(self.name, self.job).as_dict()
        except IndexUnavailable:
            out["cluster"] = out["job_totals"] = None
        return out

    def _report_rank(self, in_background: bool = False) -> None:
        if self._waits.batches == 0:
            return
        report = {
            **self._counts,
            **self._waits.summary(),
            "batches": self._waits.batches,
            "epoch": self._sampler.epoch,
            "generation": self.generation,
            "ts": time.time(),
        }
        if in_background and self._reader is not None:
            # The report is built here (the wait deque is not thread-safe to
            # read); only the Redis write leaves the training loop's path.
            self._reader.submit(self._write_rank_report, report)
        else:
            self._write_rank_report(report)

    def _write_rank_report(self, report: dict[str, Any]) -> None:
        try:
            self._client.index.record_rank(self.name, self.job, self.rank, report)
        except IndexUnavailable:
            self._index_errors += 1

    def invalidate(self) -> int:
        """Start a new generation now; the next batch re-fetches. Returns it."""
        self.generation = self._client.index.invalidate(self.name)
        self._snapshot_due = True
        return self.generation

    def refresh(self) -> list[str]:
        """Re-list the source (once for all ranks refreshing together); objects
        whose ETag changed are re-read, nothing else. Returns their URLs.

        Call it on every rank (e.g. before ``set_epoch``): a rank reads the
        version its own listing saw, so ranks that have not refreshed keep
        the version they listed, consistently, until they do.

        Raises:
            ConfigError: objects were added or removed (the shards would move).
        """
        # One token per refresh round of this job: the ranks refreshing
        # together share one listing.
        self._refreshes += 1
        token = f"{self.job}/{self._refreshes}/{self.digest}"
        ref, digest = self._client.manifest(self._spec, token)
        manifest = self._map_manifest(ref)
        old = self.manifest if self.manifest is not None else self._attach().manifest
        if isinstance(manifest, PackedManifest):
            return self._refresh_packed(old, manifest, digest)
        if not (
            np.array_equal(
                old.columns["name_offsets"], manifest.columns["name_offsets"]
            )
            and np.array_equal(old.columns["names"], manifest.columns["names"])
        ):
            raise ConfigError(
                f"the set of objects under {_source_summary(self.urls)!r} changed ({len(old)} -> "
                f"{len(manifest)}); build a new DistributedCachedDataset so every rank "
                "agrees on the shards."
            )
        changed = np.flatnonzero(old.hashes != manifest.hashes)
        self.manifest, self.digest = manifest, digest
        if self._reader is not None:
            stale_chunks = np.unique(self._reader.layout.chunk_of(changed))
            self._reader.set_manifest(manifest, digest)
            self._reader.drop_chunks(stale_chunks.tolist())
            self._client.install(self._store_spec(), self.preprocess, self.target)
        return [manifest.url(int(i)) for i in changed]

    def _refresh_packed(
        self, old: Any, manifest: PackedManifest, digest: str
    ) -> list[str]:
        if not np.array_equal(old.layout.starts, manifest.layout.starts):
            raise ConfigError(
                f"the samples under {_source_summary(self.urls)!r} changed in number or place "
                f"({len(old)} -> {len(manifest)}); build a new "
                "DistributedCachedDataset so every rank agrees on the shards."
            )
        stale = np.flatnonzero(
            old.chunk_versions(old.layout) != manifest.chunk_versions(manifest.layout)
        )
        self.manifest, self.digest = manifest, digest
        if self._reader is not None:
            self._reader.set_manifest(manifest, digest)
            self._reader.drop_chunks(stale.tolist())
            self._client.install(self._store_spec(), self.preprocess, self.target)
        return manifest.changed_files(old)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is: O(1) (epoch, seed, world, consumed count, node).

        ``consumed`` overrides the count seen by this process (pass it when
        DataLoader workers fetch, e.g. ``batches_done * batch_size``; or use
        torchdata's ``StatefulDataLoader``, whose state needs no count).
        Merge every rank's state (:meth:`merge_states`, :meth:`gather_state_dict`)
        to resume at another world size.
        """
        return {
            **self._sampler.state(),
            "consumed": self._consumed if consumed is None else int(consumed),
            "manifest": self.digest,
            "node": current_node(),
        }

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Every old rank's :meth:`state_dict` -> one state to resume at any world size.

        >>> # DistributedCachedDataset.merge_states([torch.load(f) for f in rank_files])
        """
        return merge_states(states)

    def gather_state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The merged state of every rank, on every rank (one ``all_gather_object``
        under torch.distributed): save it from rank 0.

        >>> # state = ds.gather_state_dict(); if rank == 0: torch.save(state, path)
        """
        return gather_states(self.state_dict(consumed))

    def load_state_dict(
        self,
        state: dict[str, Any] | Sequence[dict[str, Any]],
        nodes: Sequence[str] | None = None,
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

        Raises:
            ConfigError: the state belongs to another dataset, seed or mode, or
                one rank's state is given for another world size.
        """
        consumed = apply_state(
            self._sampler, state, self.digest, nodes, explain=self._listing_change
        )
        self._consumed = consumed
        self._cursor = consumed

    def _listing_change(self, saved: str) -> str:
        """What changed since listing ``saved`` (a resume across jobs after
        objects changed): the objects by name, not a digest."""
        try:
            old = self._map_manifest(self._client.manifest_of(self.name, saved))
        except StaleVersionError:
            return "the listing it was saved on is no longer held by the cluster"
        return f"{_source_summary(self.urls)}: {describe_changes(old, self.manifest)}"

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
        if not all(isinstance(v, int) and v >= 1 for v in (steps, batch_size)):
            raise ConfigError(
                f"steps and batch_size must be integers >= 1, got {steps!r}, "
                f"{batch_size!r}."
            )
        order = self._sampler.order()
        start = self._cursor or self._sampler.pending_skip
        reader = self._attach()
        reader.use_generation(self._current_generation())
        return warm_chunks(
            reader, order[start : start + steps * batch_size], progress=progress
        )

    def to_ray_dataset(self, **ray_args: Any) -> Any:
        """Every chunk as a ``ray.data.Dataset`` (``shardcache.ray_data.from_cached``)."""
        from shardcache.ray_data import from_cached  # imports Ray Data on first use

        return from_cached(self, **ray_args)

    def epoch_indices(self) -> Iterator[np.ndarray]:
        """The rest of this epoch's order (after a resume), for ``loader()``."""
        order = self._sampler.order()
        yield order[self._sampler.take_skip() :]

    def cached_locality(self) -> dict[str, int]:
        """How many of this rank's shard samples are cached on each node (from the index)."""
        layout = self.manifest.layout
        chunk_ids, counts = np.unique(
            layout.chunk_of(self._sampler.shard), return_counts=True
        )
        keys = [f"c{c}" for c in chunk_ids.tolist()]
        entries = self._client.index.entries(self.name, self.generation, keys)
        out: dict[str, int] = {}
        for key, n in zip(keys, counts.tolist(), strict=True):
            entry = entries.get(key)
            if entry is not None:
                owner = str(entry.get("owner"))
                out[owner] = out.get(owner, 0) + n
        return out

    def _final_report(self) -> None:
        """At process exit (``shardcache.flusher``): the last rank report;
        the usage counts are flushed right after."""
        if get_worker_info() is not None:
            # A DataLoader worker: its counts are flushed under the rank's
            # name, but the rank's report and its end are the rank's own.
            self._usage.owns_rank = False
            return
        if self._pid == os.getpid():
            self._report_rank()

    def close(self) -> None:
        """Report final stats and stop the prefetch threads.

        Never required for the numbers to be right: they are flushed every
        second and at process exit. ``with DistributedCachedDataset(...) as
        ds:`` calls it.
        """
        self._report_rank()
        if self._reader is not None:
            self._reader.close()
        self._usage.close()

    def __enter__(self) -> DistributedCachedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

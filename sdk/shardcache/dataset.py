"""DistributedCachedDataset: a map-style Dataset whose samples come from the cluster cache."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import Dataset

from shardcache.client import CacheClient
from shardcache.config import ClientConfig
from shardcache.decoders import raw_bytes
from shardcache.errors import (
    BackendError,
    ConfigError,
    IndexUnavailable,
    StaleVersionError,
    TransformError,
)
from shardcache.fingerprint import fingerprint
from shardcache.keys import validate_name
from shardcache.sampler import ShardSampler
from shardcache.source import Manifest, list_source
from shardcache.waits import WaitRecorder
from shardcache.world import World

__all__ = ["DistributedCachedDataset"]

RANK_REPORT_EVERY = 50  # batches between best-effort rank reports to Redis
CONSISTENCY_MODES = ("epoch", "batch")  # when a rank picks up a new generation
# Arrays from the Ray object store are read-only views of shared memory; torch
# warns about each one. The dataset documents the contract instead.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


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


def _nbytes(value: Any) -> int:
    if isinstance(value, dict):
        return sum(int(v.nbytes) for v in value.values())
    return int(value.nbytes)


def _to_tensor(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: torch.from_numpy(v) for k, v in value.items()}
    return torch.from_numpy(value)


class DistributedCachedDataset(Dataset[Any]):
    """Every DDP rank reads a stable shard of a remote dataset from its node's cache.

    What to read:
        urls: an fsspec prefix, glob, or list of object URLs.
        preprocess: deterministic ``bytes -> array | tensor | dict`` run once per
            object on the cluster. Its fingerprint versions the cache.
            Defaults to the raw bytes as uint8.
        transform: per-sample augmentation on the rank, after the cache.
        storage_options: passed to fsspec (e.g. an S3 endpoint).
        name: dataset namespace in the index. Defaults to one derived from ``urls``.
        target: ``url -> label``; when set, samples are ``(x, target(url))`` pairs
            (labels often live in the object's path, as with ImageFolder).

    Where the cache is:
        redis_url, ray_address: ``None`` uses the embedded local defaults.
        namespace: deployment namespace. Defaults to ``SHARDCACHE_NAMESPACE`` or "default".

    How ranks split it:
        rank, world_size: default from torch.distributed, else RANK/WORLD_SIZE, else 0/1.
        shuffle: ``True`` (stable shard, reshuffled inside each epoch),
            ``"global"`` (DistributedSampler's global permutation) or ``False``.
        seed, drop_last: as for DistributedSampler.
        prefetch_batches: batches whose references are resolved ahead.
        consistency: ``"epoch"`` (the default) reads the generation once at
            ``set_epoch``, so an invalidation from elsewhere mid-epoch takes
            effect at the next epoch and the rank finishes on the bytes it
            started with (the stores keep the old values for
            ``retire_grace_s``). ``"batch"`` re-reads it before every batch,
            so the next batch after an invalidation already sees the new data.
            Either way a batch is never a mix of generations, and this
            dataset's own ``invalidate()`` applies from the next batch.

    Samples are torch tensors viewing the Ray object store without a copy.
    They are read-only: a transform that writes in place must ``.clone()`` first.

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
        seed: int = 0,
        drop_last: bool = False,
        name: str | None = None,
        namespace: str | None = None,
        prefetch_batches: int | None = None,
        job: str | None = None,
        target: Callable[[str], Any] | None = None,
        consistency: str = "epoch",
    ):
        if preprocess is not None and not callable(preprocess):
            raise ConfigError(
                f"preprocess must be callable or None, got {type(preprocess).__name__}."
            )
        if target is not None and not callable(target):
            raise ConfigError(
                f"target must be callable or None, got {type(target).__name__}."
            )
        if transform is not None and not callable(transform):
            raise ConfigError(
                f"transform must be callable or None, got {type(transform).__name__}."
            )
        if consistency not in CONSISTENCY_MODES:
            raise ConfigError(
                f"consistency must be one of {', '.join(map(repr, CONSISTENCY_MODES))}, "
                f"got {consistency!r}."
            )
        self.consistency = consistency
        overrides = {
            k: v
            for k, v in {
                "redis_url": redis_url,
                "ray_address": ray_address,
                "namespace": namespace,
                "prefetch_batches": prefetch_batches,
            }.items()
            if v is not None
        }
        try:
            self.config = ClientConfig(**overrides)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        world = World.detect()
        self.rank = world.rank if rank is None else rank
        self.world_size = world.world_size if world_size is None else world_size
        self.name = (
            validate_name("name", name) if name is not None else default_name(urls)
        )
        self.urls, self.storage_options = urls, dict(storage_options or {})
        self.preprocess = preprocess or raw_bytes
        self.transform = transform
        self.target = target
        self.job = (
            job
            or os.environ.get("TORCHELASTIC_RUN_ID")
            or os.environ.get("SHARDCACHE_JOB")
            or "job"
        )
        self.manifest: Manifest = list_source(urls, self.storage_options)
        self._sampler = ShardSampler(
            [o.url for o in self.manifest.objects],
            self.rank,
            self.world_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.fingerprint = fingerprint(self.preprocess)
        self._client = CacheClient(self.config)
        self.generation = self._register_in_index()
        self._reset_process_state()

    # -- setup --------------------------------------------------------------------
    def _register_in_index(self) -> int:
        index = self._client.index
        total = sum(o.size for o in self.manifest.objects)
        source = self.urls if isinstance(self.urls, str) else f"{len(self.urls)} urls"
        generation = index.register(
            self.name, source, self.fingerprint, len(self.manifest), total
        )
        # A changed ETag invalidates exactly the changed objects.
        index.invalidate_changed(
            self.name, generation, {o.url: o.etag for o in self.manifest.objects}
        )
        return generation

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._attached = False
        self._refs: dict[int, Any] = {}
        self._values: dict[int, Any] = {}
        self._held_bytes = 0
        self._transient: set[int] = set()
        self._refs_generation = -1
        self._snapshot_due = True
        self._pending: dict[int, Future[None]] = {}
        self._prefetcher: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._waits = WaitRecorder()
        self._counts = {
            "hits": 0,
            "misses": 0,
            "remote_reads": 0,
            "bytes": 0,
            "samples": 0,
            "generation_switches": 0,
        }
        self._consumed = 0
        self._cursor = 0
        self._batch_size = 0
        self._index_errors = 0

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get the small description, never the refs or locks:
        # each worker attaches lazily and the cache itself is not copied.
        state = self.__dict__.copy()
        for k in (
            "_refs",
            "_values",
            "_transient",
            "_pending",
            "_prefetcher",
            "_lock",
            "_client",
        ):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = CacheClient(self.config)
        self._reset_process_state()

    def _attach(self) -> None:
        if self._attached and self._pid == os.getpid():
            return
        if self._pid != os.getpid():
            self._client = CacheClient(self.config)
            self._reset_process_state()
        spec = {
            "name": self.name,
            "protocol": self.manifest.protocol,
            "storage_options": self.storage_options,
            "fingerprint": self.fingerprint,
            "generation": self.generation,
        }
        self._client.register(spec, self.preprocess)
        self._attached = True

    # -- Dataset protocol -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self.manifest)

    @property
    def sampler(self) -> ShardSampler:
        """Use as ``DataLoader(ds, sampler=ds.sampler)``; ``len`` is this rank's share."""
        return self._sampler

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: reshuffle this rank's order and report last epoch's waits."""
        self._report_rank()
        self._sampler.set_epoch(epoch)
        self._sampler.order()  # computed now, not inside the first batch's wait
        self._snapshot_due = True
        self._consumed = 0
        self._cursor = 0
        self._waits.reset()
        if self.consistency == "epoch" and self._pid == os.getpid():
            # The snapshot is one Redis read; taking it here keeps it out of
            # the first batch's wait (DataLoader workers take their own).
            self._current_generation()

    def __getitem__(self, idx: int) -> Any:
        return self.__getitems__([idx])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Fetch a whole batch: one store call for its misses, one ``ray.get``."""
        started = time.perf_counter()
        self._attach()
        indices = [int(i) for i in indices]
        for attempt in range(3):
            generation = self._current_generation()
            try:
                todo = [i for i in indices if i not in self._values]
                got = dict(zip(todo, self._fetch_values(todo, generation), strict=True))
                break
            except StaleVersionError:
                if attempt == 2:
                    raise
                # The snapshot expired on the stores: move to the newest
                # generation at this batch boundary, never within a batch.
                self._snapshot_due = True
                self._counts["generation_switches"] += 1
        held_hits = [i for i in indices if i not in got] if got else indices
        if held_hits:  # values held since an earlier batch: no Ray call at all
            objs = self.manifest.objects
            self._counts["hits"] += len(held_hits)
            self._counts["bytes"] += sum(objs[i].size for i in held_hits)
        held = self._values
        if self.transform is None and self.target is None:
            samples = [got[i] if i in got else held[i] for i in indices]
        else:
            samples = [
                self._apply_transform(i, got[i] if i in got else held[i])
                for i in indices
            ]
        self._waits.record(time.perf_counter() - started)
        self._counts["samples"] += len(indices)
        self._consumed += len(indices)
        self._batch_size = self._batch_size or len(indices)
        self._cursor += len(indices)
        self._schedule_prefetch()
        if self._waits.batches % RANK_REPORT_EVERY == 0:
            self._report_rank(in_background=True)
        return samples

    def _apply_transform(self, idx: int, sample: Any) -> Any:
        if self.transform is not None:
            sample = self._call_transform(idx, sample)
        if self.target is not None:
            return sample, self.target(self.manifest.objects[idx].url)
        return sample

    def _call_transform(self, idx: int, sample: Any) -> Any:
        assert self.transform is not None
        try:
            return self.transform(sample)
        except Exception as exc:  # user code
            raise TransformError(
                f"transform {getattr(self.transform, '__qualname__', self.transform)!r} raised "
                f"{type(exc).__name__} on {self.manifest.objects[idx].url!r}: {exc}"
            ) from exc

    # -- references ---------------------------------------------------------------
    def _current_generation(self) -> int:
        if (
            self.consistency == "epoch"
            and not self._snapshot_due
            and self._refs_generation > 0
        ):
            return self._refs_generation
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
        if generation != self._refs_generation:
            with self._lock:
                self._refs.clear()
                self._values.clear()
                self._held_bytes = 0
                self._transient.clear()
                self._refs_generation = generation
        self.generation = generation
        return generation

    def _fetch_values(self, indices: list[int], generation: int) -> list[Any]:
        """Resolve and ``ray.get`` what this rank does not hold yet, as tensors.

        Values the store cached are kept as zero-copy tensors for the rest of
        the generation, so a warm batch costs neither an actor call nor a
        ``ray.get`` nor a ``torch.from_numpy``; values the store did not cache
        (budget full) are used once and dropped, so the store's eviction
        policy stays in charge.
        """
        import ray

        if not indices:
            return []
        self._ensure_refs(indices, generation)
        arrays = ray.get(
            [self._refs[i] for i in indices], timeout=self.config.request_timeout_s
        )
        values = [_to_tensor(a) for a in arrays]
        with self._lock:
            if generation == self._refs_generation:
                for i, a, v in zip(indices, arrays, values, strict=True):
                    nbytes = _nbytes(a)
                    if (
                        i in self._transient
                        or self._held_bytes + nbytes > self.config.hold_bytes
                    ):
                        self._transient.discard(i)
                    else:
                        self._values[i] = v
                        self._held_bytes += nbytes
                    self._refs.pop(i, None)
        return values

    def _ensure_refs(self, indices: Sequence[int], generation: int) -> None:
        waiting = [
            self._pending[i]
            for i in indices
            if i not in self._refs and i in self._pending
        ]
        for fut in waiting:
            fut.result()
        # Every reference still in _refs is unread (read ones are popped in
        # _fetch_values) and was counted when _resolve stored it.
        missing = sorted({i for i in indices if i not in self._refs})
        if missing:
            self._resolve(missing, generation)

    def _resolve(self, indices: list[int], generation: int) -> None:
        objs = self.manifest.objects
        results = self._client.get_refs(
            self.name,
            generation,
            [(objs[i].url, objs[i].etag, objs[i].size) for i in indices],
        )
        with self._lock:
            if generation != self._refs_generation:
                return
            for i, (status, ref) in zip(indices, results, strict=False):
                self._refs[i] = ref
                if status == "uncached":
                    self._transient.add(i)
                if status in ("fetched", "uncached"):
                    self._counts["misses"] += 1
                    self._counts["remote_reads"] += 1
                else:
                    self._counts["hits"] += 1
                self._counts["bytes"] += objs[i].size

    def _schedule_prefetch(self) -> None:
        """Resolve the references of the next batches in the background."""
        if not self.config.prefetch_batches or not self._batch_size:
            return
        order = self._sampler.order()
        window = order[
            self._cursor : self._cursor
            + self.config.prefetch_batches * self._batch_size
        ].tolist()  # python ints: numpy scalars cost ~0.4 us each to look up
        held, refs, pending = self._values, self._refs, self._pending
        todo = [
            i for i in window if i not in held and i not in refs and i not in pending
        ]
        if not todo:
            return
        generation = self._refs_generation
        fut = self._background().submit(self._prefetch, todo, generation)
        for i in todo:
            self._pending[i] = fut

    def _background(self) -> ThreadPoolExecutor:
        """The one thread that prefetches and reports, off the training loop."""
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(
                1, thread_name_prefix="shardcache-prefetch"
            )
        return self._prefetcher

    def _prefetch(self, indices: list[int], generation: int) -> None:
        import ray

        try:
            self._resolve(indices, generation)
            refs = [self._refs[i] for i in indices if i in self._refs]
            # Start pulling remote objects to this node now (global shuffle).
            ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
        except (BackendError, StaleVersionError):
            pass  # the foreground path retries and raises with full context
        finally:
            for i in indices:
                self._pending.pop(i, None)

    # -- stats, state, invalidation ---------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """This rank's counters and wait percentiles, plus the dataset's cluster totals."""
        out: dict[str, Any] = {
            "rank": self.rank,
            "dataset": self.name,
            "generation": self.generation,
            **self._counts,
            "batches": self._waits.batches,
            "index_errors": self._index_errors,
            **self._waits.summary(),
        }
        total = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / total if total else 0.0
        try:
            cluster = self._client.index.stats(self.name)
            out["cluster"] = {
                "hits": cluster.hits,
                "misses": cluster.misses,
                "remote_reads": cluster.remote_reads,
                "hit_rate": cluster.hit_rate,
            }
        except IndexUnavailable:
            out["cluster"] = None
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
        if in_background:
            # The report is built here (the wait deque is not thread-safe to
            # read); only the Redis write leaves the training loop's path.
            self._background().submit(self._write_rank_report, report)
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
        """Re-list the source; objects whose ETag changed are re-fetched. Returns them.

        Call it on every rank (e.g. before ``set_epoch``): a rank reads the
        version its own listing saw, so ranks that have not refreshed keep
        the version they listed, consistently, until they do.
        """
        manifest = list_source(self.urls, self.storage_options)
        if [o.url for o in manifest.objects] != [o.url for o in self.manifest.objects]:
            raise ConfigError(
                f"the set of objects under {self.urls!r} changed ({len(self.manifest)} -> "
                f"{len(manifest)}); build a new DistributedCachedDataset so every rank "
                "agrees on the shards."
            )
        stale = {
            i
            for i, (old, new) in enumerate(
                zip(self.manifest.objects, manifest.objects, strict=False)
            )
            if old.etag != new.etag
        }
        self.manifest = manifest
        with self._lock:
            for i in stale:
                self._refs.pop(i, None)
                self._values.pop(i, None)
        return self._client.index.invalidate_changed(
            self.name, self.generation, {o.url: o.etag for o in manifest.objects}
        )

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is; ``consumed`` overrides the count seen by this process
        (pass it when DataLoader workers fetch, e.g. ``batches_done * batch_size``)."""
        return {
            "epoch": self._sampler.epoch,
            "consumed": self._consumed if consumed is None else int(consumed),
            "manifest": self.manifest.digest,
            **self._sampler.state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration yields exactly the unseen samples.

        Raises:
            ConfigError: the state belongs to another dataset, rank or world size.
        """
        mine = self._sampler.state()
        for key in ("seed", "rank", "world_size", "mode"):
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"state_dict has {key}={state.get(key)!r} but this dataset has "
                    f"{mine[key]!r}; resume with the same settings."
                )
        if state.get("manifest") != self.manifest.digest:
            raise ConfigError(
                "state_dict was saved for a different listing of the source; "
                "the objects changed, so the shards would not match."
            )
        self._sampler.resume(int(state["epoch"]), int(state["consumed"]))
        self._consumed = int(state["consumed"])
        self._cursor = int(state["consumed"])

    def cached_locality(self) -> dict[str, int]:
        """How many of this rank's shard objects are cached on each node (from the index)."""
        urls = {self.manifest.objects[int(i)].url for i in self._sampler.shard}
        entries = self._client.index.entries(self.name, self.generation, urls)
        out: dict[str, int] = {}
        for e in entries.values():
            out[str(e.get("owner"))] = out.get(str(e.get("owner")), 0) + 1
        return out

    def close(self) -> None:
        """Report final stats and stop the prefetch thread."""
        self._report_rank()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None

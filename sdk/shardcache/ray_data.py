"""Ray Data over the cache: a ``ray.data.Dataset`` whose blocks are the cached chunks.

``read(url, preprocess=...)`` (or ``from_cached(ds)`` for a ``DistributedCachedDataset``)
lists the source once, as the SDK does, and returns a lazy Dataset with one
read task, and one block, per chunk. Each time the Dataset is executed (every
epoch of ``iter_batches``, every epoch of a ``TorchTrainer`` worker's
``get_dataset_shard``) the read tasks are planned again and the dataset's
generation is read once for them: the SDK's ``consistency="epoch"`` snapshot.

Where reads run: a chunk's read task is pinned (soft node affinity) to the
node whose store holds it (its owner in the index), or, for a chunk nobody
holds yet, to node ``chunk % nodes``; the store on that node builds it on a
miss, so the next epoch, and the next job, read it on the same node. A read
task asks its own node's store: a hit is a zero-copy view of that node's
object store, turned into an Arrow block over the same buffers; Ray Data then
stores the block on that node (one copy per chunk and epoch), so
``streaming_split``'s locality hints (Ray Train's ``get_dataset_shard``) hand
it to the worker on that node. Misses are claimed in Redis like the SDK's, so
each object is read from the source once per cluster.

Columns: a sample that is one array is column ``"data"`` (Ray Data's
``from_numpy`` convention); a dict sample gives one column per key; a
``target=`` adds ``"target"``. Usage (local, peer and source samples) is
reported to the dashboard under the dataset's job, one row per node share.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from ray.data import Datasource, ReadTask
from ray.data.block import BlockAccessor, BlockMetadata
from ray.util.annotations import RayDeprecationWarning

from shardcache import errors
from shardcache.checksum import check_resolved
from shardcache.chunks import PLAIN_FIELD, Chunk
from shardcache.config import ClientConfig
from shardcache.errors import ConfigError, StaleVersionError
from shardcache.flusher import keep_flushed
from shardcache.manifest import ChunkItem
from shardcache.transport.base import Status
from shardcache.transport.direct import CacheClient
from shardcache.usage import UsageReporter

if TYPE_CHECKING:
    import ray.data

    from shardcache.dataset import DistributedCachedDataset

__all__ = ["CacheDatasource", "from_cached", "read"]

DATA_COLUMN = "data"  # a sample that is one array (Ray Data's from_numpy name)
TARGET_COLUMN = "target"  # the target= label of each sample
STALE_RETRIES = 3  # generation switches one read task makes before raising
# DistributedCachedDataset arguments that decide how DDP ranks split and
# batch samples: Ray Data splits and batches (streaming_split, iter_batches).
_RANK_ONLY = (
    "rank",
    "world_size",
    "shuffle",
    "shuffle_block",
    "seed",
    "drop_last",
    "prefetch_batches",
    "transform",
    "consistency",
)
log = logging.getLogger("shardcache")


@dataclass(frozen=True)
class _ReadPlan:
    """What every read task of one Dataset shares: small, pickled into each.

    The dataset's spec (its URLs may be a long list), preprocess and target
    travel once, as ``spec_ref`` in the object store.
    """

    name: str
    job: str
    digest: str
    config: ClientConfig
    spec_ref: Any  # ObjectRef of (spec, preprocess, target)
    items: tuple[ChunkItem, ...]  # per chunk: (key, version, source bytes)
    rows: tuple[int, ...]  # per chunk: samples
    on_error: str
    source: str  # for registering again when the index lost the dataset
    fingerprint: str
    objects: int
    total_bytes: int

    def snapshot(self) -> int:
        """The generation one execution (one epoch) reads: one Redis read."""
        index = _process_client(self.config).index
        generation = index.generation(self.name)
        if generation <= 0:  # the index lost the dataset (flushed): register again
            generation, _ = index.register_change(
                self.name, self.source, self.fingerprint, self.objects, self.total_bytes
            )
        return generation


class CacheDatasource(Datasource):
    """A share of the cached chunks as a Ray Data datasource: one read task per chunk.

    Build it with :func:`read` or :func:`from_cached`, which give each node
    its share; ``ray.data.read_datasource(CacheDatasource(...))`` works too.

    Args:
        plan: the dataset's read plan (:func:`from_cached` makes it).
        chunks: the chunk numbers this source reads.
        share: this share's number, the "rank" its usage is reported under.
    """

    def __init__(self, plan: _ReadPlan, chunks: Sequence[int], share: int = 0):
        super().__init__()
        self._plan = plan
        self._chunks = [int(c) for c in chunks]
        self._share = share

    def get_name(self) -> str:
        return "ShardCache"

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(self._plan.items[c][2] for c in self._chunks)

    def get_read_tasks(
        self,
        parallelism: int,
        per_task_row_limit: int | None = None,
        data_context: Any = None,
    ) -> list[ReadTask]:
        """One task per chunk (``parallelism`` is ignored: a chunk is the unit
        of caching), all at the generation read now."""
        generation = self._plan.snapshot()
        return [
            ReadTask(
                functools.partial(_read_chunk, self._plan, generation, c, self._share),
                BlockMetadata(
                    num_rows=self._plan.rows[c],
                    size_bytes=int(self._plan.items[c][2]),
                    input_files=None,
                    exec_stats=None,
                ),
                per_task_row_limit=per_task_row_limit,
            )
            for c in self._chunks
        ]


def read(
    urls: str | Sequence[str],
    preprocess: Callable[[bytes], Any] | None = None,
    *,
    num_cpus: float | None = None,
    concurrency: int | None = None,
    **dataset_kwargs: Any,
) -> ray.data.Dataset:
    """A Ray Dataset of ``urls`` read through the cache.

    Takes ``DistributedCachedDataset``'s arguments for what to read and
    where the cache is (``storage_options``, ``name``, ``target``,
    ``format``, ``redis_url``, ``namespace``, ``job``, ``revalidate``,
    ``on_error``, ...), not the ones for splitting over ranks: Ray Data
    splits, shuffles and batches. ``num_cpus`` and ``concurrency`` are Ray
    Data's, for the read tasks of each node (``num_cpus`` defaults to 1).

    Like a new ``DistributedCachedDataset``, each call is a job: it
    revalidates the listing once (objects whose ETag changed are read
    again, nothing else) and reports usage under its own job id.

    Raises:
        ConfigError: a rank-splitting argument was given, or a bad argument
            (as ``DistributedCachedDataset`` raises it).
        EmptyDatasetError, SourceNotFound, IndexUnavailable: as the SDK.

    >>> # ds = shardcache.ray_data.read("s3://bucket/train/", preprocess=decode)
    >>> # ds.map_batches(augment).iter_torch_batches(batch_size=64)
    """
    from shardcache.dataset import DistributedCachedDataset

    given = sorted(k for k in _RANK_ONLY if k in dataset_kwargs)
    if given:
        raise ConfigError(
            f"shardcache.ray_data.read does not take {', '.join(given)}: Ray Data "
            "splits, shuffles and batches the Dataset (streaming_split, "
            "random_shuffle, iter_batches, map_batches). Drop them, or use "
            "DistributedCachedDataset for per-rank shards."
        )
    ds = DistributedCachedDataset(
        urls, preprocess, rank=0, world_size=1, shuffle=False, **dataset_kwargs
    )
    return from_cached(ds, num_cpus=num_cpus, concurrency=concurrency)


def from_cached(
    ds: DistributedCachedDataset,
    *,
    num_cpus: float | None = None,
    concurrency: int | None = None,
) -> ray.data.Dataset:
    """Every chunk of ``ds`` (not one rank's shard) as a Ray Dataset; what
    ``from_cached(ds)`` returns. Arguments as for :func:`read`.

    Raises:
        ConfigError: ``ds`` reads through a node-local endpoint or a remote
            cache worker (no Ray here), or ``num_cpus`` < 0.
    """
    import ray

    if not ds._session.client.needs_ray:
        raise ConfigError(
            "from_cached needs a process on the cache's Ray cluster (the driver "
            "of a Ray job, a Ray Train worker); this one reads through the "
            "node-local endpoint or a remote cache worker."
        )
    if num_cpus is not None and num_cpus < 0:
        raise ConfigError(f"num_cpus must be >= 0, got {num_cpus!r}.")
    plan = _plan_of(ds)
    parts = []
    for share, (node, chunks) in enumerate(_place(plan, ds.generation)):
        if not chunks:
            continue
        args = {}
        if node is not None:
            args["scheduling_strategy"] = (
                ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node, soft=True
                )
            )
        with warnings.catch_warnings():
            # Ray 2.60 deprecates ray_remote_args for named parameters, but
            # names none for a scheduling strategy: this is still the way.
            warnings.simplefilter("ignore", RayDeprecationWarning)
            parts.append(
                ray.data.read_datasource(
                    CacheDatasource(plan, chunks, share),
                    num_cpus=num_cpus,
                    concurrency=concurrency,
                    ray_remote_args=args,
                )
            )
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


def _plan_of(ds: DistributedCachedDataset) -> _ReadPlan:
    """The read plan of ``ds``: its store spec and chunk items, put once."""
    import ray

    ds.sampler.wait_whole()  # a listing still being listed: all of it
    manifest = ds.manifest
    layout = manifest.layout
    spec = {k: v for k, v in ds._session.store_spec().items() if k != "order"}
    config = ds.config.model_copy(update={"redis_url": ds._session.client.redis_url})
    urls = ds.urls if isinstance(ds.urls, str) else f"{len(ds.urls)} urls"
    return _ReadPlan(
        name=ds.name,
        job=ds.job,
        digest=ds.digest,
        config=config,
        spec_ref=ray.put((spec, ds.preprocess, ds.target)),
        items=tuple(manifest.chunk_items(range(len(layout)))),
        rows=tuple(layout.sizes().tolist()),
        on_error=ds.on_error,
        source=urls,
        fingerprint=ds.fingerprint,
        objects=len(manifest),
        total_bytes=manifest.total_bytes,
    )


def _place(plan: _ReadPlan, generation: int) -> list[tuple[str | None, list[int]]]:
    """``(node, chunks)`` per node that can run read tasks: a chunk goes to
    the node whose store holds it, else to node ``chunk % nodes``, so a chunk
    is built, and read again in later epochs and jobs, on one node."""
    import ray

    nodes = sorted(
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0
    )
    if len(nodes) <= 1:
        return [(None, list(range(len(plan.items))))]
    index = _process_client(plan.config).index
    entries = index.entries(plan.name, generation, [item[0] for item in plan.items])
    shares: dict[str, list[int]] = {node: [] for node in nodes}
    for c, item in enumerate(plan.items):
        owner = str(entries.get(item[0], {}).get("owner", "")).split("/", 1)[0]
        shares[owner if owner in shares else nodes[c % len(nodes)]].append(c)
    return list(shares.items())


# -- in the read task (a Ray worker on the chunk's node) ----------------------------
_lock = threading.Lock()
_clients: dict[tuple[str, str], CacheClient] = {}
_registered: set[tuple[str, str, int]] = set()
_reporters: dict[tuple[str, str, str, int], UsageReporter] = {}


def _process_client(config: ClientConfig) -> CacheClient:
    """One client per process and cache (read tasks reuse their worker)."""
    key = (str(config.redis_url), config.namespace)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = CacheClient(config)
        return client


def _reporter(plan: _ReadPlan, share: int, client: CacheClient) -> UsageReporter:
    key = (plan.config.namespace, plan.name, plan.job, share)
    with _lock:
        reporter = _reporters.get(key)
        if reporter is None:
            reporter = _reporters[key] = UsageReporter(
                lambda: client.index.client,
                plan.config.namespace,
                plan.name,
                plan.job,
                share,
                redis_url=client.redis_url,
            )
            keep_flushed(reporter)
        return reporter


def _register(client: CacheClient, plan: _ReadPlan, generation: int) -> None:
    """Hand the dataset to this node's store, once per process and generation."""
    import ray

    key = (plan.name, plan.digest, generation)
    if key in _registered:
        return
    spec, preprocess, target = ray.get(plan.spec_ref)
    client.install({**spec, "generation": generation}, preprocess, target)
    _registered.add(key)


def _read_chunk(plan: _ReadPlan, generation: int, c: int, share: int) -> list[Any]:
    """Chunk ``c`` as one Arrow block, through this node's store."""
    client = _process_client(plan.config)
    item = plan.items[c]
    for attempt in range(STALE_RETRIES):
        _register(client, plan, generation)
        try:
            results = client.resolve(plan.name, generation, [item], plan.digest)
            break
        except StaleVersionError:
            if attempt == STALE_RETRIES - 1:
                raise
            # Invalidated since this epoch's snapshot and no longer served:
            # this chunk moves to the newest generation, never a part of it.
            generation = client.index.generation(plan.name)
    results = check_resolved(
        client, plan.name, generation, plan.digest, [item], results,
        plan.config.verify_reads,
    )  # fmt: skip
    status, columns = results[0]
    chunk = Chunk(columns)
    rows = _good_rows(chunk, plan, c)
    reporter = _reporter(plan, share, client)
    # The job's record (`shardcache stats --job`, the dashboard's Jobs table):
    # what this block was read from, as a rank records it.
    reporter.reading(plan.digest, generation)
    _count(reporter, status, chunk, rows, item[2])
    reporter.flush()  # one round trip per chunk: the epoch's numbers are whole at its end
    return [_to_block(chunk, rows)]


def _good_rows(chunk: Chunk, plan: _ReadPlan, c: int) -> np.ndarray | None:
    """The rows to serve (``None``: all). A failed row raises its own error
    class, or with ``on_error="skip"`` is left out of the block."""
    if not chunk.has_failures:
        return None
    if plan.on_error != "skip":
        row = int(np.flatnonzero(chunk.failed)[0])
        kind, message = chunk.error(row) or ("RemoteFetchError", "")
        raise errors.error_type(kind, errors.RemoteFetchError)(
            f"dataset {plan.name!r} chunk {c} row {row} could not be built: {message}",
        )
    return np.flatnonzero(~chunk.failed)


def _count(
    reporter: UsageReporter,
    status: str,
    chunk: Chunk,
    rows: np.ndarray | None,
    source_bytes: int,
) -> None:
    """Samples served from ``status``'s origin; a partial rebuild counts only
    the rows it read as source (bytes split by row count: the task has no
    per-row sizes)."""
    n = len(chunk) if rows is None else len(rows)
    if rows is not None:
        reporter.skipped(len(chunk) - n)
        source_bytes = source_bytes * n // max(len(chunk), 1)
    origin = Status(status).origin
    if origin == "source" and chunk.sourced is not None:
        fresh = chunk.sourced if rows is None else chunk.sourced[rows]
        n_src = int(np.count_nonzero(fresh))
        b_src = source_bytes * n_src // max(n, 1)
        reporter.served("source", n_src, b_src)
        reporter.served("local", n - n_src, source_bytes - b_src)
        return
    reporter.served(origin, n, source_bytes)


def _to_block(chunk: Chunk, rows: np.ndarray | None) -> Any:
    """The chunk's columns as an Arrow block: stacked fields over the same
    buffers (no copy); ragged fields as one array per row (a Python step per
    sample, ~1 us, for variable-shaped samples only)."""
    batch: dict[str, Any] = {}
    picked = np.arange(len(chunk)) if rows is None else rows
    for field in chunk.fields:
        name = DATA_COLUMN if field == PLAIN_FIELD else field
        stacked = chunk.stacked.get(field)
        if stacked is not None:
            batch[name] = stacked if rows is None else stacked[rows]
            continue
        column = np.empty(len(picked), dtype=object)
        for j, r in enumerate(picked.tolist()):
            column[j] = chunk.field(field, r)
        batch[name] = column
    if chunk.targets is not None:
        batch[TARGET_COLUMN] = chunk.targets if rows is None else chunk.targets[rows]
    return BlockAccessor.batch_to_block(batch)

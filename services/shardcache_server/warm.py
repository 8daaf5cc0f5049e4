"""``shardcache warm``: build every chunk once, spread over the node stores; or,
with ``steps``, exactly the chunks of every rank's first steps, each on the
node its rank will run on."""

from __future__ import annotations

import importlib
import time
import uuid
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

from shardcache.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_SAMPLES
from shardcache.config import ClientConfig
from shardcache.decoders import as_arrays, raw_bytes
from shardcache.embedded import attach_ray, local_redis_url
from shardcache.errors import ConfigError, ShardUnavailable, error_type
from shardcache.fingerprint import dataset_fingerprint
from shardcache.index import RedisIndex
from shardcache.manifest import Manifest
from shardcache.packed_manifest import format_of, objects_preprocess
from shardcache.sampler import first_steps
from shardcache.sharding import assign_chunks
from shardcache.spec import default_name, open_token
from shardcache.transport.base import Status
from shardcache_server.cluster import ensure_stores
from shardcache_server.preprocess import get_preprocessor
from shardcache_server.settings import ServiceSettings

__all__ = ["warm_dataset"]


def warm_dataset(
    url: str | None,
    *,
    preprocess: str | None = None,
    name: str | None = None,
    storage_options: dict[str, Any] | None = None,
    redis_url: str | None = None,
    namespace: str = "default",
    ray_address: str | None = None,
    batch: int = 8,
    chunk_samples: int = DEFAULT_CHUNK_SAMPLES,
    console: Console | None = None,
    steps: int | None = None,
    world_size: int = 1,
    batch_size: int = 1,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool | str = True,
    rank_nodes: list[str] | None = None,
    target: str | None = None,
    fmt: str | None = None,
    format_options: dict[str, Any] | None = None,
    like: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Warm ``url`` into the cluster cache; returns a summary.

    The dataset is described as a job describes it (``preprocess`` and
    ``target`` by registry name or ``module:qualname``, ``fmt``,
    ``format_options``), so the job's fingerprint is the one warmed; or
    ``like`` names a dataset a job registered and its spec is copied (its
    URL, options, format and callables, from a store that holds them).
    Warming never changes an existing dataset's generation (which would make
    the job re-read everything) unless ``force``.

    Chunks are spread over the nodes by the same rendezvous hashing the
    sampler uses, so no single store holds the whole dataset. ``batch`` is
    the number of chunks per store call.

    With ``steps``, only the chunks of the first ``steps`` batches of
    ``batch_size`` of every rank of a ``world_size`` job (``seed``,
    ``epoch`` and ``shuffle`` as the job's dataset) are warmed, in the
    order the ranks need them, each on its rank's node: ``rank_nodes``
    (one Ray node id per rank), by default the alive nodes sorted by id in
    contiguous blocks of ranks, as torchrun numbers them.

    Raises:
        ConfigError: no URL and no ``like``; ``like`` names no dataset a store
            holds; the spec's fingerprint differs from the registered one
            (without ``force``); an unknown preprocess or target.
        SourceNotFound, EmptyDatasetError, IndexUnavailable, ShardUnavailable,
        and the first per-object error (PreprocessError, ...).
    """
    import ray

    started = time.perf_counter()
    config = ClientConfig(
        redis_url=redis_url, namespace=namespace, ray_address=ray_address
    )
    redis_url = config.redis_url or local_redis_url()
    attach_ray(config.ray_address)
    handles = ensure_stores(ServiceSettings(redis_url=redis_url, namespace=namespace))
    nodes = sorted(handles)
    if not nodes:
        raise ShardUnavailable("no alive Ray node to warm into.")
    index = RedisIndex.from_url(redis_url, namespace)
    if like is not None:
        spec, fn, target_fn = _installed(handles, like)
        name, url = name or like, spec["urls"]
        spec = {**spec, "name": name}
    else:
        if url is None:
            raise ConfigError("warm needs a URL, or --like NAME to copy a dataset's.")
        name = name or default_name(url)
        fmt = fmt or format_of(url)
        fn = _named(preprocess, "preprocess") if preprocess else None
        target_fn = _named(target, "target") if target else None
        spec = {
            "name": name,
            "urls": url,
            "protocol": url.split("://", 1)[0] if "://" in url else "file",
            "storage_options": storage_options or {},
            "chunk_bytes": DEFAULT_CHUNK_BYTES,
            "chunk_samples": chunk_samples,
        }
        if fmt:
            spec.update(format=fmt, format_options=format_options or {})
    # Listed anew, as a job's dataset is (revalidate="job"): warm pre-fills
    # the source as it is now, never the versions of the last listing.
    token = open_token("job", f"warm-{uuid.uuid4().hex}")
    ref, digest = _unwrap(
        lambda: ray.get(handles[nodes[0]].manifest.remote(spec, token))
    )
    manifest = Manifest.from_object(ray.get(ref))
    if like is None:
        if fn is None:  # the job's default, decided the same way (dataset.py)
            probe = [manifest.url(i) for i in range(min(64, len(manifest)))]
            fn = as_arrays if fmt else objects_preprocess(probe, url) or raw_bytes
        spec["fingerprint"] = dataset_fingerprint(fn, target_fn)
    record = index.dataset(name)
    if record is not None and record.fingerprint != spec["fingerprint"] and not force:
        raise ConfigError(
            f"dataset {name!r} is cached at generation {record.generation} with "
            f"fingerprint {record.fingerprint}; warming it with fingerprint "
            f"{spec['fingerprint']} would start a new generation and make its jobs "
            f"read all {record.objects} objects again. Warm with the job's spec "
            f"(--like {name}, or the job's --preprocess/--target/--format), or pass "
            "--force to start over on purpose."
        )
    generation = index.register(
        name,
        url if isinstance(url, str) else f"{len(url)} urls",
        spec["fingerprint"],
        len(manifest),
        manifest.total_bytes,
    )
    spec.update(generation=generation, manifest=digest)
    _unwrap(
        lambda: ray.get(
            [h.install.remote(spec, fn, target_fn) for h in handles.values()]
        )
    )
    layout = manifest.layout
    sizes = layout.sizes()
    if steps is None:
        shards = assign_chunks(sizes, len(nodes))
        work = [
            (node, np.unique(layout.chunk_of(shard)).tolist())
            for node, shard in zip(nodes, shards, strict=False)
        ]
    else:
        rank_nodes = _rank_nodes(rank_nodes, nodes, world_size)
        heads = first_steps(
            sizes,
            world_size,
            steps,
            batch_size,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
        )
        work = [(n, h.tolist()) for n, h in zip(rank_nodes, heads, strict=True)]
    counts = {"fetched": 0, "already_cached": 0, "errors": 0, "not_kept": 0}
    since = time.time()
    first_error: tuple[str, str] | None = None
    items = manifest.chunk_items(range(len(layout)))
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:
        pending: dict[Any, list[int]] = {}
        assigned: set[int] = set()
        plan = []
        for node, wanted in work:
            # A chunk split between two shards is warmed once, by the first.
            chunks = [c for c in wanted if c not in assigned]
            assigned.update(chunks)
            plan.append((node, chunks))
        total = int(sum(int(sizes[c]) for c in assigned))
        task = progress.add_task(f"warming {name}", total=total)
        for node, chunks in plan:
            for i in range(0, len(chunks), batch):
                group = chunks[i : i + batch]
                call = handles[node].get.remote(
                    name, generation, [items[c] for c in group], digest=digest
                )
                pending[call] = group
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            group = pending.pop(done[0])
            answers = ray.get(done[0])
            # A partial rebuild read only its changed members, the rest
            # copied from the chunk held: asked of the stores now, while the
            # chunks are held (a count each, never the chunks).
            built = [
                items[c][0]
                for c, r in zip(group, answers, strict=True)
                if r[0] == Status.FETCHED
            ]
            read = _rows_read(handles, name, generation, built)
            for c, res in zip(group, answers, strict=True):
                n = int(sizes[c])
                if res[0] == Status.ERROR:
                    counts["errors"] += n
                    first_error = first_error or (res[1], res[2])
                elif res[0] == Status.FETCHED:
                    fetched = read.get(items[c][0], n)
                    counts["fetched"] += fetched
                    counts["already_cached"] += n - fetched
                elif res[0] == Status.UNCACHED:  # read, then not held
                    counts["not_kept"] += n
                else:
                    counts["already_cached"] += n
                progress.advance(task, n)
    if first_error is None:
        # Rows that failed inside a chunk leave the chunk's reply FETCHED
        # (cached, those rows marked) or UNCACHED; the store's record says.
        first_error = _first_fetch_error(
            index, name, since, FETCH_ERROR_WAIT_S if counts["not_kept"] else 0.0
        )
    # Chunks cached with rows that do not read or decode (built now, or by an
    # earlier job and answered as cached) say so in their index entries.
    warmed = [items[c][:2] for c in sorted(assigned)]
    failed_rows, cached_error = _cached_failures(index, name, generation, warmed)
    first_error = first_error or cached_error
    if first_error is not None:
        if not failed_rows and counts["fetched"]:
            # A chunk built just now records its entry as it answers.
            time.sleep(0.5)
            failed_rows, _ = _cached_failures(index, name, generation, warmed)
        kind, message = first_error
        not_cached = counts["errors"] + counts["not_kept"]
        what = []
        if not_cached:
            what.append(f"{not_cached} of {total} samples in chunks not cached")
        if failed_rows:
            what.append(
                f"{failed_rows} of {total} samples are cached as failed rows: "
                "they did not read or decode, and reading one raises this error "
                "(or is skipped with on_error='skip')"
            )
        raise error_type(kind)(
            f"warming {name!r} did not cache every sample "
            f"({'; '.join(what) or 'some samples did not read or decode'}). "
            f"The first failure: {message}"
        )
    return {
        "dataset": name,
        "generation": generation,
        "digest": digest,
        "items": items,
        "objects": len(manifest),
        "chunks": len(layout),
        "warmed_chunks": len(assigned),
        "warmed_samples": total,
        "rank_nodes": rank_nodes if steps is not None else None,
        "bytes": manifest.total_bytes,
        "seconds": time.perf_counter() - started,
        **counts,
    }


FETCH_ERROR_WAIT_S = 3.0  # a store records a failure just before it answers


def _rows_read(
    handles: dict[str, Any], name: str, generation: int, chunks: list[str]
) -> dict[str, int]:
    """Rows each of ``chunks`` read from the source, from the stores that
    hold them (one call per store); a chunk no store holds (evicted, or its
    store gone) is missing, and its caller counts all its rows."""
    import ray

    if not chunks:
        return {}
    out: dict[str, int] = {}
    calls = [h.rows_read.remote(name, generation, chunks) for h in handles.values()]
    for call in calls:
        try:
            out.update(ray.get(call, timeout=60))
        except (ray.exceptions.RayError, TimeoutError):
            continue  # the summary counts the chunk's every row
    return out


def _first_fetch_error(
    index: RedisIndex, name: str, since: float, wait_s: float
) -> tuple[str, str] | None:
    """The first row a store failed to read or decode since ``since``.

    A chunk whose rows failed with an error that may pass (a throttled or
    unreachable source, missing credentials) is served with those rows marked
    and not cached, so the next epoch tries again: its reply is the same
    ``UNCACHED`` as a chunk the budget could not hold. One whose rows fail
    for good (a file that does not decode) is cached with them marked and
    answers ``FETCHED``. Either way the store records a ``fetch_error`` event
    (from its pool, as it answers), looked for here for up to ``wait_s``;
    none found after ``UNCACHED`` means the budget said no.
    """
    deadline = time.monotonic() + wait_s
    while True:
        for event in reversed(index.events(200)):  # the list is newest first
            if (
                event.get("kind") == "fetch_error"
                and event.get("dataset") == name
                and float(event.get("ts", 0)) >= since
            ):
                return str(event.get("error", "")), str(event.get("message", ""))
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


def _cached_failures(
    index: RedisIndex, name: str, generation: int, chunks: list[tuple[str, str]]
) -> tuple[int, tuple[str, str] | None]:
    """Rows of ``chunks`` (key, version) cached as failed at that version
    (their entries' ``failed``), and the first one's ``(error class, message)``."""
    entries = index.entries(name, generation, [key for key, _ in chunks])
    failed = [
        e
        for key, version in chunks
        if (e := entries.get(key)) and e.get("failed") and e.get("etag") == version
    ]
    if not failed:
        return 0, None
    kind, message = failed[0].get("error") or ("ShardCacheError", "a row failed")
    return sum(int(e["failed"]) for e in failed), (str(kind), str(message))


def _rank_nodes(
    rank_nodes: list[str] | None, nodes: list[str], world_size: int
) -> list[str]:
    """The node of every rank: given, or contiguous blocks over ``nodes``."""
    if rank_nodes is None:
        return [nodes[r * len(nodes) // world_size] for r in range(world_size)]
    unknown = sorted(set(rank_nodes) - set(nodes))
    if len(rank_nodes) != world_size or unknown:
        raise ConfigError(
            f"rank_nodes must name one alive node per rank ({world_size}); got "
            f"{len(rank_nodes)} names, unknown: {unknown}. Alive: {nodes}."
        )
    return list(rank_nodes)


def _unwrap(call: Any) -> Any:
    """Run a Ray call; a ShardCacheError a store raised comes out as itself."""
    import ray

    from shardcache.errors import ShardCacheError

    try:
        return call()
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ShardCacheError):
            raise exc.cause from None
        raise


def _installed(handles: dict[str, Any], name: str) -> tuple[dict[str, Any], Any, Any]:
    """The spec and callables a job registered ``name`` with, from any store."""
    import ray

    for found in ray.get([h.installed.remote(name) for h in handles.values()]):
        if found:
            spec, fn, target = found
            return spec, fn, target
    raise ConfigError(
        f"no store holds a registration of dataset {name!r} (a job registers it "
        "when it starts; stores forget on restart). Run the job once, or warm "
        "with its URL and --preprocess/--target/--format."
    )


def _named(name: str, label: str) -> Any:
    """A registry name (``raw``, ``decode_image``...) or ``module:qualname``."""
    if ":" not in name:
        return get_preprocessor(name)
    module, _, qualname = name.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"--{label} {name}: cannot import it ({exc}). Name a module-level "
            "function as module:qualname, importable from this directory."
        ) from exc
    return found

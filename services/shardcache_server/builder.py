"""Build one chunk: fetch its members, preprocess them, lay them out as columns.

Runs in a worker process of the store's node (a Ray task pinned there, so
the chunk it returns lands in that node's object store, owned by the store
that submitted it): the store's event loop only schedules, and a node builds
as many chunks at once as it has cores. ``build_members`` is the plain
function; ``RayChunkBuilder`` submits it; tests call it in-process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.checksum import seal
from shardcache.chunks import SOURCED, Chunk
from shardcache.decoders import decode_npy, npy_view
from shardcache.errors import (
    BackendError,
    CorruptObjectError,
    RemoteFetchError,
    ShardCacheError,
    SourceNotFound,
)
from shardcache.manifest import Manifest
from shardcache.packed_manifest import PackedManifest
from shardcache_server.code_files import changed_modules
from shardcache_server.columns import build_chunk, column_chunk
from shardcache_server.fetch import Fetcher
from shardcache_server.npy_rows import read_npy_column
from shardcache_server.objects import listed_here, local_changed
from shardcache_server.packed_build import build_unit
from shardcache_server.preprocess import run_preprocess
from shardcache_server.settings import ServiceSettings
from shardcache_server.variants import VariantRequest, build_variant

__all__ = [
    "BUILD_WORKER_PREFIX",
    "BuildRequest",
    "BuildWorker",
    "RayChunkBuilder",
    "build_worker_name",
    "build_members",
    "build_request",
    "run_build",
]

log = logging.getLogger(__name__)


@dataclass
class BuildRequest:
    """What one chunk build needs: a few hundred bytes, whatever the chunk size.

    The members are rows ``lo`` to ``hi`` of the published manifest, read in
    the worker from the object store; no per-object list is built in the
    store or sent with the task (the caller would keep it for the task's
    lineage: ~650 KB per 4,096-object chunk, measured). With ``bases``
    (chunks built earlier) and ``reuse`` (rows ``(row, base, base row)``:
    the same URL and ETag), those rows are copied and only the others read.
    """

    dataset: str
    protocol: str
    storage_options: dict[str, Any]
    manifest: Any  # the manifest object, or its ObjectRef under Ray
    lo: int
    hi: int
    preprocess: Callable[[bytes], Any]
    target: Callable[[str], Any] | None = None
    # Earlier chunks' columns (or their ObjectRefs, under Ray), and the rows
    # copied from them: an (n, 3) int64 array of (row, base, base row).
    bases: list[Any] = field(default_factory=list)
    reuse: Any = None
    source: Any = None  # a user's map-style Dataset (packed format "dataset")
    # The unit's bytes the listing kept (tar; spans.py), or their ObjectRef.
    span: Any = None


# One Fetcher and one event loop per worker process, reused by every build:
# an s3fs session costs tens of milliseconds to open.
_LOOP: asyncio.AbstractEventLoop | None = None
_FETCHERS: dict[str, Fetcher] = {}  # by key, least recently used first
FETCHERS_KEPT = 16
_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(
                target=_LOOP.run_forever, name="chunk-fetch", daemon=True
            ).start()
        return _LOOP


def _fetcher(
    settings: ServiceSettings, protocol: str, options: dict[str, Any]
) -> Fetcher:
    # Every setting the Fetcher is built from is part of the key: two stores
    # (or tests) with different retry or timeout settings never share one.
    fetch_settings = settings.model_dump(
        include={
            "fetch_concurrency", "fetch_retries", "backoff_s", "backoff_max_s",
            "fetch_timeout_s", "verify_checksum", "source_rps", "source_burst",
            "redis_url", "namespace",
        }
    )  # fmt: skip
    key = json.dumps([protocol, options, fetch_settings], sort_keys=True, default=str)
    with _LOCK:
        fetcher = _FETCHERS.pop(key, None)
        if fetcher is not None:
            _FETCHERS[key] = fetcher  # most recently used last
        else:
            # The build actors live as long as the node: storage_options
            # that rotate (temporary credentials) must not grow this forever.
            while len(_FETCHERS) >= FETCHERS_KEPT:
                del _FETCHERS[next(iter(_FETCHERS))]
            fetcher = _FETCHERS[key] = Fetcher(
                protocol,
                options,
                concurrency=settings.fetch_concurrency,
                retries=settings.fetch_retries,
                backoff_s=settings.backoff_s,
                backoff_max_s=settings.backoff_max_s,
                timeout_s=settings.fetch_timeout_s,
                verify_checksum=settings.verify_checksum,
                budget=_budget(settings),
            )
        return fetcher


def _budget(settings: ServiceSettings) -> Any:
    if not settings.source_rps:
        return None
    from shardcache.index import RedisIndex
    from shardcache_server.budget import RequestBudget

    index = RedisIndex.from_url(settings.redis_url, settings.namespace)
    return RequestBudget(index, settings.source_rps, settings.source_burst)


async def _fetch_all(
    fetcher: Fetcher, members: list[tuple[str, str, int]]
) -> list[bytes | ShardCacheError]:
    async def one(url: str, etag: str, size: int) -> bytes | ShardCacheError:
        try:
            return await fetcher.fetch(url, size, etag)
        except ShardCacheError as exc:
            return exc

    return list(await asyncio.gather(*(one(*m) for m in members)))


LOCAL_PROTOCOLS = ("file", "local")  # read with plain file I/O, no event loop
_ONE_READ_MAX = 1 << 30  # bytes per read call (Linux returns at most ~2 GiB)


def _read_file(path: str, size: int) -> tuple[bytes, os.stat_result]:
    """A local file's bytes and its stat after the read (objects.py).

    Four system calls for a small file: open, one read of the listed size
    plus a byte (a grown file reads long, and the size check below tells),
    fstat, close. ``open(path, "rb").read()`` makes about eight (an fstat
    and isatty to set up buffering, another fstat, a second read to find
    the end): 1.9x the files per second at 100 B, most of a cold epoch of
    small files. A read that comes short of the listed size or of what
    fstat says (a FUSE or NFS mount may answer in parts) reads on. A file
    of 1 GiB or more is read as before, into one buffer.
    """
    if size >= _ONE_READ_MAX:  # one buffer, as before (parts would join twice)
        with open(path, "rb") as f:
            return f.read(), os.fstat(f.fileno())
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        data = os.read(fd, size + 1)
        read_as = os.fstat(fd)
        # Short of the listed size or of fstat's (which an NFS attribute
        # cache may hold stale): read on to the end or a byte past the size.
        if len(data) < size or len(data) < min(read_as.st_size, size + 1):
            parts, got = [data], len(data)
            while got <= size and (more := os.read(fd, size + 1 - got)):
                parts.append(more)
                got += len(more)
            data, read_as = b"".join(parts), os.fstat(fd)
        return data, read_as
    finally:
        os.close(fd)


def _read_local(
    members: list[tuple[str, str, int]], check_versions: bool
) -> list[bytes | ShardCacheError]:
    """Local files, read in this worker thread: a file costs an open and a read
    (~10 us), where the async path would cost a thread hop per file.
    ``check_versions``: on the host that listed them, a file whose mtime is
    not the listed one is a StaleVersionError (``objects.local_changed``)."""
    out: list[bytes | ShardCacheError] = []
    for url, etag, size in members:
        path = url.split("://", 1)[-1]
        try:
            data, read_as = _read_file(path, size)
        except FileNotFoundError:
            out.append(
                SourceNotFound(
                    f"object {url!r} no longer exists at the source. Re-list the "
                    "dataset (DistributedCachedDataset.refresh()) or restore it."
                )
            )
            continue
        except OSError as exc:
            out.append(RemoteFetchError(f"reading {url!r} failed: {exc}"))
            continue
        stale = local_changed(url, etag, read_as) if check_versions else None
        if stale is not None:
            out.append(stale)
            continue
        if len(data) != size:
            out.append(
                CorruptObjectError(
                    f"object {url!r} read {len(data)} bytes but the listing said "
                    f"{size}: changed since it was listed. Call refresh()."
                )
            )
            continue
        out.append(data)
    return out


def build_members(
    settings: ServiceSettings, req: BuildRequest
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Fetch and preprocess the members not reused, build the chunk's columns.

    Returns ``(columns, report)``; the report counts reads and bytes and
    lists each failed member as ``{row: [error class, message]}``. A failed
    member does not fail the chunk: its row is marked and the rest is served.
    """
    started = time.perf_counter()
    manifest = Manifest.from_object(req.manifest)
    if isinstance(manifest, PackedManifest):
        chunk = int(np.searchsorted(manifest.layout.starts, req.lo, side="right") - 1)
        return build_unit(
            manifest,
            chunk,
            req.preprocess,
            req.target,
            req.storage_options,
            req.source,
            req.span,
            # the budget the per-object GETs take, kept with their Fetcher
            _fetcher(settings, req.protocol, req.storage_options).budget,
        )
    members = manifest.members(req.lo, req.hi)
    check_versions = req.protocol in LOCAL_PROTOCOLS and listed_here(manifest.columns)
    if (
        req.protocol in LOCAL_PROTOCOLS
        and req.preprocess is decode_npy
        and not req.bases
    ):
        column = read_npy_column(members, check_versions)
        if column is not None:  # else a member is unusual: the general path below
            built = column_chunk(
                column, [m[0] for m in members], _targets(req, members)
            )
            return _sealed(built, len(members), sum(m[2] for m in members), {}, started)
    copies = req.reuse if req.bases and req.reuse is not None else np.zeros((0, 3))
    reuse = {int(r) for r in copies[:, 0]}
    fetch_rows = [r for r in range(len(members)) if r not in reuse]
    to_read = [members[r] for r in fetch_rows]
    if req.protocol in LOCAL_PROTOCOLS:
        fetched = _read_local(to_read, check_versions)
    else:
        fetcher = _fetcher(settings, req.protocol, req.storage_options)
        coro = _fetch_all(fetcher, to_read)
        fetched = asyncio.run_coroutine_threadsafe(coro, _loop()).result()
    samples: list[Any] = [None] * len(members)
    errors: dict[int, tuple[str, str]] = {}
    bytes_read = 0
    bases = [Chunk(b) for b in req.bases] if reuse else []
    for row, b, base_row in copies.tolist():
        failed = bases[b].error(base_row)
        if failed is not None:
            # It failed for good on this version (only such chunks are
            # cached): it stays failed, never its placeholder as a sample.
            errors[row] = failed
        else:
            samples[row] = _copy(bases[b].sample(base_row))
    # The default .npy decode copies its array out of the bytes; build_chunk
    # copies every sample into its column anyway, so a view is decoded here.
    preprocess = npy_view if req.preprocess is decode_npy else req.preprocess
    # Per member: the user's preprocess itself; everything else is per chunk.
    for row, data in zip(fetch_rows, fetched, strict=True):
        url = members[row][0]
        if isinstance(data, ShardCacheError):
            errors[row] = (type(data).__name__, str(data))
            continue
        bytes_read += len(data)
        try:
            samples[row] = run_preprocess(preprocess, data, url)
        except ShardCacheError as exc:
            errors[row] = (type(exc).__name__, str(exc))
    built = build_chunk(
        samples, errors, names=[m[0] for m in members], targets=_targets(req, members)
    )
    if reuse:
        built[SOURCED] = np.array([r not in reuse for r in range(len(members))])
    reads = len(fetch_rows) - sum(isinstance(d, ShardCacheError) for d in fetched)
    return _sealed(built, reads, bytes_read, errors, started)


def _targets(
    req: BuildRequest, members: list[tuple[str, str, int]]
) -> list[Any] | None:
    return None if req.target is None else [req.target(url) for url, _, _ in members]


def _sealed(
    built: dict[str, np.ndarray],
    reads: int,
    bytes_read: int,
    errors: dict[int, tuple[str, str]],
    started: float,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The chunk with its checksum, and the build's report."""
    columns = seal(built)
    report = {
        "reads": reads,
        "bytes_read": bytes_read,
        "errors": {str(k): list(v) for k, v in errors.items()},
        "build_ms": int((time.perf_counter() - started) * 1000),
        "nbytes": int(sum(v.nbytes for v in columns.values())),
    }
    return columns, report


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: np.array(v) for k, v in value.items()}
    return np.array(value)


def build_request(
    settings: ServiceSettings, req: BuildRequest | VariantRequest
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Build what ``req`` asks for: a chunk from the source, or an augmented
    variant of a base chunk (``variants.py``); both run in build workers."""
    if isinstance(req, VariantRequest):
        return build_variant(req)
    return build_members(settings, req)


def run_build(
    settings_dump: dict[str, Any], req: BuildRequest | VariantRequest
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The task body: settings travel as a plain dict."""
    import ray

    if isinstance(req, VariantRequest):
        if not isinstance(req.base, dict):
            req.base = ray.get(req.base)  # a nested ObjectRef: mapped zero-copy
        return build_variant(req)
    # Nested ObjectRefs are not resolved by Ray: map them here (zero-copy).
    refs = [j for j, b in enumerate(req.bases) if not isinstance(b, dict)]
    for j, columns in zip(refs, ray.get([req.bases[j] for j in refs]), strict=True):
        req.bases[j] = columns
    if not isinstance(req.manifest, dict):
        req.manifest = ray.get(req.manifest)
    if req.span is not None and not isinstance(req.span, np.ndarray):
        try:
            req.span = ray.get(req.span)
        except ray.exceptions.ObjectLostError:
            # Its owner (the store that listed) died with it: read the source.
            req.span = None
    return build_members(ServiceSettings(**settings_dump), req)


BUILD_WORKER_PREFIX = "build-"
# Tries of one build: a build actor that died, or one that refused because
# the user's code changed since it imported it, is replaced and tried again.
BUILD_ATTEMPTS = 3
STALE_CODE = "stale_code"  # a refused build's report: the modules that changed


def build_worker_name(node_id: str, slot: int) -> str:
    return f"{BUILD_WORKER_PREFIX}{node_id}-{slot}"


class BuildWorker:
    """One build at a time in a process of its own, kept for the node's life.

    Why an actor and not a task: the store is detached, so its tasks run
    under the job of the script that first started it, and once that script
    ends Ray counts the job finished and kills each of its idle workers. With
    tasks, every later script's cold chunks each started a new worker
    process (~1 s of imports apiece: a cold first batch of 8 s instead of
    0.6 s on 2 cores, after the demo had run once). A detached actor stays.
    """

    def __init__(self) -> None:
        import fsspec  # noqa: F401  (the imports are paid at start, not per build)

    def ready(self) -> int:
        return len(_FETCHERS)

    def run(
        self, settings_dump: dict[str, Any], req: BuildRequest | VariantRequest
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        # Kept across scripts, this process would build with the code it
        # imported first: a user module edited since is refused here, and
        # the builder replaces the process before building (code_files.py).
        changed = changed_modules()
        if changed:
            return {}, {STALE_CODE: changed, "pid": os.getpid()}
        return run_build(settings_dump, req)

    def pid(self) -> int:
        return os.getpid()


def _unresolved_user_code(exc: BaseException) -> bool:
    """Whether a build failed before it ran because its arguments name code
    the process cannot find (``AttributeError``/``ImportError`` unpickling)."""
    text = str(exc)
    return any(
        f"{kind}:" in text
        for kind in ("AttributeError", "ModuleNotFoundError", "ImportError")
    ) and ("deseriali" in text.lower() or "unpickl" in text.lower())


async def _pid(worker: Any) -> int | None:
    import ray

    try:
        return int(await asyncio.wait_for(worker.pid.remote(), 30.0))
    except (TimeoutError, ray.exceptions.RayActorError):
        return None


async def _restart(worker: Any, old_pid: int | None, why: str, dataset: str) -> None:
    """Replace ``worker``'s process (Ray restarts it: ``max_restarts=-1``)
    and wait for the new one, so the next build imports the user's code as
    it is on disk now."""
    import ray

    log.info(
        "build worker (pid %s): %s; restarting it to build %s", old_pid, why, dataset
    )
    ray.kill(worker, no_restart=False)
    await _restarted(worker, old_pid)


async def _restarted(
    worker: Any, old_pid: int | None, timeout_s: float = 120.0
) -> None:
    """Wait until ``worker`` answers from another process than ``old_pid``:
    a call sent right after ``ray.kill`` may still reach the old one."""
    import ray

    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            pid = await asyncio.wait_for(worker.pid.remote(), max(left, 0.1))
            if pid != old_pid:
                return
        except (TimeoutError, ray.exceptions.RayActorError):
            pass  # between the two processes, or still starting
        await asyncio.sleep(0.05)
    raise BackendError(
        f"a build worker did not restart within {timeout_s:.0f} s (its process "
        "was replaced because the user's code changed on disk); see the Ray logs."
    )


class RayChunkBuilder:
    """Runs builds on ``workers`` build actors pinned to ``node_id``, one each at a time.

    The call's first return value (the columns) stays in the node's object
    store and is owned by the calling store; only the small report travels
    back to the store's event loop. The actors are detached and named
    (``build-<node>-<slot>`` in the store's Ray namespace), so a restarted
    store finds them; ``cluster.kill_stores`` kills them with the stores.
    """

    def __init__(
        self, settings: ServiceSettings, node_id: str, workers: int, namespace: str
    ):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._settings = settings.model_dump()
        self.workers = workers
        actor_cls = ray.remote(BuildWorker)

        def start(slot: int) -> Any:
            # num_cpus=0: the pool's size is the node's CPUs, and a build
            # never waits behind training workers that reserved every CPU.
            return actor_cls.options(
                name=build_worker_name(node_id, slot),
                namespace=namespace,
                lifetime="detached",
                get_if_exists=True,
                max_restarts=-1,
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote()

        self._start = start
        # Started now (they begin importing at once), not on the first cold
        # batch; a slot is (its number, its actor).
        self._idle: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        for slot in range(workers):
            self._idle.put_nowait((slot, start(slot)))

    async def build(
        self, req: BuildRequest | VariantRequest
    ) -> tuple[Any, dict[str, Any]]:
        import ray

        slot, worker = await self._idle.get()
        try:
            for attempt in range(BUILD_ATTEMPTS):
                try:
                    done = await self._run_once(worker, req)
                except ray.exceptions.RayActorError:
                    # Its process died. Ray restarts it (max_restarts=-1), but
                    # one killed for good (ray.kill) never comes back: look the
                    # slot up by name again, starting a new actor where the old
                    # one is gone. A build has no side effects: try it again.
                    worker = self._start(slot)
                    if attempt == BUILD_ATTEMPTS - 1:
                        raise
                    continue
                if done is not None:
                    return done
            raise BackendError(
                f"the build of {req.dataset!r} was refused {BUILD_ATTEMPTS} times "
                "by fresh build processes: the user's modules kept changing on "
                "disk while they started; build again once the files are saved."
            )
        finally:
            self._idle.put_nowait((slot, worker))

    async def _run_once(
        self, worker: Any, req: BuildRequest | VariantRequest
    ) -> tuple[Any, dict[str, Any]] | None:
        """One try on ``worker``: ``(columns, report)``, or ``None`` where the
        worker was restarted to run the user's new code (try again)."""
        import ray

        try:
            columns_ref, report_ref = worker.run.options(num_returns=2).remote(
                self._settings, req
            )
            report = await report_ref
        except (ray.exceptions.RayTaskError, ray.exceptions.RaySystemError) as exc:
            # The project's own error reaches the rank as itself, not as
            # a BackendError carrying a Ray traceback.
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ShardCacheError):
                raise cause from None
            if not _unresolved_user_code(exc):
                raise
            # The build's arguments name a function or module this process
            # imported before it existed (a function added to decode.py
            # since): a fresh process imports the file as it is now.
            await _restart(worker, await _pid(worker), str(exc), req.dataset)
            return None
        if STALE_CODE in report:
            # The user's code changed on disk since this process imported
            # it: a fresh process (Ray restarts it) imports the new code.
            changed = ", ".join(report[STALE_CODE]) + " changed on disk"
            await _restart(worker, report["pid"], changed, req.dataset)
            return None
        return columns_ref, report

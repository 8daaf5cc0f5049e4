"""The published listing: one store lists a dataset, every other process maps it.

The first store asked for a dataset's manifest claims it in Redis
(``manifest:{ds}``), lists the source once, cuts it into chunks and puts the
arrays in the object store; every other store asks that holder and gets
the same ObjectRef, and ranks map it zero-copy. A refresh carries a token
(job, refresh count, the digest the rank had): every rank of a job calling
``refresh()`` together sends the same token, and one listing answers them
all; a new token lists again. A new job's ranks send a token of the job
(``open/{job}``) when they construct the dataset, so every job starts on
the source as it is then (``revalidate=`` in the SDK opts out).

A listing that reads whole units (tar) also yields their bytes, which the
store holds for the builds of those units (``spans.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache import heap
from shardcache.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_SAMPLES, plan_chunks
from shardcache.listing_feed import extends
from shardcache.manifest import PREFIX_COLUMN, PREFIX_ENDS, Manifest
from shardcache.packed_manifest import PackedManifest
from shardcache.segments import WHOLE_LISTING
from shardcache_server.budget import budget_from_spec
from shardcache_server.list_fanout import FanOut
from shardcache_server.objects import list_source
from shardcache_server.packed_listing import list_packed
from shardcache_server.spans import HeldSpans, SpanKeeper

__all__ = [
    "REFRESH_TOKEN_TTL_S",
    "BudgetSpec",
    "Listed",
    "PrefixSink",
    "Listings",
    "cut_prefix",
    "RayLister",
    "list_in_thread",
    "list_with_layout",
    "listing_budget",
]

# A token answered this recently is answered again from the same listing: a
# job's ranks may reach their store minutes apart (slow starts, big images),
# and they must all read one listing. Tokens are unique per job, so a long
# TTL never serves one job another's listing.
REFRESH_TOKEN_TTL_S = 3600.0
MAX_AGE_TOKEN = "max-age/"  # "max-age/N": any listing begun within N seconds
MANIFESTS_KEPT = 4  # digests per dataset a store keeps for ranks not yet refreshed

log = logging.getLogger(__name__)


@dataclass
class Listed:
    """What one listing produced: the manifest's reference and digest, the
    units' bytes it kept (``version -> (reference, nbytes)``) and the
    keeper's report (kept / over budget, spans.py)."""

    ref: Any
    digest: str
    spans: dict[str, tuple[Any, int]] = field(default_factory=dict)
    report: dict[str, int] = field(default_factory=dict)


BudgetSpec = dict[str, Any]  # what a listing task needs to reach the source budget


def listing_budget(settings: Any) -> BudgetSpec | None:
    """The source request budget a store's listings share with its GETs
    (``source_rps``), as plain values a listing task can carry; ``None``
    when the source has no budget."""
    if not settings.source_rps:
        return None
    return {
        "redis_url": settings.redis_url,
        "namespace": settings.namespace,
        "rate": settings.source_rps,
        "burst": settings.source_burst,
    }


# A first chunk of many objects is cut into this many pieces: a job whose
# first epoch is read chunk by chunk (shardcache.segments) waits for one
# piece's build (64 GETs at the default 4,096 objects a chunk, not 4,096)
# before its first batch. The pieces are dealt evenly (sharding.assign_chunks),
# so up to 64 ranks each start on one; with fewer, the DDP step would wait
# for the ranks that drew none and began on a whole chunk. Only where the
# first chunk has RAMP_MIN_OBJECTS or more (small objects: each chunk is
# thousands of GETs); a chunk of a few large objects builds as fast as a
# piece would.
RAMP_PIECES = 64
RAMP_MIN_OBJECTS = 1024


def _planned(
    sizes: np.ndarray, spec: dict[str, Any], pieces: bool = True
) -> np.ndarray:
    """Chunk starts planned for objects of ``sizes`` with the spec's chunk size.

    A whole first chunk (a second start is planned) of ``RAMP_MIN_OBJECTS``
    or more is cut into ``RAMP_PIECES`` equal pieces (fewer when it holds
    fewer objects). Planning is a function
    of the objects alone (the same objects always plan the same chunks, so
    a listing made again by digest builds the same ones) and prefix-stable
    (a prefix plans the finished listing's first chunks, pieces included).
    """
    layout = plan_chunks(
        sizes,
        int(spec.get("chunk_bytes") or DEFAULT_CHUNK_BYTES),
        int(spec.get("chunk_samples") or DEFAULT_CHUNK_SAMPLES),
    )
    starts = np.asarray(layout.starts, dtype=np.int64)
    if not pieces or len(starts) < 3 or int(starts[1]) < RAMP_MIN_OBJECTS:
        return starts  # no whole first chunk before the last, or a quick one
    first = int(starts[1])
    count = min(RAMP_PIECES, first)  # no empty piece
    cut = np.arange(count, dtype=np.int64) * first // count
    return np.concatenate([cut, starts[1:]])


def _kept_starts(previous: Manifest | None, manifest: Manifest) -> np.ndarray | None:
    """``previous``'s chunk starts when its first URLs are ``manifest``'s
    (all of them, or a prefix's), else ``None``."""
    if not isinstance(previous, Manifest) or "chunk_starts" not in previous.columns:
        return None
    n, mine = len(manifest), manifest.columns["name_offsets"]
    if len(previous) < n or not (
        np.array_equal(previous.columns["name_offsets"][: n + 1], mine)
        and np.array_equal(
            previous.columns["names"][: int(mine[-1])], manifest.columns["names"]
        )
    ):
        return None
    return np.asarray(previous.columns["chunk_starts"], dtype=np.int64)


def _starts_for(
    manifest: Manifest, kept: np.ndarray | None, spec: dict[str, Any]
) -> np.ndarray:
    """Chunk starts for ``manifest``: ``kept`` (:func:`_kept_starts` of the
    previous listing) when that listing had exactly these URLs, so a
    changed object changes only its own chunk's version (a new size must
    not move every later chunk boundary), else planned."""
    if kept is not None and int(kept[-1]) == len(manifest):
        return kept
    return _planned(manifest.sizes, spec)


# A cold full shuffle's first batch (the README's 64 samples, each drawn
# from anywhere in the listing) waits for every chunk it touches.
FIRST_BATCH_SAMPLES = 64
# The source reads such a first batch may wait for before a job's first
# epoch of a fresh listing is read chunk by chunk instead (two default
# chunks: a few seconds from an object store).
COLD_FIRST_BATCH_READS = 8192


def _cold_and_slow(
    manifest: Manifest, kept: np.ndarray | None, starts: np.ndarray
) -> bool:
    """Nothing of ``manifest`` can be cached yet (no previous listing of
    its first URLs: ``kept`` is ``None``), and a full shuffle's first batch
    would wait for at least ``COLD_FIRST_BATCH_READS`` source reads: the
    job's first epoch goes by one segment (``shardcache.segments``), chunk
    by chunk."""
    if len(starts) < 3 or kept is not None:
        return False
    # The reads such a batch waits for, expected: each chunk's objects times
    # the chance that one of the batch's samples falls in it. Counting
    # chunks instead would take the first chunk's small pieces for whole ones.
    sizes = np.diff(starts).astype(np.float64)
    touched = 1.0 - (1.0 - sizes / float(starts[-1])) ** FIRST_BATCH_SAMPLES
    return float(sizes @ touched) >= COLD_FIRST_BATCH_READS


def cut_prefix(
    prefix: Manifest,
    previous: Manifest | None,
    spec: dict[str, Any],
    announced: np.ndarray | None = None,
) -> Manifest | None:
    """A listing's first objects as a manifest of whole chunks, or ``None``
    while they make no whole chunk beyond ``announced`` (the chunk starts of
    the prefix published before it).

    Chunks are cut by buckets of the cumulative source bytes from the first
    object and by runs of ``chunk_samples`` from each bucket's start, so the
    chunks of a prefix are the finished listing's chunks except the last,
    which may still grow: it is left out. Where ``previous`` listed the
    same first URLs, its chunks are taken instead, as the finished listing
    would (``_starts_for``). Either way every chunk announced stays
    (:func:`_keep_announced`; :func:`list_with_layout` does the same for
    the finished listing).
    """
    kept = _kept_starts(previous, prefix)
    if kept is not None:
        starts = kept[kept <= len(prefix)]  # every chunk of previous inside it
    else:
        starts = _planned(prefix.sizes, spec)[:-1]  # the last may still grow
    starts = _keep_announced(starts, announced, prefix, spec, whole=False)
    done = 0 if announced is None else int(announced[-1])
    if len(starts) < 2 or int(starts[-1]) <= done:
        return None
    cut = prefix.head(int(starts[-1]))
    cut.columns["chunk_starts"] = starts
    for name, column in prefix.columns.items():
        cut.columns.setdefault(name, column)  # where it was listed
    return cut


def _keep_announced(
    starts: np.ndarray,
    announced: np.ndarray | None,
    manifest: Manifest,
    spec: dict[str, Any],
    *,
    whole: bool = True,
) -> np.ndarray:
    """``starts``, unless they move a chunk ``announced`` (a published
    prefix's, which ranks may have read): then the announced chunks, and the
    rest planned from where they end (a ``previous`` listing matched the
    prefix but not what followed). ``whole``: ``manifest`` is the finished
    listing (else a prefix: its last planned chunk may still grow)."""
    if announced is None or np.array_equal(starts[: len(announced)], announced):
        return starts
    end = int(announced[-1])
    planned = _planned(manifest.sizes[end:], spec, pieces=False)  # not a first chunk
    rest = (planned[1:] if whole else planned[1:-1]) + end
    return np.concatenate([np.asarray(announced, np.int64), rest])


def list_with_layout(
    spec: dict[str, Any],
    previous: Manifest | None,
    keeper: SpanKeeper | None = None,
    budget: BudgetSpec | None = None,
    fan_out: bool = False,
    on_prefix: Callable[[Manifest], None] | None = None,
    stream_after_s: float | None = None,
) -> Manifest:
    """List ``spec["urls"]`` and cut it into chunks.

    When the URLs are the ones ``previous`` listed, its chunks are kept, so a
    changed object changes only its own chunk's version (a new size must
    not move every later chunk boundary). ``keeper`` receives the units'
    bytes a packed listing reads whole (tar). ``budget`` (from
    :func:`listing_budget`): every LIST request takes a token of it.
    ``fan_out``: an S3 prefix with many sub-prefixes is listed by Ray tasks
    as well as this process (``list_fanout.py``); only inside Ray.
    ``on_prefix``: receives prefixes of whole chunks while a listing that
    runs longer than ``stream_after_s`` goes on (:func:`cut_prefix`); not
    for packed formats, whose units are listed file by file.

    The manifest exists only once the whole source is listed: a listing
    that fails or dies halfway publishes nothing, and the next request for
    the dataset lists again from the start.
    """
    source_budget = budget_from_spec(budget)
    if spec.get("format"):
        return list_packed(spec, previous, keeper, source_budget)  # type: ignore[return-value]
    options = spec.get("storage_options") or {}
    spread = FanOut(options, budget) if fan_out else None
    announced: list[np.ndarray] = []  # the last published prefix's chunk starts
    ends: list[int] = []  # the length of each published prefix
    prefix_to = None
    if on_prefix is not None:

        def prefix_to(prefix: Manifest) -> None:
            cut = cut_prefix(
                prefix, previous, spec, announced[0] if announced else None
            )
            if cut is not None:
                announced[:] = [cut.columns["chunk_starts"]]
                ends.append(len(cut))
                # Every prefix so far: the first epoch's segments, which
                # every rank of the job cuts alike (shardcache.segments).
                cut.columns[PREFIX_ENDS] = np.asarray(ends, np.int64)
                on_prefix(cut)

    manifest = list_source(
        spec["urls"], options, source_budget, spread, prefix_to, stream_after_s
    )
    kept = _kept_starts(previous, manifest)  # compared once: names may be GBs
    starts = _starts_for(manifest, kept, spec)
    if on_prefix is not None and not ends and _cold_and_slow(manifest, kept, starts):
        # Listed before any prefix was due, for a job waiting on it: its
        # first epoch is one segment, the whole listing, read chunk by chunk
        # (WHOLE_LISTING marks it: see shardcache.segments).
        ends += [WHOLE_LISTING, len(manifest)]
    starts = _keep_announced(
        starts, announced[0] if announced else None, manifest, spec
    )
    manifest.columns["chunk_starts"] = np.asarray(starts, dtype=np.int64)
    if ends:
        manifest.columns[PREFIX_ENDS] = np.asarray(ends, np.int64)
    return manifest


# A listing's prefixes as they are published: (reference, mapped manifest).
PrefixSink = Callable[[Any, Manifest], None]
Lister = Callable[[dict[str, Any], Any, int, PrefixSink | None], Awaitable[Listed]]

_DONE = object()  # the listing thread finished (its result or error is in the job)


def _marked(prefix: Manifest) -> dict[str, Any]:
    """A prefix's object-store form, marked as one (``Manifest.is_prefix``)."""
    return {**prefix.to_object(), PREFIX_COLUMN: np.int64(len(prefix))}


def _list_task(
    spec: dict[str, Any],
    previous: Any,
    room_bytes: int,
    budget: BudgetSpec | None,
    stream_after_s: float | None = None,
    stream: bool = False,
) -> Iterator[Any]:
    """The listing as a streaming task: yields each kept unit's bytes as it
    is read (packed formats) or each prefix of whole chunks (a manifest
    object marked ``PREFIX_COLUMN``) as it is listed, then the manifest
    object, then ``{digest, versions, report}``.

    Its per-object Python objects live and die in a worker process. What a
    generator task yields is owned by the caller (the store), so the spans
    outlive this worker; a ``ray.put`` here would die with it.
    """
    # Ray resolves a top-level ObjectRef argument: ``previous`` arrives as
    # the mapped manifest object (zero-copy), or None.
    prev = None if previous is None else Manifest.from_object(previous)
    found: queue.Queue[Any] = queue.Queue()
    keeper = SpanKeeper(
        room_bytes,
        lambda version, data: found.put((version, data)),
        dict(spec.get("format_options") or {}),
    )
    versions, sizes = [], []

    def prefix_out(prefix: Manifest) -> None:
        found.put((None, _marked(prefix)))

    out = prefix_out if stream and not spec.get("format") else None
    with ThreadPoolExecutor(1, thread_name_prefix="listing") as pool:
        job = pool.submit(
            list_with_layout, spec, prev, keeper, budget, True, out, stream_after_s
        )
        job.add_done_callback(lambda _: found.put(_DONE))
        while (item := found.get()) is not _DONE:
            if item[0] is not None:  # a unit's bytes (else a prefix)
                versions.append(item[0])
                sizes.append(len(item[1]))
            yield item[1]
        listed = job.result()  # the listing's own error, if it failed
    yield listed.to_object()
    yield {
        "digest": listed.digest,
        "versions": versions,
        "sizes": sizes,
        "report": keeper.report(),
    }
    # RayLister's worker exits after one listing (max_calls=1); any other
    # process that runs this would keep the listing's freed heap (28 B per
    # object at 1 M objects) for its life without the trim.
    del listed, job, prev, keeper, item, versions, sizes
    heap.trim()


class RayLister:
    """Lists in a Ray task pinned to the store's node; the manifest and the
    spans it yields are owned by the store. The store's own heap never holds
    a per-object Python object (1M objects listed in-process left ~200 B
    each of heap)."""

    def __init__(
        self,
        node_id: str,
        budget: BudgetSpec | None = None,
        stream_after_s: float | None = None,
    ):
        import ray

        self._budget, self._stream_after_s = budget, stream_after_s
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # max_calls=1: the worker exits after one listing, so what it held
        # per object (18 MB at 1 M objects, even trimmed) leaves with it
        # instead of staying in Ray's pool. A listing is once per dataset
        # and store; the pool starts a worker again when one is wanted.
        self._task = ray.remote(max_calls=1)(_list_task).options(
            num_returns="streaming",
            num_cpus=0,
            max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )

    async def __call__(
        self,
        spec: dict[str, Any],
        previous: Any,
        room_bytes: int,
        on_prefix: PrefixSink | None = None,
    ) -> Listed:
        import ray

        from shardcache.errors import RemoteFetchError, ShardCacheError

        task = self._task.remote(
            spec,
            previous,
            room_bytes,
            self._budget,
            self._stream_after_s,
            on_prefix is not None,
        )
        refs = []
        try:
            async for ref in task:
                if spec.get("format"):  # units' bytes: never fetched here
                    refs.append(ref)
                    continue
                # A prefix, the manifest or the tail: small, or mapped anyway.
                value = await ref
                if isinstance(value, dict) and PREFIX_COLUMN in value:
                    if on_prefix is not None:
                        on_prefix(ref, Manifest.from_object(value))
                    continue
                refs.append(ref)
            tail = await refs[-1]
        except ray.exceptions.RayTaskError as exc:
            # A listing that found nothing or was refused is our own error
            # (SourceNotFound, EmptyDatasetError...), not a Ray one.
            if isinstance(exc.cause, ShardCacheError):
                raise exc.cause from None
            raise
        except ray.exceptions.RayError as exc:
            # The worker died (killed, out of memory) or its node left: what
            # it listed was never published, and nothing retries it underneath
            # (max_retries=0: a retry would list everything again unasked).
            raise RemoteFetchError(
                f"the listing of dataset {spec.get('name')!r} stopped halfway: "
                f"{type(exc).__name__} from Ray (its worker died, its node left, "
                "or Ray could not run it). Nothing of it was published; the next "
                "request lists it again from the start."
            ) from exc
        spans = {
            v: (ref, n)
            for v, ref, n in zip(tail["versions"], refs, tail["sizes"], strict=False)
        }
        return Listed(refs[-2], tail["digest"], spans, tail["report"])


def list_in_thread(
    put: Callable[[Any], Any],
    budget: BudgetSpec | None = None,
    stream_after_s: float | None = None,
) -> Lister:
    """A lister for tests without Ray: list in a thread, ``put`` the arrays."""

    async def run(
        spec: dict[str, Any],
        previous: Any,
        room_bytes: int,
        on_prefix: PrefixSink | None = None,
    ) -> Listed:
        prev = None if previous is None else Manifest.from_object(previous)
        loop = asyncio.get_running_loop()

        def prefix_out(prefix: Manifest) -> None:
            marked = _marked(prefix)
            ref = put(marked)
            if on_prefix is not None:
                mapped = Manifest.from_object(marked)
                loop.call_soon_threadsafe(on_prefix, ref, mapped)

        spans: dict[str, tuple[Any, int]] = {}
        lock = threading.Lock()

        def keep(version: str, data: Any) -> None:
            ref = put(data)
            with lock:
                spans[version] = (ref, len(data))

        options = dict(spec.get("format_options") or {})
        keeper = SpanKeeper(room_bytes, keep, options)
        streams = on_prefix is not None and not spec.get("format")
        stream = prefix_out if streams else None
        listed = await asyncio.to_thread(
            list_with_layout, spec, prev, keeper, budget, False, stream, stream_after_s
        )
        return Listed(put(listed.to_object()), listed.digest, spans, keeper.report())

    return run


class Listings:
    """The manifests one store holds, by ``(dataset, digest)``.

    Args:
        lister: lists a spec (given the previous manifest's reference, to keep
            its chunks, and the room left for spans) and returns a
            :class:`Listed`.
        get: maps a reference back to the object, or returns an awaitable of
            it (under Ray the ObjectRef itself: awaiting it never blocks the
            store's event loop while a large manifest moves between nodes).
        span_budget_bytes: the most bytes of units' spans held at once
            (``spans``). Defaults to ``0``: none.
    """

    def __init__(
        self, get: Callable[[Any], Any], lister: Lister, span_budget_bytes: int = 0
    ):
        self._get, self._lister = get, lister
        self.spans = HeldSpans(span_budget_bytes)
        # The latest listing's span report per dataset, when units were over
        # budget (the store logs it as an event).
        self.over_budget: dict[str, dict[str, int]] = {}
        self._held: dict[str, dict[str, tuple[Any, Manifest]]] = {}
        self._published: dict[str, str] = {}  # the digest of my latest listing
        self._published_at: dict[str, float] = {}  # when that listing began
        # token -> (start, digest, reference, mapped): the listing that answered it
        self._tokens: dict[str, dict[str, tuple[float, str, Any, Manifest]]] = {}
        # dataset -> (the listing under way, when it began)
        self._inflight: dict[str, tuple[asyncio.Future[tuple[Any, str]], float]] = {}
        # Prefixes published while listings ran (list_stream.py), by digest,
        # with the start of their listing: kept apart from the finished
        # listings (MANIFESTS_KEPT) and dropped once a later listing ends.
        self._prefixes: dict[str, dict[str, tuple[Any, Manifest, float]]] = {}
        # dataset -> (token, start) of the listing under way, and its latest
        # prefix as (start of its listing, reference, digest)
        self._listing: dict[str, tuple[str, float]] = {}
        self._leading: dict[str, tuple[float, Any, str]] = {}
        self._changed: dict[str, asyncio.Event] = {}  # a prefix or an end
        self._failed: set[tuple[str, float]] = set()  # listings that failed

    def held(self, dataset: str, digest: str) -> tuple[Any, Manifest] | None:
        found = self._held.get(dataset, {}).get(digest)
        if found is None:
            prefix = self._prefixes.get(dataset, {}).get(digest)
            found = None if prefix is None else (prefix[0], prefix[1])
        return found

    async def adopt(self, dataset: str, digest: str, ref: Any) -> Manifest:
        """Keep a manifest another store published; returns it mapped."""
        found = self.held(dataset, digest)
        if found is not None:
            return found[1]
        manifest = await self._map(ref)
        if manifest.is_prefix:
            prefixes = self._prefixes.setdefault(dataset, {})
            prefixes[digest] = (ref, manifest, time.time())
            return manifest
        # Another store's finished listing: the prefixes of it held here are
        # answered with it (a rank or worker here may still name one).
        for old, (_, prefix, began) in list(self._prefixes.get(dataset, {}).items()):
            if prefix.is_prefix and extends(manifest, prefix):
                self._prefixes[dataset][old] = (ref, manifest, began)
        self._hold(dataset, digest, ref, manifest)
        return manifest

    def _hold(self, dataset: str, digest: str, ref: Any, manifest: Manifest) -> None:
        """Hold a finished listing under ``digest`` (the newest, replacing one
        held there), at most ``MANIFESTS_KEPT`` per dataset."""
        kept = self._held.setdefault(dataset, {})
        kept.pop(digest, None)
        kept[digest] = (ref, manifest)
        while len(kept) > MANIFESTS_KEPT:
            kept.pop(next(iter(kept)))

    async def _map(self, ref: Any) -> Manifest:
        value = self._get(ref)
        if inspect.isawaitable(value):
            value = await value
        return Manifest.from_object(value)

    def _on_prefix(self, dataset: str, started: float) -> PrefixSink:
        def keep(ref: Any, manifest: Manifest) -> None:
            digest = manifest.digest
            self._point_prefixes(dataset, started, ref, manifest)
            self._prefixes[dataset][digest] = (ref, manifest, started)
            self._leading[dataset] = (started, ref, digest)
            self._wake(dataset)

        return keep

    def _point_prefixes(
        self, dataset: str, started: float, ref: Any, manifest: Manifest
    ) -> None:
        """Answer the earlier prefixes of the listing begun at ``started`` with
        a longer one (or the whole): it holds their chunks, the same ones at
        the same places, so a rank or build still naming an earlier digest
        reads the same members, and only the longest copy stays held (the
        copies would add up to about twice the listing)."""
        prefixes = self._prefixes.setdefault(dataset, {})
        for digest, (_, _, began) in list(prefixes.items()):
            if began == started:
                prefixes[digest] = (ref, manifest, started)

    def _wake(self, dataset: str) -> None:
        event = self._changed.pop(dataset, None)
        if event is not None:
            event.set()

    def leading(self, dataset: str, digest: str) -> tuple[Any, str, str] | None:
        """What follows prefix ``digest`` of ``dataset``: ``(reference,
        digest, state)``, the longest prefix of its listing so far
        (``"listing"``) or the finished listing (``"done"``); ``state``
        ``"failed"`` when that listing failed. ``None``: not a prefix this
        store knows."""
        entry = self._prefixes.get(dataset, {}).get(digest)
        if entry is None:
            return None
        ref, manifest, started = entry
        if not manifest.is_prefix:
            return ref, manifest.digest, "done"
        if (dataset, started) in self._failed:
            return ref, digest, "failed"
        lead = self._leading.get(dataset)
        if lead is not None and lead[0] == started:
            return lead[1], lead[2], "listing"
        return ref, digest, "listing"

    async def publish_early(
        self, spec: dict[str, Any], token: str = ""
    ) -> tuple[Any, str, Manifest, asyncio.Future[Any] | None]:
        """As :meth:`publish`, but answers with the first prefix of whole
        chunks when the listing that answers ``token`` publishes one before
        it ends (a listing longer than ``stream_after_s``); the listing goes
        on (the last item: its task, ``None`` once it ended), and
        :meth:`leading` gives what follows."""
        name = spec["name"]
        arrived = time.time()
        listing = asyncio.ensure_future(self.publish(spec, token, stream=True))
        # Answered early, its error is raised to the next caller, not here.
        listing.add_done_callback(lambda f: f.cancelled() or f.exception())
        while not listing.done():
            lead, running = self._leading.get(name), self._listing.get(name)
            # Only a prefix of the listing that answers this call: one begun
            # after it (or this token's own, for another rank of the job).
            if (
                lead is not None
                and running is not None
                and lead[0] == running[1]
                and (running[1] >= arrived or (token and running[0] == token))
            ):
                _, ref, digest = lead
                mapped = self.held(name, digest)[1]  # type: ignore[index]
                return ref, digest, mapped, listing
            event = self._changed.setdefault(name, asyncio.Event())
            waiter = asyncio.ensure_future(event.wait())
            await asyncio.wait({listing, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        return (*listing.result(), None)

    def published(self, dataset: str, token: str) -> tuple[Any, str] | None:
        """What this store published for ``token``: ``""``, its latest
        listing; ``"max-age/N"``, its latest if begun within N seconds; any
        other token (a job's start, a refresh round), the listing that first
        answered it."""
        if not token:
            digest = self._published.get(dataset)
        elif token.startswith(MAX_AGE_TOKEN):
            max_age_s = float(token[len(MAX_AGE_TOKEN) :])
            began = self._published_at.get(dataset, 0.0)
            recent = began > time.time() - max_age_s
            digest = self._published.get(dataset) if recent else None
        else:
            seen = self._tokens.get(dataset, {}).get(token)
            fresh = seen is not None and seen[0] > time.time() - REFRESH_TOKEN_TTL_S
            if fresh and seen is not None:
                # The very listing that answered the token, not whichever
                # listing now holds its digest (a later one of the same
                # objects may carry other chunks' prefix ends).
                return seen[2], seen[1]
            digest = None
        found = self.held(dataset, digest) if digest is not None else None
        return None if found is None else (found[0], digest)  # type: ignore[return-value]

    def answered(self, dataset: str, token: str) -> Manifest | None:
        """The mapped listing that answered ``token`` (see :meth:`published`)."""
        seen = self._tokens.get(dataset, {}).get(token)
        return None if seen is None else seen[3]

    def _remember(self, name: str, token: str, started: float, digest: str) -> None:
        """``token`` is answered by the listing held under ``digest`` now."""
        tokens = self._tokens.setdefault(name, {})
        tokens[token] = (started, digest, *self._held[name][digest])
        for old in [
            t for t, v in tokens.items() if v[0] < started - REFRESH_TOKEN_TTL_S
        ]:
            del tokens[old]

    def _latest_ref(self, dataset: str) -> Any:
        digest = self._published.get(dataset)
        found = self.held(dataset, digest) if digest is not None else None
        return None if found is None else found[0]

    def _token_manifest(self, name: str, token: str, digest: str) -> Manifest:
        mapped = self.answered(name, token)
        return mapped if mapped is not None else self._held[name][digest][1]

    async def publish(
        self, spec: dict[str, Any], token: str = "", *, stream: bool = False
    ) -> tuple[Any, str, Manifest]:
        """List ``spec`` once (concurrent callers share it) and hold the result.
        ``stream``: publish prefixes while it runs (:meth:`publish_early`)."""
        name = spec["name"]
        arrived = time.time()
        while (running := self._inflight.get(name)) is not None:
            # A listing already under way (another job started at the same
            # moment, or another refresh round). If it began before this
            # call it may predate a change this call must see: wait for it,
            # then list again (or join one begun since). Either way the
            # token remembers what answered it, so the rest of this job's
            # ranks read the very same listing.
            fut, began = running
            ref, digest = await asyncio.shield(fut)
            answered = self.published(name, token) if token else None
            if answered is not None:  # this token's own listing (another rank)
                ref, digest = answered
                return ref, digest, self._token_manifest(name, token, digest)
            if began >= arrived or not token or token.startswith(MAX_AGE_TOKEN):
                self._remember(name, token, time.time(), digest)
                return ref, digest, self._held[name][digest][1]
        fut: asyncio.Future[tuple[Any, str]] = (
            asyncio.get_running_loop().create_future()
        )
        started = time.time()
        self._inflight[name] = (fut, started)
        self._listing[name] = (token, started)
        try:
            listed = await self._lister(
                spec,
                self._latest_ref(name),
                self.spans.room(),
                self._on_prefix(name, started) if stream else None,
            )
            ref, digest = listed.ref, listed.digest
            # This listing's own object, even where an earlier one of the same
            # objects is held under the digest: its prefix ends and chunks
            # are what this listing's ranks read.
            manifest = await self._map(ref)
            self._hold(name, digest, ref, manifest)
            kept = self._held[name]
            self.spans.hold(
                name,
                listed.spans,
                manifest if isinstance(manifest, PackedManifest) else None,
            )
            if listed.report.get("over"):
                self.over_budget[name] = listed.report
                log.warning(
                    "dataset %s: %d units (%d bytes) over the span budget of %d "
                    "bytes; their builds read the source again",
                    name,
                    listed.report["over"],
                    listed.report["over_bytes"],
                    self.spans.budget_bytes,
                )
            self._published[name] = digest
            self._published_at[name] = started
            self._remember(name, token, started, digest)
            # A failed listing's prefixes are read by nobody new, nor are
            # those of a finished listing no longer held; this one's are
            # answered with it from now on (its ranks still name them).
            prefixes = self._prefixes.get(name, {})
            for old in [
                d
                for d, (_, m, began) in prefixes.items()
                if began < started and (m.is_prefix or m.digest not in kept)
            ]:
                del prefixes[old]
            self._point_prefixes(name, started, ref, manifest)
            fut.set_result((ref, digest))
            return ref, digest, manifest
        except BaseException as exc:
            self._failed.add((name, started))  # its prefixes lead nowhere
            fut.set_exception(exc)
            fut.exception()  # retrieved: callers that share it re-raise their own
            raise
        finally:
            self._inflight.pop(name, None)
            self._listing.pop(name, None)
            self._leading.pop(name, None)
            self._wake(name)

"""The read path's declared interface: the calls a rank makes, and a chunk's status.

Where the cut is: everything above a :class:`Transport` (the dataset, its
reader and sampler, the checksum checks, the usage reports) is the same on
every read path; a transport only carries the calls below to the cluster and
the chunk columns back. A transport owns its connections and retries and
maps its backend's failures to the project's errors (``shardcache.errors``);
it never decides what to read, in which order, or how to count it. So a new
path (or a test double) implements these methods and nothing above changes,
as an httpx transport implements ``handle_request`` under the client.

Today's transports: ``direct.CacheClient`` (a Ray process, its node's
store), ``unix.EndpointClient`` (this node's cache worker over a Unix
socket) and ``flight.FlightClient`` (another node's cache worker over Arrow
Flight); ``read_path.open_client`` picks one.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from shardcache.config import ClientConfig
from shardcache.manifest import ChunkItem, Manifest

__all__ = ["Status", "Transport"]


class Status(enum.StrEnum):
    """What a store did for one chunk of a request.

    A ``str`` enum: the values are the strings stores, endpoints, Redis and
    JSON carry, so ``Status.HIT == "hit"`` and a reply is unchanged on the wire.

    >>> Status("remote-hit").origin, Status.UNCACHED.origin, Status.HIT == "hit"
    ('peer', 'source', True)
    >>> Status.DISK.origin, Status.DISK_READ.origin
    ('disk', 'disk')
    """

    HIT = "hit"  # held by the store that answered
    REMOTE_HIT = "remote-hit"  # held by another node's store
    FETCHED = "fetched"  # read from the source for this request, now held
    UNCACHED = "uncached"  # read from the source, not held (the policy said no)
    UNINSTALLED = "uninstalled"  # the store lost the dataset's install (restarted)
    ERROR = "error"  # the item failed: the result carries (error type, message)
    # On this node's disk tier, not in memory: the result carries the chunk
    # file's path (its header checked by the store) for the rank to map
    # read-only, so only the pages of the rows it gathers are read. Only
    # sent to a caller on the store's node that asked for files.
    DISK = "disk"
    # Read from this node's disk tier for this request into the object store,
    # not held in memory (a chunk larger than the whole budget, or a caller
    # that cannot map the file): no source read, kept by the caller only for
    # the coming batches, as UNCACHED is.
    DISK_READ = "disk-read"

    @property
    def origin(self) -> str:
        """Where a delivered sample came from, as the usage figures count it:
        ``local``, ``disk``, ``peer`` or ``source`` (``shardcache.usage.ORIGINS``)."""
        if self in (Status.FETCHED, Status.UNCACHED):
            return "source"
        if self in (Status.DISK, Status.DISK_READ):
            return "disk"
        return "peer" if self is Status.REMOTE_HIT else "local"

    def across_nodes(self) -> Status:
        """This answer as a rank on another node counts it: a hit on the
        answering store (its memory or its disk tier) is a peer hit there.

        >>> Status.HIT.across_nodes(), Status.FETCHED.across_nodes()
        (<Status.REMOTE_HIT: 'remote-hit'>, <Status.FETCHED: 'fetched'>)
        """
        if self in (Status.HIT, Status.DISK_READ):
            return Status.REMOTE_HIT
        return self


@runtime_checkable
class Transport(Protocol):
    """One process's way to the cache: the index calls, manifests and chunks.

    The cut: the dataset, reader and usage reports call only these members and
    never ask which transport they hold; the transport carries the calls and
    the chunk columns, owns its connections and retries, and raises only the
    project's errors (see the module docstring).

    Attributes:
        config: the client settings it was opened with.
        needs_ray: the process joins Ray to read (it cannot be forked from a
            Ray driver, and it can ship Python objects to the stores).
        remote: chunks cross the network to reach this process; it then
            counts ``received_bytes`` and ``received_s``.
        index: the ``RedisIndex`` calls a rank makes (register, generation,
            invalidate, record_rank, entries, and ``index.client`` for usage).
        redis_url: the index's URL, or ``""`` when the index is reached
            through a cache worker.
    """

    config: ClientConfig
    needs_ray: bool
    remote: bool
    index: Any
    redis_url: str

    @property
    def retryable_errors(self) -> tuple[type[Exception], ...]:
        """Errors a background prefetch swallows (the loop asks again)."""
        ...

    def manifest(
        self, spec: dict[str, Any], token: str = "", *, early: bool = False
    ) -> tuple[Any, str]:
        """``(handle, digest)`` of the dataset's listing, listed once per cluster;
        ``token`` asks for a new listing (every rank of a refresh passes the
        same one), ``""`` takes the published one. ``early``: the first whole
        chunks of a listing that runs long may answer (``is_prefix``)."""
        ...

    def leading(self, name: str, digest: str) -> tuple[Any, str, str] | None:
        """What follows prefix ``digest`` of ``name``'s listing: ``(handle,
        digest, state)``, its longest prefix so far (``"listing"``), the
        finished listing (``"done"``) or ``"failed"``; ``None`` if unknown."""
        ...

    def manifest_of(self, name: str, digest: str) -> Any:
        """The handle of listing ``digest`` of ``name`` (a DataLoader worker
        maps the manifest its parent read).

        Raises:
            StaleVersionError: no store holds that listing any more.
        """
        ...

    def map_manifest(self, handle: Any) -> Manifest:
        """The :class:`Manifest` behind a handle (zero-copy where it can)."""
        ...

    def install(
        self,
        spec: dict[str, Any],
        preprocess: Callable[[bytes], Any],
        target: Callable[[str], Any] | None = None,
    ) -> None:
        """Hand the stores what they need to build this dataset's chunks: the
        fetch settings, preprocess and target (not the index's dataset record,
        which ``index.register`` creates).

        Raises:
            ConfigError: the stores cannot load ``preprocess`` or ``target``.
        """
        ...

    def resolve(
        self,
        name: str,
        generation: int,
        items: Sequence[ChunkItem],
        digest: str | None = None,
        *,
        prefer_files: bool = False,
        reader: str = "",
    ) -> list[tuple[str, Any]]:
        """``(Status, columns)`` per item, in order; columns are read-only
        views (the object store, shared memory or the received stream).
        ``prefer_files``: the caller keeps no chunk from memory between
        batches, so a chunk on the node's disk tier is better handed as its
        file (mapped, kept for the epoch, pinning no memory) where the
        transport can. ``reader``: the reading asked for (``job:epoch``, or
        ""): a chunk built from the source for that reading comes back
        ``FETCHED`` to every rank of it, not only to the one that asked first.

        Raises:
            StaleVersionError: ``generation`` was invalidated meanwhile.
            ShardCacheError: the first failing item's error, as its own type.
            ShardUnavailable: the cache did not answer.
        """
        ...

    def drop_corrupt(
        self, name: str, generation: int, chunk: str, version: str
    ) -> bool:
        """Tell the cache that ``chunk`` fails its checksum here, so the next
        request builds it again; True if a store dropped it."""
        ...

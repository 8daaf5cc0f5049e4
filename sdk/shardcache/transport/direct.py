"""The direct transport: a Ray process reads its node's store and the Redis index."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from shardcache import errors
from shardcache.chunk_file import read_chunk_file
from shardcache.code_paths import is_installed
from shardcache.config import ClientConfig
from shardcache.daemon_pool import EXITING, Abandoned, in_pool
from shardcache.errors import (
    ChunkFileError,
    ConfigError,
    ShardCacheError,
    ShardUnavailable,
)
from shardcache.index import RedisIndex
from shardcache.manifest import Manifest
from shardcache.starters import store_starter
from shardcache.transport.base import Status

__all__ = ["CacheClient", "DatasetSpec"]

log = logging.getLogger(__name__)

STORE_RETRIES = 3  # a restarted store is re-registered and asked again

# name, urls, protocol, storage_options, fingerprint, generation, manifest digest,
# chunk_bytes, chunk_samples
DatasetSpec = dict[str, Any]


WAIT_SLICE_S = 0.2  # a look-ahead thread's wait on Ray, between checks for exit


def _get(refs: Any, timeout: float | None) -> Any:
    """``ray.get(refs, timeout=timeout)``; on a look-ahead (daemon pool)
    thread in slices, so it leaves Ray as the process exits (``Abandoned``)
    instead of being inside it when Ray shuts down (daemon_pool.py)."""
    import ray

    many = isinstance(refs, list)
    if not in_pool() or (many and not refs):
        return ray.get(refs, timeout=timeout)
    wanted = refs if many else [refs]
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ready, _ = ray.wait(wanted, num_returns=len(wanted), timeout=WAIT_SLICE_S)
        if len(ready) == len(wanted):
            return ray.get(refs)
        if EXITING.is_set():
            raise Abandoned("the process is exiting")
        if deadline is not None and time.monotonic() > deadline:
            raise ray.exceptions.GetTimeoutError(
                f"the store did not answer within {timeout} s"
            )


def _map_chunk_file(path: str, item: tuple[str, str, int]) -> Any:
    """The columns of a disk-tier chunk file, mapped read-only, or ``None``
    if it is gone or no longer holds that chunk version (replaced since the
    store checked it)."""
    try:
        columns, meta = read_chunk_file(path)
    except ChunkFileError:
        return None
    chunk, version, _ = item
    if meta.get("chunk") != chunk or meta.get("version") != version:
        return None
    return columns


def _pickle_user_code_by_value(fn: Callable[..., Any]) -> None:
    """Ship a preprocess defined in the job's script or the user's own
    module by value.

    A function from ``__main__`` (or ``__mp_main__`` in a spawned rank) is
    not importable on the stores. One from the user's ``decode.py`` is, but
    by name: a store or build process kept across scripts resolves the name
    in the module it imported for an earlier script (the old code, or no
    such function at all), while this rank fingerprinted the code as it is
    now. By value, the cache runs exactly that code. A function whose
    module-level values cannot be pickled (a lock, an open handle) keeps
    travelling by name, as before.
    """
    import sys

    import ray.cloudpickle

    target = getattr(fn, "func", fn)  # functools.partial
    module = sys.modules.get(getattr(target, "__module__", "") or "")
    if module is None:
        return
    if module.__name__ in ("__main__", "__mp_main__"):
        ray.cloudpickle.register_pickle_by_value(module)
        return
    if module.__name__.partition(".")[0] == "shardcache":
        # The library's own decoders (the default ``.npy`` decode) go by
        # name even from a source checkout: the stores run the same package,
        # and the builder knows them by identity (``.npy`` files read
        # straight into the chunk's column). By value they arrived as a copy
        # that no identity test matched, and every build took the general
        # path: two more copies of every byte.
        return
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or is_installed(path):
        return
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        ray.cloudpickle.dumps(fn)
    except Exception:  # noqa: BLE001 (any pickling failure: by name instead)
        ray.cloudpickle.unregister_pickle_by_value(module)


class CacheClient:
    """Talks to the index and to this node's store; one per process.

    Args:
        config: where Redis and Ray are. Nothing connects until first use.
    """

    needs_ray = True
    remote = False  # chunks come from this node's object store (or Ray moves them)

    def __init__(self, config: ClientConfig | None = None):
        self.config = config or ClientConfig()
        self._index: RedisIndex | None = None
        self._redis_url: str | None = self.config.redis_url
        self._store: Any = None
        self._installed: dict[str, tuple[DatasetSpec, tuple[Any, ...]]] = {}
        self._maps_files = True  # may be handed disk-tier files (same node)

    # -- connections -------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        if self._redis_url is None:
            from shardcache.embedded import local_redis_url

            self._redis_url = local_redis_url()
        return self._redis_url

    @property
    def index(self) -> RedisIndex:
        if self._index is None:
            self._index = RedisIndex.from_url(self.redis_url, self.config.namespace)
        return self._index

    def attach(self) -> None:
        """Join Ray and make sure every node has a store (idempotent)."""
        from shardcache.embedded import attach_ray

        attach_ray(self.config.ray_address)
        if self.config.ray_address is None:
            import ray

            # DataLoader workers get this config pickled: they must join the
            # cluster this process joined, not look for one of their own.
            self.config.ray_address = ray.get_runtime_context().gcs_address
        if self._store is None:
            self._store = self._start_stores()

    def _start_stores(self) -> Any:
        import ray

        # Redis first: a wrong redis_url fails here in seconds, naming it,
        # and no store is started with a Redis it could never reach.
        _ = self.index
        # The embedded default starts the stores itself when nobody deployed
        # them: through the named hook, so the sdk imports no cluster code.
        handles = store_starter("ray")(self.redis_url, self.config.namespace)
        node = ray.get_runtime_context().get_node_id()
        if node not in handles:
            raise ShardUnavailable(f"no cache store on this process's Ray node {node}.")
        return handles[node]

    # -- datasets ---------------------------------------------------------------
    def manifest(
        self, spec: DatasetSpec, token: str = "", *, early: bool = False
    ) -> tuple[Any, str]:
        """``(reference, digest)`` of the dataset's listing, listed once per cluster.

        ``token`` asks for a new listing: every rank of a job refreshing
        together passes the same one and one listing answers them all;
        ``""`` (construction) takes the published listing. ``early``: a
        listing that runs long may answer with its first whole chunks.
        """
        import ray

        self.attach()
        ref, digest = self._call(
            lambda: ray.get(
                self._store.manifest.remote(spec, token, early=early),
                timeout=self.config.request_timeout_s,
            )
        )
        return ref, str(digest)

    def leading(self, name: str, digest: str) -> tuple[Any, str, str] | None:
        """What follows prefix ``digest`` of ``name``'s listing: ``(reference,
        digest, state)``, ``state`` one of ``"listing"``, ``"done"``,
        ``"failed"``; ``None`` when no store knows that prefix."""
        import ray

        self.attach()
        got = self._call(
            lambda: ray.get(
                self._store.leading.remote(name, digest),
                timeout=self.config.request_timeout_s,
            )
        )
        return (got[0], str(got[1]), str(got[2])) if got else None

    def manifest_of(self, name: str, digest: str) -> Any:
        """The reference of listing ``digest`` (a DataLoader worker maps the
        manifest its parent read).

        Raises:
            StaleVersionError: no store holds that listing any more.
        """
        import ray

        self.attach()
        refs = self._call(
            lambda: ray.get(
                self._store.manifest_of.remote(name, digest),
                timeout=self.config.request_timeout_s,
            )
        )
        if not refs:
            raise errors.StaleVersionError(
                f"the listing {digest} of dataset {name!r} is no longer held by the "
                "stores (restarted). Build the dataset again or call refresh()."
            )
        return refs[0]

    @staticmethod
    def map_manifest(ref: Any) -> Manifest:
        """Map a published manifest from the object store (zero-copy)."""
        import ray

        return Manifest.from_object(ray.get(ref))

    @property
    def retryable_errors(self) -> tuple[type[Exception], ...]:
        """Errors a background prefetch swallows (the loop asks again)."""
        import ray

        return (errors.BackendError, errors.StaleVersionError, ray.exceptions.RayError)

    def resolve(
        self,
        name: str,
        generation: int,
        items: Sequence[tuple[str, str, int]],
        digest: str | None = None,
        *,
        prefer_files: bool = False,
        reader: str = "",
    ) -> list[tuple[str, Any]]:
        """``(status, columns)`` per chunk: :meth:`get_refs` then one ``ray.get``
        (zero-copy views of this node's object store). A chunk the store
        answers with its disk-tier file (``Status.DISK``) is mapped here
        read-only, so only the pages of the rows gathered are read; a file
        gone before it is opened (the disk budget deleted it) is asked for
        once more without files, and the store reloads or rebuilds it.

        Raises:
            the errors of :meth:`get_refs`; ``ray.exceptions.GetTimeoutError``.
        """
        import ray

        for attempt in range(2):
            results = self.get_refs(
                name,
                generation,
                items,
                digest,
                files=self._maps_files,
                prefer_files=prefer_files and self._maps_files,
                reader=reader,
            )
            values: list[Any] = [None] * len(results)
            gone = []
            for j, (status, path) in enumerate(results):
                if status == Status.DISK:
                    values[j] = _map_chunk_file(path, items[j])
                    if values[j] is None:
                        gone.append(j)
            if gone:
                folder = os.path.dirname(results[gone[0]][1])
                if not os.path.isdir(folder):
                    # Not a deleted file: this process does not see the store's
                    # disk (another container's filesystem). Stop asking.
                    log.warning(
                        "the store's disk tier %s is not visible from this "
                        "process; chunks on it are reloaded into memory instead",
                        folder,
                    )
                    self._maps_files = False
                again = self.get_refs(
                    name, generation, [items[j] for j in gone], digest, reader=reader
                )
                for j, res in zip(gone, again, strict=True):
                    results[j] = res
            refs = [j for j, (status, _) in enumerate(results) if status != Status.DISK]
            try:
                got = _get([results[j][1] for j in refs], self.config.request_timeout_s)
                break
            except ray.exceptions.ObjectLostError:
                # The store that owned these chunks died after answering
                # (OwnerDiedError is an ObjectLostError): ask again, within
                # this batch; the client reaches the store's successor.
                if attempt == 1:
                    raise
        for j, value in zip(refs, got, strict=True):
            values[j] = value
        return [
            (status, value) for (status, _), value in zip(results, values, strict=True)
        ]

    def drop_corrupt(
        self, name: str, generation: int, chunk: str, version: str
    ) -> bool:
        """Tell the stores that ``chunk`` fails its checksum: its holder drops
        it, so the next request builds it again. True if a store dropped it."""
        import ray

        self.attach()
        return bool(
            self._call(
                lambda: ray.get(
                    self._store.drop_corrupt.remote(name, generation, chunk),
                    timeout=self.config.request_timeout_s,
                )
            )
        )

    def install(
        self,
        spec: DatasetSpec,
        preprocess: Callable[[bytes], Any],
        target: Callable[[str], Any] | None = None,
    ) -> None:
        """Hand the dataset's fetch settings, preprocess and target to the stores."""
        import ray

        self.attach()
        _pickle_user_code_by_value(preprocess)
        for fn in (target, (spec.get("variants") or {}).get("augment")):
            if fn is not None:
                _pickle_user_code_by_value(fn)
        fns = (preprocess, target)
        self._installed[spec["name"]] = (spec, fns)
        try:
            self._call(
                lambda: ray.get(
                    self._store.install.remote(spec, *fns),
                    timeout=self.config.request_timeout_s,
                )
            )
        except (ray.exceptions.RayTaskError, ray.exceptions.RaySystemError) as exc:
            cause = str(exc).strip().splitlines()[-1]
            raise ConfigError(
                f"the cache stores could not load preprocess "
                f"{getattr(preprocess, '__qualname__', preprocess)!r}: {cause}. Define it "
                "at module level in an importable module (or in the script itself) and "
                "make its imports available on the cluster."
            ) from None

    def get_refs(
        self,
        name: str,
        generation: int,
        items: Sequence[tuple[str, str, int]],
        digest: str | None = None,
        *,
        files: bool = False,
        prefer_files: bool = False,
        reader: str = "",
    ) -> list[tuple[str, Any]]:
        """One store call for many chunks: ``(status, ObjectRef)`` per item.

        ``items`` are ``(chunk key, chunk version, source bytes)``; ``digest``
        names the listing their versions come from. ``files``: this process
        maps chunk files, so a chunk only on the node's disk tier may come
        back as ``(Status.DISK, path)`` instead of a reference;
        ``prefer_files``: a chunk held in memory too, where its file is
        written; ``reader``: the reading asked for (see the store's ``get``).

        Raises:
            StaleVersionError: ``generation`` was invalidated meanwhile.
            PreprocessError, RemoteFetchError, ...: the first failing item's error.
            ShardUnavailable: the store did not come back.
        """
        import ray

        self.attach()
        for _attempt in range(STORE_RETRIES + 1):
            results = self._call(
                lambda: _get(
                    self._store.get.remote(
                        name,
                        generation,
                        list(items),
                        digest=digest,
                        files=files,
                        prefer_files=prefer_files,
                        reader=reader,
                    ),
                    self.config.request_timeout_s,
                )
            )
            if results and results[0][0] == Status.UNINSTALLED:
                spec, fns = self._installed[name]
                spec = {**spec, "generation": generation}
                self._call(
                    lambda spec=spec, fns=fns: ray.get(
                        self._store.install.remote(spec, *fns)
                    )
                )
                continue
            for res in results:
                if res[0] == Status.ERROR:
                    raise errors.error_type(res[1])(res[2])
            return [(r[0], r[1]) for r in results]
        raise ShardUnavailable(
            f"the store kept losing dataset {name!r}; see the store logs."
        )

    def _call(self, fn: Callable[[], Any]) -> Any:
        import ray

        last: Exception | None = None
        for attempt in range(STORE_RETRIES + 1):
            try:
                return fn()
            except (
                ray.exceptions.RayActorError,
                ray.exceptions.ActorUnavailableError,
            ) as exc:
                # The store died: Ray restarts it (max_restarts) or we start a
                # new one; either way it has lost its cache and re-fetches.
                last = exc
                time.sleep(min(2.0, 0.2 * 2**attempt))
                self._store = self._start_stores()
                for spec, fns in self._installed.values():
                    ray.get(self._store.install.remote(spec, *fns))
            except ray.exceptions.RayTaskError as exc:
                # The store raised one of our errors (a listing that found
                # nothing, a bad URL): surface it as itself, not as a Ray error.
                if isinstance(exc.cause, ShardCacheError):
                    raise exc.cause from None
                raise
            except ray.exceptions.GetTimeoutError as exc:
                raise ShardUnavailable(
                    f"the cache store did not answer within {self.config.request_timeout_s:.0f}s. "
                    "Raise SHARDCACHE_REQUEST_TIMEOUT_S or check the source's latency."
                ) from exc
        raise ShardUnavailable(
            f"the cache store on this node keeps failing: {last}"
        ) from last

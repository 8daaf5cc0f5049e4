"""The client both cache-worker transports share: the Ray path's calls, as requests.

A process that reaches the cluster through a cache worker (the node-local
endpoint's Unix socket, or another node's Flight service) sends the same
operations a Ray rank makes: the index calls a rank may make (a fixed
list), the usage counters, registration, manifests and chunks. Subclasses
move the bytes; everything above them is the same.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardcache import errors
from shardcache.config import ClientConfig
from shardcache.errors import ConfigError, EndpointUnavailable, IndexUnavailable
from shardcache.manifest import Manifest
from shardcache.transport.wire import MAX_FDS_PER_FRAME, callable_name

__all__ = ["ProxyClient"]


class _UsageScript:
    """``redis.Redis.register_script`` stand-in: the endpoint runs the usage
    script (only it, checked by hash) on the keys of this namespace."""

    def __init__(self, client: ProxyClient, source: str):
        self.client = client
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self.client.call_index(
            "usage_apply", sha=self.sha, keys=list(keys), args=list(args)
        )


class _UsageRedis:
    """What ``UsageReporter`` and ``UsageReader.totals`` need of a Redis client."""

    def __init__(self, client: ProxyClient):
        self.client = client

    def register_script(self, source: str) -> _UsageScript:
        return _UsageScript(self.client, source)

    def hgetall(self, key: str) -> dict[str, str]:
        return dict(self.client.call_index("usage_hgetall", key=key))

    def hset(self, key: str, field: str, value: str) -> int:
        return int(
            self.client.call_index("usage_hset", key=key, field=field, value=value)
        )


class _ProxyIndex:
    """The ``RedisIndex`` methods a rank uses, answered by the cache worker."""

    def __init__(self, client: ProxyClient):
        self._client = client
        self.client = _UsageRedis(client)

    def register(
        self, name: str, source: str, fp: str, objects: int, total_bytes: int
    ) -> int:
        return int(
            self._client.call_index(
                "register",
                name=name,
                source=source,
                fp=fp,
                objects=objects,
                total_bytes=total_bytes,
            )
        )

    def register_change(
        self, name: str, source: str, fp: str, objects: int, total_bytes: int
    ) -> tuple[int, str | None]:
        generation, previous = self._client.call_index(
            "register_change",
            name=name,
            source=source,
            fp=fp,
            objects=objects,
            total_bytes=total_bytes,
        )
        return int(generation), previous

    def generation(self, name: str) -> int:
        return int(self._client.call_index("generation", name=name))

    def invalidate(self, name: str, call: str = "", reading: int = 0) -> int:
        # Named calls only: an endpoint of the last release takes ``name`` alone.
        named = {"call": call, "reading": reading} if call else {}
        return int(self._client.call_index("invalidate", name=name, **named))

    def record_rank(
        self, name: str, job: str, rank: int, report: dict[str, Any]
    ) -> None:
        self._client.call_index(
            "record_rank", name=name, job=job, rank=rank, report=report
        )

    def entries(
        self, name: str, generation: int, paths: Sequence[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        return dict(
            self._client.call_index(
                "entries",
                name=name,
                generation=generation,
                paths=None if paths is None else list(paths),
            )
        )


class ProxyClient:
    """A :class:`Transport` whose cluster is reached through a cache worker.

    Subclasses provide ``call(op, **args)`` (one request, one JSON reply) and
    ``_chunks`` / ``_manifest_columns`` (the bytes). ``remote`` marks chunks
    that crossed the network (their samples count as ``peer``).
    """

    needs_ray = False
    remote = False

    def __init__(self, config: ClientConfig):
        self.config = config
        self.redis_url = ""  # the index is the cache worker's
        self.index = _ProxyIndex(self)
        # dataset -> (spec, preprocess/target names): replayed to a restarted endpoint
        self._names: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

    # transport ------------------------------------------------------------------
    def call(self, op: str, **args: Any) -> Any:
        raise NotImplementedError

    def _chunks(
        self, request: dict[str, Any]
    ) -> list[tuple[str, dict[str, np.ndarray]]]:
        """``(status, columns)`` per item of one ``get`` request."""
        raise NotImplementedError

    def _manifest_columns(
        self, op: str, **args: Any
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        raise NotImplementedError

    def call_index(self, op: str, **args: Any) -> Any:
        """An index or usage call; a failed transport reads as Redis being away,
        so the callers' outage handling (buffered stats) applies unchanged."""
        try:
            return self.call(op, **args)
        except EndpointUnavailable as exc:
            raise IndexUnavailable(
                f"the index is reached through the cache worker: {exc}"
            ) from exc

    # the Transport interface ---------------------------------------------------------
    @property
    def retryable_errors(self) -> tuple[type[Exception], ...]:
        """Errors a background prefetch swallows (the loop asks again)."""
        return (errors.BackendError, errors.StaleVersionError)

    def manifest(
        self, spec: dict[str, Any], token: str = "", *, early: bool = False
    ) -> tuple[Manifest, str]:
        # The endpoint answers with the whole listing (``early`` not served).
        columns, meta = self._manifest_columns("manifest", spec=spec, token=token)
        return _manifest(columns, meta), str(meta["digest"])

    def leading(self, name: str, digest: str) -> tuple[Any, str, str] | None:
        return None  # never answered early: no listing is followed

    def manifest_of(self, name: str, digest: str) -> Manifest:
        columns, meta = self._manifest_columns("manifest_of", name=name, digest=digest)
        return _manifest(columns, meta)

    @staticmethod
    def map_manifest(handle: Manifest) -> Manifest:
        return handle

    def install(
        self,
        spec: dict[str, Any],
        preprocess: Callable[[bytes], Any],
        target: Callable[[str], Any] | None = None,
    ) -> None:
        """Name the dataset's preprocess and target to the cache worker, which
        imports them (see :func:`callable_name`).

        Raises:
            ConfigError: the dataset has augmented variants, which this path
                cannot install (``augment`` travels to the stores through Ray).
        """
        if spec.get("variants"):
            raise ConfigError(
                "variants=/augment= need a process on a Ray node (torchrun on "
                "the cache's Ray nodes, or Ray Train): augment is shipped to the "
                "stores through Ray, and this process reads through the node's "
                "cache worker. Apply the augmentation as transform= here instead."
            )
        previous = self._names.get(spec["name"])
        names = (
            previous[1]
            if previous is not None
            else {
                "preprocess": callable_name(preprocess, "preprocess"),
                "target": callable_name(target, "target"),
            }
        )
        self._names[spec["name"]] = (spec, names)
        self.call("install", spec=spec, **names)

    def drop_corrupt(
        self, name: str, generation: int, chunk: str, version: str
    ) -> bool:
        """Tell the cache worker that ``chunk`` fails its checksum here: it
        drops its file and the store's copy, so the next ``get`` rebuilds it."""
        return bool(
            self.call(
                "drop_corrupt",
                name=name,
                generation=generation,
                chunk=chunk,
                version=version,
            )
        )

    def resolve(
        self,
        name: str,
        generation: int,
        items: list[tuple[str, str, int]],
        digest: str | None,
        *,
        prefer_files: bool = False,
        reader: str = "",
    ) -> list[tuple[str, dict[str, np.ndarray]]]:
        """``(status, columns)`` per chunk; columns view shared memory (local)
        or the received stream (remote). ``prefer_files`` changes nothing:
        the endpoint hands a local chunk as a file already."""
        out: list[tuple[str, dict[str, np.ndarray]]] = []
        for i in range(0, len(items), MAX_FDS_PER_FRAME):
            out += self._chunks(
                {
                    "op": "get",
                    "name": name,
                    "generation": generation,
                    "items": [list(item) for item in items[i : i + MAX_FDS_PER_FRAME]],
                    "digest": digest,
                    "reader": reader,
                }
            )
        return out


def _manifest(columns: dict[str, np.ndarray], meta: dict[str, Any]) -> Manifest:
    fmt = {"format": str(meta["format"])} if "format" in meta else {}
    return Manifest.from_object({"protocol": str(meta["protocol"]), **fmt, **columns})

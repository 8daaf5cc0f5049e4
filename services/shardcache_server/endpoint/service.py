"""The node-local endpoint's answers: one request in, one JSON reply and chunk files out.

It runs in the cache worker pod (the chart's DaemonSet) as a Ray driver
beside that pod's raylet, so it reaches this node's store and maps its
chunks zero-copy. Every request goes through the same calls a Ray rank
makes (``CacheClient`` for the store, ``RedisIndex`` for the index), so
claims, generations, invalidation, refresh and stats are those of the Ray
path. The index calls a rank may make are a fixed list; the usage counters
are written by the usage module's own Lua script, accepted only by its hash
and only on this namespace's usage keys.

The transports that carry requests (``unix.py``, ``flight.py``) only move
what :meth:`Endpoint.handle` returns; ``shm.py`` owns the chunk files.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import Field

from shardcache import errors
from shardcache.config import ClientConfig
from shardcache.errors import ConfigError, ShardCacheError
from shardcache.index import RedisIndex
from shardcache.keys import usage_prefix
from shardcache.transport.base import Status
from shardcache.transport.direct import CacheClient
from shardcache.transport.wire import (
    DEFAULT_SOCKET,
    INDEX_OPS,
    MAX_FDS_PER_FRAME,
    error_reply,
    load_callable,
)
from shardcache.usage import APPLY_SCRIPT
from shardcache_server.endpoint.shm import ShmFiles
from shardcache_server.settings import ServiceSettings

__all__ = ["Endpoint", "EndpointSettings", "Files", "opened"]

log = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/var/lib/shardcache/shm"  # the chart's medium: Memory emptyDir
DEFAULT_SHM_BYTES = 4 * 2**30  # chunk files kept for the node's ranks
# The fields a rank stamps on its usage hash: its report is final, or it is
# alive with nothing to flush (the flusher's heartbeat).
USAGE_STAMPS = ("ended", "ts")
_USAGE_SHA = hashlib.sha1(APPLY_SCRIPT.encode()).hexdigest()

Files = list[tuple[Path, bool]]  # (chunk file, unlink once handed over)


@contextlib.contextmanager
def opened(files: Files) -> Iterator[list[int]]:
    """Read-only descriptors of a reply's files, closed on exit. A file
    handed over once is unlinked as soon as it is open: the descriptor keeps
    its pages while the transport sends it (``unix.py``, ``stream.py``).

    Raises:
        OSError: a file is gone (the files' budget evicted it meanwhile).
    """
    fds: list[int] = []
    try:
        for path, unlink in files:
            fds.append(os.open(path, os.O_RDONLY))
            if unlink:
                path.unlink(missing_ok=True)
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


class EndpointSettings(ServiceSettings):
    """The endpoint's settings (``SHARDCACHE_*`` env, as the chart sets them).

    Args:
        endpoint_socket: the Unix socket ranks connect to (on a hostPath).
            Defaults to ``/var/run/shardcache/endpoint.sock``.
        endpoint_socket_mode: its permission bits; anyone who can open it
            reads the cache. Defaults to ``0o660``.
        endpoint_shm_dir: where chunk files are written (memory-backed).
            Defaults to ``/var/lib/shardcache/shm``.
        endpoint_shm_bytes: chunk file bytes kept for reuse. Defaults to 4 GiB.
        node_name: the Kubernetes node (downward API), reported to ranks.
        ray_address: the Ray node to drive. Defaults to ``"auto"`` (this pod's).
        request_timeout_s: how long one store call may take. Defaults to 300.
        flight_port: Arrow Flight port for other nodes' ranks; ``0`` is off.
        stream_port: the TCP stream port for other nodes' ranks (``stream.py``,
            the faster path); ``0`` is off.
        flight_token: the token callers of either port must send (required
            when a port is set).
        flight_tls_cert, flight_tls_key: PEM files; both set serves
            ``grpc+tls`` and TLS on the stream port. Default to ``None``.
    """

    endpoint_socket: str = DEFAULT_SOCKET
    endpoint_socket_mode: int = Field(default=0o660, ge=0, le=0o777)
    endpoint_shm_dir: str = DEFAULT_SHM_DIR
    endpoint_shm_bytes: int = Field(default=DEFAULT_SHM_BYTES, gt=0)
    node_name: str = ""
    ray_address: str = "auto"
    request_timeout_s: float = Field(default=300.0, gt=0)
    flight_port: int = Field(default=0, ge=0, le=65535)
    stream_port: int = Field(default=0, ge=0, le=65535)
    flight_token: str | None = Field(default=None, repr=False)
    flight_tls_cert: str | None = None
    flight_tls_key: str | None = None

    def streaming_credentials(self, port: str) -> tuple[str, tuple[str, str] | None]:
        """The token and the (certificate, key) files, or ``None`` for no TLS,
        of the ports other nodes' ranks read from (Flight and the TCP stream
        share them).

        Raises:
            ConfigError: no token, or only one of certificate and key.
        """
        if not self.flight_token:
            raise ConfigError(
                f"{port} is set but flight_token is not: the streaming ports need "
                "the chart's token (SHARDCACHE_FLIGHT_TOKEN)."
            )
        if bool(self.flight_tls_cert) != bool(self.flight_tls_key):
            raise ConfigError(
                "set both SHARDCACHE_FLIGHT_TLS_CERT and SHARDCACHE_FLIGHT_TLS_KEY, "
                "or neither."
            )
        if self.flight_tls_cert and self.flight_tls_key:
            return self.flight_token, (self.flight_tls_cert, self.flight_tls_key)
        return self.flight_token, None


class Endpoint:
    """Answers one request (a JSON dict) with a JSON reply and the chunk files
    to hand over; the transports (Unix socket, Flight) only move them.

    Args:
        settings: where Redis, Ray and the shared-memory directory are.
    """

    def __init__(self, settings: EndpointSettings):
        self.settings = settings
        self.client = CacheClient(
            ClientConfig(
                redis_url=settings.redis_url,
                namespace=settings.namespace,
                ray_address=settings.ray_address,
                request_timeout_s=settings.request_timeout_s,
            )
        )
        self.files = ShmFiles(settings.endpoint_shm_dir, settings.endpoint_shm_bytes)
        self._usage_script: Any = None
        self._usage_prefix = usage_prefix(settings.namespace)

    @property
    def index(self) -> RedisIndex:
        return self.client.index

    def start(self) -> None:
        """Join this node's Ray and make sure its store runs."""
        self.client.attach()

    # -- one request --------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> tuple[dict[str, Any], Files]:
        """The reply to ``message`` and the files to hand over; never raises."""
        op = str(message.get("op"))
        try:
            return self._dispatch(op, message)
        except ShardCacheError as exc:
            return error_reply(exc), []
        except Exception as exc:  # a reply, never a dead connection
            log.exception("endpoint %s failed", op)
            return error_reply(
                errors.BackendError(f"the cache endpoint failed on {op}: {exc!r}")
            ), []

    def _dispatch(self, op: str, m: dict[str, Any]) -> tuple[dict[str, Any], Files]:
        if op == "hello":
            if m.get("namespace") != self.settings.namespace:
                raise ConfigError(
                    f"this pod reads namespace {m.get('namespace')!r} but the cache "
                    f"worker on node {self.settings.node_name or '?'} serves "
                    f"{self.settings.namespace!r}; set SHARDCACHE_NAMESPACE to it."
                )
            return _ok({"node": self.settings.node_name}), []
        if op in ("manifest", "manifest_of"):
            if op == "manifest":
                ref, digest = self.client.manifest(m["spec"], str(m.get("token", "")))
                name = m["spec"]["name"]
            else:
                name, digest = m["name"], str(m["digest"])
                ref = self.client.manifest_of(name, digest)
            return _ok({"digest": digest}), [self._manifest_file(name, digest, ref)]
        if op == "install":
            spec = m["spec"]
            pre_fp, _, target_fp = str(spec["fingerprint"]).partition("+target:")
            preprocess = load_callable(m["preprocess"], pre_fp, "preprocess")
            target = (
                load_callable(m["target"], target_fp, "target")
                if m.get("target")
                else None
            )
            self.client.install(spec, preprocess, target)
            return _ok(None), []
        if op == "get":
            return self._get(m)
        if op == "drop_corrupt":
            name, generation = str(m["name"]), int(m["generation"])
            chunk, version = str(m["chunk"]), str(m["version"])
            self.files.discard(
                (self.settings.namespace, name, generation, chunk, version)
            )
            return _ok(self.client.drop_corrupt(name, generation, chunk, version)), []
        if op in INDEX_OPS:
            args = {k: v for k, v in m.items() if k != "op"}
            return _ok(getattr(self.index, op)(**args)), []
        if op == "usage_apply":
            return _ok(self._usage_apply(m)), []
        if op == "usage_hset":  # a rank stamps its usage hash "ended" or "ts"
            self._check_usage_keys([m["key"]])
            field = m.get("field")
            if field not in USAGE_STAMPS:
                names = " and ".join(map(repr, USAGE_STAMPS))
                raise ConfigError(
                    f"the endpoint sets only the {names} fields of a rank's usage "
                    f"hash, not {field!r}."
                )
            stamp = _stamp(m["value"])
            with self.index.errors():
                return _ok(self.index.client.hset(m["key"], field, stamp)), []
        if op == "usage_hgetall":
            self._check_usage_keys([m["key"]])
            with self.index.errors():
                return _ok(self.index.client.hgetall(m["key"])), []
        raise ConfigError(f"unknown endpoint operation {op!r}")

    def _get(self, m: dict[str, Any]) -> tuple[dict[str, Any], Files]:
        items = [(str(k), str(v), int(n)) for k, v, n in m["items"]]
        if len(items) > MAX_FDS_PER_FRAME:
            raise ConfigError(f"at most {MAX_FDS_PER_FRAME} chunks per request")
        name, generation = str(m["name"]), int(m["generation"])
        results = self.client.resolve(
            name, generation, items, m.get("digest"), reader=str(m.get("reader", ""))
        )
        files: Files = []
        statuses = []
        for (key, version, _), (status, columns) in zip(items, results, strict=True):
            statuses.append(status)
            files.append(
                self.files.ensure(
                    (self.settings.namespace, name, generation, key, version),
                    lambda columns=columns: columns,
                    {"dataset": name, "chunk": key, "version": version},
                    keep=status not in (Status.UNCACHED, Status.DISK_READ),
                )
            )
        return {"statuses": statuses}, files

    def _manifest_file(self, name: str, digest: str, ref: Any) -> tuple[Path, bool]:
        manifest = self.client.map_manifest(ref)  # zero-copy; written once per node
        return self.files.ensure(
            (self.settings.namespace, "manifest", name, digest),
            lambda: dict(manifest.columns),
            {
                "protocol": manifest.protocol,
                "digest": digest,
                # a packed manifest names its format (files + units, not objects)
                **({"format": manifest.format} if hasattr(manifest, "format") else {}),
            },
        )

    def _check_usage_keys(self, keys: list[str]) -> None:
        for key in keys:
            if not str(key).startswith(self._usage_prefix):
                raise ConfigError(
                    f"key {key!r} is outside this namespace's usage keys; the "
                    "endpoint writes only rank usage counters for ranks."
                )

    def _usage_apply(self, m: dict[str, Any]) -> Any:
        if m.get("sha") != _USAGE_SHA:
            raise ConfigError(
                "the rank's usage script differs from the cache worker's; run the "
                "same shardcache version in the training image and the cache."
            )
        keys = [str(k) for k in m["keys"]]
        self._check_usage_keys(keys)
        with self.index.errors():
            if self._usage_script is None:
                self._usage_script = self.index.client.register_script(APPLY_SCRIPT)
            return self._usage_script(keys=keys, args=list(m["args"]))


def _ok(result: Any) -> dict[str, Any]:
    return {"result": result}


def _stamp(value: Any) -> str:
    """A usage stamp: a finite time in seconds, as the rank's clock wrote it.

    >>> _stamp("1764700000.25"), _stamp(12)
    ('1764700000.25', '12.0')
    """
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds):
        raise ConfigError(f"a usage stamp is a time in seconds, got {value!r}.")
    return repr(seconds)

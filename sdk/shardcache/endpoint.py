"""Reading through the cache worker of this node, with no Ray in the process.

A training pod that is not a Ray node (torchrun, a Kubeflow ``PyTorchJob``)
talks to the node-local endpoint of the cache worker on its Kubernetes node
(``shardcache_server.endpoint``, a Ray driver beside that node's raylet):

* control goes over a Unix socket on a ``hostPath`` as length-prefixed JSON
  frames (4-byte big-endian length, then UTF-8 JSON; nothing is unpickled);
* chunks, and the manifest, come back as read-only file descriptors
  (``SCM_RIGHTS``) of chunk files (``chunk_file.py``) that the endpoint wrote
  once per node in its memory-backed volume; the rank maps them read-only, so
  a sample is a view of that shared memory: no copy per rank, and the
  endpoint may evict a file while ranks still map it.

Everything the Ray path reads from Redis (the generation, registration,
invalidation, rank reports, the usage counters behind the hit rate) goes
through the same socket, so the pod needs no route to Redis or the source.
The dataset, sampler and reader code are the Ray path's own; only the
client below differs (``open_client`` picks it).

Choosing the read path (``open_client``):

1. ``endpoint`` (``SHARDCACHE_ENDPOINT``) set, or the chart's mount path
   ``/var/run/shardcache/endpoint.sock`` present: this node's endpoint. A
   configured socket that is missing raises :class:`EndpointUnavailable`
   naming the node and the path; there is no fallback to Ray.
2. Else ``allow_remote`` (``SHARDCACHE_ALLOW_REMOTE``): stream from a cache
   worker on another node (``shardcache.remote``, Arrow Flight).
3. Else ``node_name`` (``SHARDCACHE_NODE_NAME``, which the chart's pod
   snippet sets from the downward API) set: :class:`EndpointUnavailable`.
4. Else the Ray path (``CacheClient``): a Ray node, or the embedded defaults.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardcache import errors, keys
from shardcache.chunk_file import read_chunk_buffer
from shardcache.config import ClientConfig
from shardcache.errors import ConfigError, EndpointUnavailable, IndexUnavailable
from shardcache.fingerprint import fingerprint
from shardcache.manifest import Manifest

__all__ = [
    "DEFAULT_SOCKET",
    "INDEX_OPS",
    "EndpointClient",
    "ProxyClient",
    "callable_name",
    "load_callable",
    "open_client",
    "raise_reply_error",
    "recv_frame",
    "send_frame",
    "usage_prefix",
]

DEFAULT_SOCKET = "/var/run/shardcache/endpoint.sock"  # the chart's hostPath mount
MAX_FRAME_BYTES = 64 * 2**20  # a frame is control JSON; chunk bytes never travel in it
MAX_FDS_PER_FRAME = 128  # below SCM_MAX_FD (253); a larger request is split
_LENGTH = struct.Struct(">I")
INDEX_OPS = (
    "register",
    "register_change",
    "generation",
    "invalidate",
    "record_rank",
    "entries",
)


# -- wire format ----------------------------------------------------------------------
def send_frame(
    sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()
) -> None:
    """Send one length-prefixed JSON frame, with ``fds`` attached (``SCM_RIGHTS``)."""
    body = json.dumps(message, separators=(",", ":")).encode()
    data = _LENGTH.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Read one frame and the descriptors that came with it.

    Raises:
        EOFError: the peer closed the connection.
        ValueError: the frame is larger than ``MAX_FRAME_BYTES`` or not JSON.
    """
    buf = bytearray()
    fds: list[int] = []
    need = _LENGTH.size
    while len(buf) < need:
        data, got, flags, _ = socket.recv_fds(sock, need - len(buf), MAX_FDS_PER_FRAME)
        fds.extend(got)
        if flags & getattr(socket, "MSG_CTRUNC", 0):
            _close_all(fds)
            raise ValueError("descriptors were truncated (more than the frame limit)")
        if not data:
            _close_all(fds)
            raise EOFError("connection closed")
        buf += data
        if need == _LENGTH.size and len(buf) >= need:
            (length,) = _LENGTH.unpack(bytes(buf[: _LENGTH.size]))
            if length > MAX_FRAME_BYTES:
                _close_all(fds)
                raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
            need = _LENGTH.size + length
    return json.loads(bytes(buf[_LENGTH.size :])), fds


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def raise_reply_error(reply: dict[str, Any]) -> None:
    """Re-raise an error the endpoint reported as the project's own type."""
    err = reply.get("error")
    if not err:
        return
    cls = getattr(errors, str(err.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ShardCacheError)):
        cls = errors.BackendError
    raise cls(str(err.get("message")))


def callable_name(fn: Callable[..., Any] | None, label: str) -> str | None:
    """``module:qualname`` of a module-level function, which the cache worker imports.

    A process outside Ray cannot ship code to the cluster (the socket carries
    no pickle), so preprocess and target must be importable on the cache
    worker's image; the worker checks the fingerprint matches.

    >>> from shardcache.decoders import raw_bytes
    >>> callable_name(raw_bytes, "preprocess")
    'shardcache.decoders:raw_bytes'

    Raises:
        ConfigError: ``fn`` is a lambda, a closure, a partial or defined in
            ``__main__``.
    """
    if fn is None:
        return None
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or module in ("__main__", "__mp_main__") or "<" in qualname:
        raise ConfigError(
            f"{label} {qualname or fn!r} must be a module-level function of a module "
            "that the cache worker's image can import (the node-local endpoint takes it "
            "by name, never as pickled code); move it out of the script."
        )
    try:
        found = _import(module, qualname)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"{label} {module}:{qualname} is not importable: {exc}"
        ) from exc
    if found is not fn:
        raise ConfigError(f"{label} {module}:{qualname} does not name {fn!r}.")
    return f"{module}:{qualname}"


def _import(module: str, qualname: str) -> Any:
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def load_callable(name: str, fp: str, label: str) -> Callable[..., Any]:
    """The function ``module:qualname`` on this side, checked against ``fp``.

    Raises:
        ConfigError: not importable, or its code differs from the rank's.
    """
    module, _, qualname = name.partition(":")
    try:
        found = _import(module, qualname)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"the cache worker cannot import {label} {name}: {exc}. Install the module "
            "in the cache worker's image."
        ) from exc
    # A dataset with version= names no code fingerprint: the user vouches.
    if fp and not fp.startswith("version:") and fingerprint(found) != fp:
        raise ConfigError(
            f"{label} {name} on the cache worker differs from the training pod's "
            "(fingerprints differ); run the same version of that module on both."
        )
    return found


# -- the client both transports share -------------------------------------------------------
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

    def invalidate(self, name: str) -> int:
        return int(self._client.call_index("invalidate", name=name))

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
    """A ``CacheClient`` stand-in whose cluster is reached through a cache worker.

    Subclasses provide ``call(op, **args)`` (one request, one JSON reply) and
    ``_chunks`` / ``_manifest_columns`` (the bytes). ``remote`` marks chunks
    that crossed the network (their samples count as ``peer``).
    """

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

    # the CacheClient interface -----------------------------------------------------
    @property
    def retryable_errors(self) -> tuple[type[Exception], ...]:
        """Errors a background prefetch swallows (the loop asks again)."""
        return (errors.BackendError, errors.StaleVersionError)

    def manifest(self, spec: dict[str, Any], token: str = "") -> tuple[Manifest, str]:
        columns, meta = self._manifest_columns("manifest", spec=spec, token=token)
        return _manifest(columns, meta), str(meta["digest"])

    def manifest_of(self, name: str, digest: str) -> Manifest:
        columns, meta = self._manifest_columns("manifest_of", name=name, digest=digest)
        return _manifest(columns, meta)

    @staticmethod
    def map_manifest(handle: Manifest) -> Manifest:
        return handle

    def register(
        self,
        spec: dict[str, Any],
        preprocess: Callable[[bytes], Any],
        target: Callable[[str], Any] | None = None,
    ) -> None:
        """Name the dataset's preprocess and target to the cache worker, which
        imports them (see :func:`callable_name`)."""
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
        self.call("register_dataset", spec=spec, **names)

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
    ) -> list[tuple[str, dict[str, np.ndarray]]]:
        """``(status, columns)`` per chunk; columns view shared memory (local)
        or the received stream (remote)."""
        out: list[tuple[str, dict[str, np.ndarray]]] = []
        for i in range(0, len(items), MAX_FDS_PER_FRAME):
            out += self._chunks(
                {
                    "op": "get",
                    "name": name,
                    "generation": generation,
                    "items": [list(item) for item in items[i : i + MAX_FDS_PER_FRAME]],
                    "digest": digest,
                }
            )
        return out


def _manifest(columns: dict[str, np.ndarray], meta: dict[str, Any]) -> Manifest:
    fmt = {"format": str(meta["format"])} if "format" in meta else {}
    return Manifest.from_object({"protocol": str(meta["protocol"]), **fmt, **columns})


class EndpointClient(ProxyClient):
    """Reads through the node-local endpoint at ``socket_path``; one connection
    per thread (the training loop and each prefetch thread), reopened after fork.

    Args:
        config: the client settings (namespace, node name for errors).
        socket_path: the endpoint's Unix socket.
    """

    def __init__(self, config: ClientConfig, socket_path: str):
        super().__init__(config)
        self.socket_path = socket_path
        self._local = threading.local()
        self._pid = os.getpid()
        self._dropped = False  # a connection broke: the endpoint may have restarted

    def _conn(self) -> socket.socket:
        if self._pid != os.getpid():
            self._local = threading.local()
            self._pid = os.getpid()
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.config.request_timeout_s)
            try:
                sock.connect(self.socket_path)
            except OSError as exc:
                sock.close()
                raise _unavailable(self.config, self.socket_path, exc) from exc
            self._local.sock = sock
            greetings = [{"op": "hello", "namespace": self.config.namespace}]
            if self._dropped:
                # After a dropped connection the endpoint (and store) may have
                # restarted: hand it the datasets this process reads again,
                # as the Ray path re-registers with a restarted store.
                self._dropped = False
                greetings += [
                    {"op": "register_dataset", "spec": spec, **names}
                    for spec, names in list(self._names.values())
                ]
            for greeting in greetings:
                reply, fds = self._roundtrip(sock, greeting)
                _close_all(fds)
                if reply.get("error"):
                    self._local.sock = None
                    sock.close()
                    raise_reply_error(reply)
        return sock

    def _roundtrip(
        self, sock: socket.socket, message: dict[str, Any]
    ) -> tuple[dict[str, Any], list[int]]:
        try:
            send_frame(sock, message)
            return recv_frame(sock)
        except (OSError, EOFError, ValueError) as exc:
            self._local.sock = None
            self._dropped = True
            sock.close()
            raise EndpointUnavailable(
                f"the cache endpoint at {self.socket_path} on node "
                f"{self.config.node_name or '?'} dropped the connection ({exc}); "
                "is the cache worker pod restarting?"
            ) from exc

    def _request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        try:
            reply, fds = self._roundtrip(self._conn(), message)
        except EndpointUnavailable:
            if message["op"] == "invalidate":
                raise  # not idempotent: the caller decides
            # The cache worker pod restarted: one new connection, one retry
            # (every other request is idempotent; usage flushes carry a seq).
            reply, fds = self._roundtrip(self._conn(), message)
        if reply.get("error"):
            _close_all(fds)
            raise_reply_error(reply)
        return reply, fds

    def call(self, op: str, **args: Any) -> Any:
        reply, fds = self._request({"op": op, **args})
        _close_all(fds)
        return reply.get("result")

    def _chunks(
        self, request: dict[str, Any]
    ) -> list[tuple[str, dict[str, np.ndarray]]]:
        reply, fds = self._request(request)
        try:
            return [
                (status, _map_fd(fd, f"chunk {key}")[0])
                for (key, _, _), status, fd in zip(
                    request["items"], reply["statuses"], fds, strict=True
                )
            ]
        finally:
            _close_all(fds)

    def _manifest_columns(
        self, op: str, **args: Any
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        _, fds = self._request({"op": op, **args})
        try:
            return _map_fd(fds[0], "manifest")
        finally:
            _close_all(fds)


def _map_fd(fd: int, what: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Map a received descriptor read-only; the views keep the mapping alive."""
    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    return read_chunk_buffer(mapped, what)


def _unavailable(config: ClientConfig, path: str, cause: object) -> EndpointUnavailable:
    node = config.node_name or "(SHARDCACHE_NODE_NAME not set)"
    return EndpointUnavailable(
        f"no shardcache endpoint on node {node}: cannot connect to {path} ({cause}). "
        f"Mount the cache worker's socket directory (hostPath {Path(path).parent}) "
        "into this pod as the chart's trainingPodSnippet does, check that a cache "
        "worker runs on this node (shard.nodeSelector / tolerations), or pass "
        "allow_remote=True (SHARDCACHE_ALLOW_REMOTE) with SHARDCACHE_REMOTE_URL "
        "to stream from another node."
    )


def open_client(config: ClientConfig) -> Any:
    """The client for this process's read path (see the module docstring).

    Raises:
        EndpointUnavailable: an endpoint is configured (or the pod says which
            node it is on) but no socket is reachable, and remote reads are off.
        ConfigError: ``allow_remote`` without ``remote_url``.
    """
    path = config.endpoint or (
        DEFAULT_SOCKET if os.path.exists(DEFAULT_SOCKET) else None
    )
    if path is not None and os.path.exists(path):
        return EndpointClient(config, path)
    if config.allow_remote:
        if not config.remote_url:
            raise ConfigError(
                "allow_remote=True needs the cache workers' streaming address: set "
                "SHARDCACHE_REMOTE_URL (grpc+tls://<release>-shardcache-flight.<ns>.svc:8815)."
            )
        from shardcache.remote import FlightClient

        return FlightClient(config)
    if path is not None:
        raise _unavailable(config, path, "no such socket")
    if config.node_name:
        raise _unavailable(
            config, DEFAULT_SOCKET, "SHARDCACHE_ENDPOINT not set and no socket mounted"
        )
    from shardcache.client import CacheClient

    return CacheClient(config)


def usage_prefix(namespace: str) -> str:
    """Keys a rank's usage calls may touch (checked by the endpoint)."""
    return f"{keys.prefix(namespace)}:usage:"

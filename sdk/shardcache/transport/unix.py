"""Reading through the cache worker of this node, with no Ray in the process.

A training pod that is not a Ray node (torchrun, a Kubeflow ``PyTorchJob``)
talks to the node-local endpoint of the cache worker on its Kubernetes node
(``shardcache_server.endpoint``, a Ray driver beside that node's raylet):

* control goes over a Unix socket on a ``hostPath`` as length-prefixed JSON
  frames (``wire.py``);
* chunks, and the manifest, come back as read-only file descriptors
  (``SCM_RIGHTS``) of chunk files (``chunk_file.py``) that the endpoint wrote
  once per node in its memory-backed volume; the rank maps them read-only, so
  a sample is a view of that shared memory: no copy per rank, and the
  endpoint may evict a file while ranks still map it.

Everything the Ray path reads from Redis (the generation, registration,
invalidation, rank reports, the usage counters behind the hit rate) goes
through the same socket, so the pod needs no route to Redis or the source.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np

from shardcache.chunk_file import read_chunk_buffer
from shardcache.config import ClientConfig
from shardcache.errors import EndpointUnavailable
from shardcache.transport.proxy import ProxyClient
from shardcache.transport.wire import (
    close_all,
    raise_reply_error,
    recv_frame,
    send_frame,
)

__all__ = ["EndpointClient", "endpoint_unavailable"]


class EndpointClient(ProxyClient):
    """Reads through the node-local endpoint at ``socket_path``; one connection
    per thread (the training loop and each prefetch thread), reopened after fork.

    The connection's kind is four hooks (``_connect``, ``_exchange``,
    ``_view``, ``_release``): the TCP stream to another node's cache worker
    (``stream.py``) is this client with bytes where this one has descriptors.

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

    # the connection's kind -----------------------------------------------------------
    def _connect(self) -> Any:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.config.request_timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise endpoint_unavailable(self.config, self.socket_path, exc) from exc
        return sock

    def _hello(self) -> dict[str, Any]:
        return {"op": "hello", "namespace": self.config.namespace}

    def _exchange(
        self, sock: Any, message: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Any]]:
        """One request and its reply with what came attached (descriptors here)."""
        send_frame(sock, message)
        return recv_frame(sock)

    def _view(
        self, attached: Any, what: str
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return _map_fd(attached, what)

    def _release(self, attached: list[Any]) -> None:
        close_all(attached)

    def _dropped_error(self, exc: Exception) -> EndpointUnavailable:
        return EndpointUnavailable(
            f"the cache endpoint at {self.socket_path} on node "
            f"{self.config.node_name or '?'} dropped the connection ({exc}); "
            "is the cache worker pod restarting?"
        )

    # requests -------------------------------------------------------------------------
    def _conn(self) -> Any:
        if self._pid != os.getpid():
            self._local = threading.local()
            self._pid = os.getpid()
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._connect()
            self._local.sock = sock
            greetings = [self._hello()]
            if self._dropped:
                # After a dropped connection the endpoint (and store) may have
                # restarted: hand it the datasets this process reads again,
                # as the Ray path re-registers with a restarted store.
                self._dropped = False
                greetings += [
                    {"op": "install", "spec": spec, **names}
                    for spec, names in list(self._names.values())
                ]
            for greeting in greetings:
                reply, attached = self._roundtrip(sock, greeting)
                self._release(attached)
                if reply.get("error"):
                    self._local.sock = None
                    sock.close()
                    raise_reply_error(reply)
        return sock

    def _roundtrip(
        self, sock: Any, message: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Any]]:
        try:
            return self._exchange(sock, message)
        except (OSError, EOFError, ValueError) as exc:
            self._local.sock = None
            self._dropped = True
            sock.close()
            raise self._dropped_error(exc) from exc

    def _request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        try:
            reply, attached = self._roundtrip(self._conn(), message)
        except EndpointUnavailable:
            if message["op"] == "invalidate":
                raise  # not idempotent: the caller decides
            # The cache worker pod restarted: one new connection, one retry
            # (every other request is idempotent; usage flushes carry a seq).
            reply, attached = self._roundtrip(self._conn(), message)
        if reply.get("error"):
            self._release(attached)
            raise_reply_error(reply)
        return reply, attached

    def call(self, op: str, **args: Any) -> Any:
        reply, attached = self._request({"op": op, **args})
        self._release(attached)
        return reply.get("result")

    def _chunks(
        self, request: dict[str, Any]
    ) -> list[tuple[str, dict[str, np.ndarray]]]:
        reply, attached = self._request(request)
        try:
            return [
                (self._status(status), self._view(one, f"chunk {key}")[0])
                for (key, _, _), status, one in zip(
                    request["items"], reply["statuses"], attached, strict=True
                )
            ]
        finally:
            self._release(attached)

    def _status(self, status: str) -> str:
        return status

    def _manifest_columns(
        self, op: str, **args: Any
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        _, attached = self._request({"op": op, **args})
        try:
            return self._view(attached[0], "manifest")
        finally:
            self._release(attached)


def _map_fd(fd: int, what: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Map a received descriptor read-only; the views keep the mapping alive."""
    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    return read_chunk_buffer(mapped, what)


def endpoint_unavailable(
    config: ClientConfig, path: str, cause: object
) -> EndpointUnavailable:
    """The error of a pod whose node-local endpoint cannot be reached at ``path``."""
    node = config.node_name or "(SHARDCACHE_NODE_NAME not set)"
    return EndpointUnavailable(
        f"no shardcache endpoint on node {node}: cannot connect to {path} ({cause}). "
        f"Mount the cache worker's socket directory (hostPath {Path(path).parent}) "
        "into this pod as the chart's trainingPodSnippet does, check that a cache "
        "worker runs on this node (shard.nodeSelector / tolerations), or pass "
        "allow_remote=True (SHARDCACHE_ALLOW_REMOTE) with SHARDCACHE_REMOTE_URL "
        "to stream from another node."
    )

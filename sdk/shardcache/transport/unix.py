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
                raise endpoint_unavailable(self.config, self.socket_path, exc) from exc
            self._local.sock = sock
            greetings = [{"op": "hello", "namespace": self.config.namespace}]
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
                reply, fds = self._roundtrip(sock, greeting)
                close_all(fds)
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
            close_all(fds)
            raise_reply_error(reply)
        return reply, fds

    def call(self, op: str, **args: Any) -> Any:
        reply, fds = self._request({"op": op, **args})
        close_all(fds)
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
            close_all(fds)

    def _manifest_columns(
        self, op: str, **args: Any
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        _, fds = self._request({"op": op, **args})
        try:
            return _map_fd(fds[0], "manifest")
        finally:
            close_all(fds)


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

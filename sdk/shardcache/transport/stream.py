"""Reading across nodes over a plain TCP (or TLS) stream from a cache worker.

``allow_remote=True`` with ``SHARDCACHE_REMOTE_URL=tcp://host:port`` or
``tls://host:port`` (the chart's ``<release>-shardcache-flight`` Service,
port ``stream``) reads through another node's cache worker with the
node-local endpoint's protocol (``wire.py`` frames of JSON): every request
is one frame, and a reply's chunk files follow its frame as raw bytes, the
frame listing their sizes. Each chunk is received with ``recv_into`` into
one 64-byte-aligned buffer of its own (the chunk format's alignment), and
its columns are views of that buffer: one kernel copy per byte, none in
Python. A buffer nothing views any more is written again by a later chunk
(``buffers.ReusedBuffers``), so a steady stream faults in no new pages. It replaces Arrow
Flight's ``grpc://`` URLs where speed matters: per chunk of 1-16 MiB it
moves 57-83% of a raw loopback socket's GB/s, Flight 25-36%
(``bench/flight_cost.py``, BENCHMARKS.md).

The first frame of every connection carries the token
(``SHARDCACHE_REMOTE_TOKEN``); ``tls://`` verifies the server against
``remote_ca`` (or the system's CAs) and its name. Samples read this way
count as ``peer``, and the bytes received as ``remote_bytes`` /
``remote_us`` in ``ds.stats()["served"]``. No Ray, no pyarrow.
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from shardcache.buffers import ReusedBuffers
from shardcache.chunk_file import read_chunk_buffer
from shardcache.config import ClientConfig
from shardcache.errors import ConfigError, EndpointUnavailable
from shardcache.fork_guard import io_call
from shardcache.transport.base import Status
from shardcache.transport.unix import EndpointClient
from shardcache.transport.wire import recv_exact, recv_plain_frame, send_frame

__all__ = ["StreamClient", "is_stream_url"]

KEPT_BUFFERS = 4  # receive buffers a process keeps for reuse (16 MiB each by default)


def is_stream_url(url: str) -> bool:
    """Whether ``url`` names the TCP stream (``tcp://``, ``tls://``) rather than Flight."""
    return url.startswith(("tcp://", "tls://"))


class StreamClient(EndpointClient):
    """A rank's client of a remote cache worker's stream port; one connection
    per thread, reopened after fork and after a dropped connection.

    Args:
        config: ``remote_url``, ``remote_token`` and ``remote_ca`` are used.

    Raises:
        ConfigError: the URL is not ``tcp://host:port`` or ``tls://host:port``,
            or ``remote_ca`` cannot be read.
    """

    remote = True

    def __init__(self, config: ClientConfig):
        url = str(config.remote_url)
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not is_stream_url(url) or not parts.hostname or not port:
            raise ConfigError(
                f"remote_url must be tcp://host:port or tls://host:port (or a grpc:// "
                f"Flight URL), got {url!r}. Set SHARDCACHE_REMOTE_URL."
            )
        super().__init__(config, url)
        self.url = url
        self.host, self.port = parts.hostname, port
        self._tls: ssl.SSLContext | None = None
        if parts.scheme == "tls":
            try:
                self._tls = ssl.create_default_context(cafile=config.remote_ca)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"remote_ca {config.remote_ca!r} cannot be read: {exc}. Mount the "
                    "chart's streaming CA Secret and set SHARDCACHE_REMOTE_CA to it."
                ) from exc
        self.received_bytes = 0
        self.received_s = 0.0
        self._buffers = ReusedBuffers(KEPT_BUFFERS)

    def _unavailable(self, cause: object) -> EndpointUnavailable:
        return EndpointUnavailable(
            f"cannot stream from the remote cache worker at {self.url} (this pod is on "
            f"node {self.config.node_name or '?'}): {cause}. Check SHARDCACHE_REMOTE_URL, "
            "the CA (SHARDCACHE_REMOTE_CA) and the chart's NetworkPolicy for the "
            "streaming port."
        )

    def _connect(self) -> Any:
        try:
            raw = socket.create_connection(
                (self.host, self.port), timeout=self.config.request_timeout_s
            )
        except OSError as exc:
            raise self._unavailable(exc) from exc
        # Request frames are small and each waits for its answer.
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is None:
            return raw
        try:
            with io_call():  # a fork waits for the handshake (fork_guard.py)
                return self._tls.wrap_socket(raw, server_hostname=self.host)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise self._unavailable(exc) from exc

    def _hello(self) -> dict[str, Any]:
        return {**super()._hello(), "token": self.config.remote_token or ""}

    def _exchange(
        self, sock: Any, message: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Any]]:
        started = time.perf_counter()
        send_frame(sock, message)
        reply = recv_plain_frame(sock)
        buffers = []
        for size in reply.pop("sizes", []):
            buf = self._buffers.take(int(size))
            recv_exact(sock, memoryview(buf))
            buffers.append(buf)
        if buffers:
            self.received_s += time.perf_counter() - started
            self.received_bytes += sum(b.nbytes for b in buffers)
        return reply, buffers

    def _view(
        self, attached: Any, what: str
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return read_chunk_buffer(attached, what)

    def _release(self, attached: list[Any]) -> None:
        pass  # buffers: the columns viewing them keep them alive

    def _dropped_error(self, exc: Exception) -> EndpointUnavailable:
        return self._unavailable(f"the connection dropped ({exc})")

    def _status(self, status: str) -> str:
        return Status(status).across_nodes()

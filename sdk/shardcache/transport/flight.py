"""Reading across nodes, explicitly: chunks streamed from a cache worker over Arrow Flight.

``allow_remote=True`` (``SHARDCACHE_ALLOW_REMOTE``) on a pod with no cache
worker on its node reads through the cache workers' streaming Service
(``SHARDCACHE_REMOTE_URL``, the chart's ``<release>-shardcache-flight``)
instead. The protocol is the node-local endpoint's (same operations, same
JSON), carried by Flight: control calls are ``DoAction`` (type = operation,
body = JSON arguments, one JSON result), and chunks are one ``DoGet`` per
request whose stream has one row per chunk: ``status``, ``error`` (JSON, set
on a failed request) and ``data`` (the chunk file's bytes, the layout of
``chunk_file.py``). Every call carries ``authorization: Bearer <token>``;
``grpc+tls://`` URLs verify the server against ``remote_ca``.

Samples read this way count as ``peer`` in the usage figures, and the bytes
received (and the time spent receiving them) as ``remote_bytes`` /
``remote_us`` in ``ds.stats()["served"]``. No Ray is imported.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardcache.chunk_file import ALIGN_BYTES, aligned_empty, read_chunk_buffer
from shardcache.config import ClientConfig
from shardcache.errors import ConfigError, EndpointUnavailable
from shardcache.transport.base import Status
from shardcache.transport.proxy import ProxyClient
from shardcache.transport.wire import raise_reply_error

__all__ = ["FlightClient"]


class FlightClient(ProxyClient):
    """A rank's client of a remote cache worker's Flight service.

    Args:
        config: ``remote_url``, ``remote_token`` and ``remote_ca`` are used.

    Raises:
        ConfigError: the URL scheme is not ``grpc``/``grpc+tcp``/``grpc+tls``,
            or ``remote_ca`` cannot be read.
    """

    remote = True

    def __init__(self, config: ClientConfig):
        super().__init__(config)
        url = str(config.remote_url)
        if not url.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
            raise ConfigError(
                f"remote_url must be grpc://, grpc+tcp:// or grpc+tls://host:port, got "
                f"{url!r}. Set SHARDCACHE_REMOTE_URL."
            )
        self.url = url
        self._root_certs: bytes | None = None
        if config.remote_ca:
            try:
                self._root_certs = Path(config.remote_ca).read_bytes()
            except OSError as exc:
                raise ConfigError(
                    f"remote_ca {config.remote_ca!r} cannot be read: {exc}. Mount the "
                    "chart's Flight CA Secret and set SHARDCACHE_REMOTE_CA to it."
                ) from exc
        self._client: Any = None
        self.received_bytes = 0
        self.received_s = 0.0

    def _flight(self) -> Any:
        import pyarrow.flight as flight

        if self._client is None:
            kwargs: dict[str, Any] = {}
            if self._root_certs is not None:
                kwargs["tls_root_certs"] = self._root_certs
            self._client = flight.FlightClient(self.url, **kwargs)
        return self._client

    def _options(self) -> Any:
        import pyarrow.flight as flight

        headers = []
        if self.config.remote_token:
            headers.append(
                (b"authorization", f"Bearer {self.config.remote_token}".encode())
            )
        return flight.FlightCallOptions(
            headers=headers, timeout=self.config.request_timeout_s
        )

    def _unavailable(self, exc: Exception) -> EndpointUnavailable:
        return EndpointUnavailable(
            f"cannot stream from the remote cache worker at {self.url} (this pod is on "
            f"node {self.config.node_name or '?'}): {exc}. Check SHARDCACHE_REMOTE_URL, "
            "the token (SHARDCACHE_REMOTE_TOKEN), the CA (SHARDCACHE_REMOTE_CA) and the "
            "chart's NetworkPolicy for the streaming port."
        )

    def call(self, op: str, **args: Any) -> Any:
        import pyarrow.flight as flight

        action = flight.Action(op, json.dumps(args).encode())
        try:
            results = list(self._flight().do_action(action, options=self._options()))
        except (flight.FlightError, OSError) as exc:
            raise self._unavailable(exc) from exc
        reply = json.loads(results[0].body.to_pybytes())
        raise_reply_error(reply)
        return reply.get("result")

    def _stream(self, request: dict[str, Any]) -> Any:
        import pyarrow.flight as flight

        started = time.perf_counter()
        try:
            reader = self._flight().do_get(
                flight.Ticket(json.dumps(request).encode()), options=self._options()
            )
            table = reader.read_all()
        except (flight.FlightError, OSError) as exc:
            raise self._unavailable(exc) from exc
        errors = table.column("error").to_pylist()
        if errors and errors[0]:
            raise_reply_error({"error": json.loads(errors[0])})
        self.received_s += time.perf_counter() - started
        self.received_bytes += int(table.nbytes)
        return table

    def _chunks(
        self, request: dict[str, Any]
    ) -> list[tuple[str, dict[str, np.ndarray]]]:
        table = self._stream(request)
        out = []
        for status, data in zip(
            table.column("status").to_pylist(), _buffers(table), strict=True
        ):
            out.append((Status(status).across_nodes(), _columns(data)))
        return out

    def _manifest_columns(
        self, op: str, **args: Any
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        table = self._stream({"op": op, **args})
        return read_chunk_buffer(_aligned(next(iter(_buffers(table)))), "manifest")


def _buffers(table: Any) -> list[Any]:
    """The ``data`` values as Arrow buffers, without copying them."""
    out = []
    for arr in table.column("data").chunks:
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[
            arr.offset : arr.offset + len(arr) + 1
        ]
        data = arr.buffers()[2]
        for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            out.append(data.slice(lo, hi - lo))
    return out


def _aligned(buf: Any) -> Any:
    """``buf`` itself when 64-byte aligned, else one aligned copy (the columns
    inside are aligned relative to the start)."""
    if buf.address % ALIGN_BYTES == 0:
        return buf
    out = aligned_empty(buf.size)
    out[:] = np.frombuffer(buf, dtype=np.uint8)
    return out


def _columns(buf: Any) -> dict[str, np.ndarray]:
    """A received chunk's columns: views of the received buffer, unless a
    multi-byte column would be misaligned there (gRPC places the bytes where
    it likes); then views of one aligned copy. Byte columns (uint8 images,
    raw bytes) are never copied."""
    columns = read_chunk_buffer(buf, "streamed chunk")[0]
    if all(a.flags.aligned for a in columns.values()):
        return columns
    return read_chunk_buffer(_aligned(buf), "streamed chunk")[0]

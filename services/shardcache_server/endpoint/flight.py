"""The endpoint's operations over Arrow Flight, for ranks on other nodes.

``DoAction`` carries a control operation (type = operation, body = JSON
arguments) and returns one JSON result; ``DoGet`` carries a chunk or
manifest request (the ticket is the same JSON the Unix socket takes) and
streams one record batch per chunk: ``status``, ``error`` and ``data`` (the
chunk file's bytes, sent from the mapped file without an Arrow copy; the
most recently sent files stay mapped, ``_Mappings`` says why). A
failed request streams one row whose ``error`` is the JSON error, so the
rank raises the project's own error type. Every call must carry
``authorization: Bearer <flight_token>``; with a certificate and key the
server speaks ``grpc+tls``. The client is ``shardcache.transport.flight``.
"""

from __future__ import annotations

import hmac
import json
import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from shardcache.transport.base import Status
from shardcache_server.endpoint.service import Endpoint

__all__ = ["FlightService", "serve_flight"]

SCHEMA = pa.schema(
    [
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
        pa.field("data", pa.large_binary()),
    ]
)
MAPPED_FILES = 32  # chunk files kept mapped between requests (16 MiB each by default)


class _TokenCheck(flight.ServerMiddlewareFactory):
    """Refuses every call that does not carry the bearer token."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> None:
        for value in headers.get("authorization", []):
            raw = value if isinstance(value, bytes) else str(value).encode()
            if hmac.compare_digest(raw, self._expected):
                return None
        raise flight.FlightUnauthenticatedError(
            "shardcache: missing or wrong bearer token (SHARDCACHE_REMOTE_TOKEN)"
        )


class FlightService(flight.FlightServerBase):
    """Serves ``endpoint`` at ``location`` (``grpc://0.0.0.0:port`` or ``grpc+tls://``).

    Args:
        endpoint: the node's endpoint (the same operations as its Unix socket).
        location: where to listen.
        token: the bearer token callers must send.
        tls_certificates: ``[(cert PEM, key PEM)]`` for ``grpc+tls``.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        location: str,
        token: str,
        tls_certificates: list[tuple[bytes, bytes]] | None = None,
    ):
        super().__init__(
            location,
            tls_certificates=tls_certificates or [],
            middleware={"auth": _TokenCheck(token)},
        )
        self.endpoint = endpoint
        self._mappings = _Mappings()

    def do_action(self, context: Any, action: Any) -> Any:
        args = json.loads(action.body.to_pybytes() or b"{}")
        reply, files = self.endpoint.handle({**args, "op": action.type})
        _discard(files)
        yield flight.Result(json.dumps(reply).encode())

    def do_get(self, context: Any, ticket: Any) -> Any:
        reply, files = self.endpoint.handle(json.loads(ticket.ticket))
        if "error" in reply:
            table = pa.table(
                {
                    "status": [Status.ERROR],
                    "error": [json.dumps(reply["error"])],
                    "data": pa.array([b""], pa.large_binary()),
                },
                schema=SCHEMA,
            )
            return flight.RecordBatchStream(table)
        statuses = reply.get("statuses") or ["manifest"] * len(files)
        return flight.GeneratorStream(SCHEMA, _batches(statuses, files, self._mappings))


class _Mappings:
    """Chunk files kept mapped between requests, the most recently sent first.

    Mapping a file per request cost the server a page fault per 4 KiB page
    sent and an unmap after it: 0.48 CPU-seconds per GB sent against 0.26
    with the pages already mapped at 4 MiB, 0.34 against 0.26 at 16 MiB
    (bench/flight_cost.py; BENCHMARKS.md). A file is keyed by its path and inode,
    so a chunk file rewritten under its name (``ShmFiles`` renames a new one
    in) is mapped anew; one the files' LRU deleted keeps its pages only while
    it stays here, at most ``max_files`` files.

    Args:
        max_files: mappings kept. Defaults to ``MAPPED_FILES``.
    """

    def __init__(self, max_files: int = MAPPED_FILES):
        self.max_files = max_files
        self._lock = threading.Lock()
        self._mapped: OrderedDict[tuple[str, int], mmap.mmap] = OrderedDict()

    def buffer(self, path: Path, unlink: bool) -> pa.Buffer:
        """The bytes of ``path`` as an Arrow buffer over its mapping. A file
        handed over once (``unlink``) is mapped, deleted and not kept."""
        with open(path, "rb") as f:
            key = (str(path), os.fstat(f.fileno()).st_ino)
            with self._lock:
                mapped = self._mapped.get(key)
                if mapped is not None:
                    self._mapped.move_to_end(key)
                    return pa.py_buffer(mapped)
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if unlink:
            path.unlink(missing_ok=True)
            return pa.py_buffer(mapped)
        with self._lock:
            self._mapped[key] = mapped
            while len(self._mapped) > self.max_files:
                # Not closed: a stream may still be sending from it; the
                # mapping goes when its last buffer does.
                self._mapped.popitem(last=False)
        return pa.py_buffer(mapped)


def _batches(
    statuses: list[str], files: list[tuple[Path, bool]], mappings: _Mappings
) -> Any:
    for status, (path, unlink) in zip(statuses, files, strict=True):
        data = mappings.buffer(path, unlink)
        offsets = pa.py_buffer(pa.array([0, data.size], pa.int64()).buffers()[1])
        column = pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, data])
        yield pa.record_batch(
            [pa.array([status]), pa.array([None], pa.string()), column], schema=SCHEMA
        )


def _discard(files: list[tuple[Path, bool]]) -> None:
    for path, unlink in files:
        if unlink:
            path.unlink(missing_ok=True)


def serve_flight(endpoint: Endpoint) -> FlightService:
    """The Flight server of ``endpoint.settings`` (started; call ``serve()``).

    Raises:
        ConfigError: no token, or only one of certificate and key.
    """
    s = endpoint.settings
    token, files = s.streaming_credentials("flight_port")
    tls = None
    scheme = "grpc"
    if files is not None:
        tls = [(Path(files[0]).read_bytes(), Path(files[1]).read_bytes())]
        scheme = "grpc+tls"
    return FlightService(endpoint, f"{scheme}://0.0.0.0:{s.flight_port}", token, tls)

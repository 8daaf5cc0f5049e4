"""A local S3 for the demo, tests and benchmarks: moto's server plus a counting,
fault-injecting WSGI layer, so GETs are counted where they arrive.

Loopback only. Control it in-process (``emulator.faults``) or over HTTP from
another process: ``GET /_emulator/stats``, ``POST /_emulator/faults`` (JSON),
``POST /_emulator/reset``.
"""

from __future__ import annotations

import json
import math
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

from werkzeug.serving import BaseWSGIServer, make_server

__all__ = ["LATENCY_PROFILES", "SYNTHETIC_BUCKET", "FaultPlan", "S3Emulator"]

# A bucket named "synthetic-N" lists N objects without storing them (LIST
# only; benchmarks of listings at 10M objects): keys d{i//10000:05d}/s{i:09d}.bin
# of SYNTHETIC_SIZE bytes, so a prefix has sub-prefixes of 10,000 keys each.
SYNTHETIC_BUCKET = "synthetic-"
SYNTHETIC_PER_DIR = 10_000
SYNTHETIC_SIZE = 100

Environ = dict[str, Any]
StartResponse = Callable[..., Any]


@dataclass
class FaultPlan:
    """What share of object GETs fail, and how (seeded, so runs repeat).

    Args:
        error_rate: share of GETs answered with ``error_status``.
        error_status: 503 (SlowDown), 500 (InternalError).
        latency_s: added before the first byte of every GET.
        truncate_rate: share of GETs whose body is cut in half (corruption).
        latency_median_s / latency_sigma: a seeded log-normal first-byte
            latency (a long tail, like S3): median and shape.
        bandwidth_bytes_per_s: a cap on each GET's body rate (one connection
            each), ``0`` for none.
        reset_rate: share of GETs whose connection is dropped before any
            response byte (the client sees a disconnect).
        stall_rate / stall_s: share of GETs held ``stall_s`` before the first
            byte (a hung connection: the client's per-attempt timeout fires).
        list_error_rate: share of LIST requests (ListObjectsV2 pages)
            answered with ``error_status``, so a listing's retries and
            continuation can be tested.
        list_latency_s: added before every LIST response (a stated
            per-request latency for listing benchmarks).
        list_page_keys: the most keys a LIST page answers (S3 may answer
            fewer than ``MaxKeys``), ``0`` for ``MaxKeys``: a small
            listing with as many pages as a large one.
        seed: the random stream deciding which requests fail.
    """

    error_rate: float = 0.0
    error_status: int = 503
    latency_s: float = 0.0
    truncate_rate: float = 0.0
    latency_median_s: float = 0.0
    latency_sigma: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    reset_rate: float = 0.0
    stall_rate: float = 0.0
    stall_s: float = 0.0
    list_error_rate: float = 0.0
    list_latency_s: float = 0.0
    list_page_keys: int = 0
    seed: int = 0


LATENCY_PROFILES = {  # first-byte latency of common object stores, roughly
    "none": FaultPlan(),
    "s3-standard": FaultPlan(latency_median_s=0.030, latency_sigma=0.6),
    "slow": FaultPlan(latency_median_s=0.100, latency_sigma=0.5),
    "express": FaultPlan(latency_median_s=0.005, latency_sigma=0.4),
}


_ERROR_BODY = {
    503: b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
    500: b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>",
}


_PACE_CHUNK_BYTES = 64 * 1024  # granularity of the bandwidth cap


def _paced(body: Iterable[bytes], bytes_per_s: float) -> Iterator[bytes]:
    """Yield ``body`` no faster than ``bytes_per_s`` (werkzeug serves each
    connection in its own thread, so the cap is per connection)."""
    started, sent = time.monotonic(), 0
    for part in body:
        for i in range(0, len(part), _PACE_CHUNK_BYTES):
            chunk = part[i : i + _PACE_CHUNK_BYTES]
            sent += len(chunk)
            ahead = sent / bytes_per_s - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
            yield chunk


def _drop_connection(
    environ: Environ, start_response: StartResponse
) -> Iterable[bytes]:
    """Drop the request's TCP connection before any response byte, as a
    failing load balancer does: the client sees the peer disconnect."""
    sock = environ["werkzeug.socket"]
    # Linger 0: werkzeug's final close() sends RST instead of a graceful FIN.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # shutdown, not close: the descriptor stays werkzeug's (closing it here
    # could hand its number to another thread's connection).
    sock.shutdown(socket.SHUT_RDWR)
    # werkzeug's write of these headers then fails with a broken pipe, which
    # it treats as a dropped connection, quietly.
    start_response("500 Dropped", [("Content-Length", "0")])
    return []


def _synthetic_page(
    bucket: str, query: str, start_response: StartResponse
) -> list[bytes]:
    """One ListObjectsV2 page of the synthetic bucket ``synthetic-N``: the
    keys are computed from their index, the token is the next index."""
    args = {k: v[0] for k, v in parse_qs(query, keep_blank_values=True).items()}
    total = int(bucket[len(SYNTHETIC_BUCKET) :])
    prefix, max_keys = args.get("prefix", ""), int(args.get("max-keys", 1000))
    start = int(args.get("continuation-token") or 0)
    dirs = (total + SYNTHETIC_PER_DIR - 1) // SYNTHETIC_PER_DIR
    parts = [
        '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
        'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>{bucket}</Name><Prefix>{prefix}</Prefix><MaxKeys>{max_keys}</MaxKeys>"
    ]
    if prefix == "" and args.get("delimiter") == "/":
        stop = min(dirs, start + max_keys)
        parts += [
            f"<CommonPrefixes><Prefix>d{d:05d}/</Prefix></CommonPrefixes>"
            for d in range(start, stop)
        ]
        truncated = stop < dirs
    else:
        d = int(prefix[1:6]) if prefix.startswith("d") and len(prefix) >= 6 else -1
        lo = d * SYNTHETIC_PER_DIR if 0 <= d < dirs else total
        hi = min(total, lo + SYNTHETIC_PER_DIR)
        first = max(lo, start)
        stop = min(hi, first + max_keys)
        parts += [
            f"<Contents><Key>d{d:05d}/s{i:09d}.bin</Key>"
            "<LastModified>2026-01-01T00:00:00.000Z</LastModified>"
            f"<ETag>&quot;{i:032x}&quot;</ETag><Size>{SYNTHETIC_SIZE}</Size>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
            for i in range(first, stop)
        ]
        truncated = stop < hi
    parts.append(f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>")
    if truncated:
        parts.append(f"<NextContinuationToken>{stop}</NextContinuationToken>")
    parts.append("</ListBucketResult>")
    body = "".join(parts).encode()
    start_response(
        "200 OK",
        [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
    )
    return [body]


def _synthetic_object(path: str, start_response: StartResponse) -> list[bytes]:
    """A synthetic bucket's object: ``SYNTHETIC_SIZE`` bytes of its index
    (its listed ETag is no MD5 of them: read it with checksums off).

    >>> got = []
    >>> body = _synthetic_object("/synthetic-9/d00000/s000000007.bin", lambda *a: got.append(a))
    >>> len(body[0]), body[0][:9], got[0][0]
    (100, b'000000007', '200 OK')
    """
    index = path.rsplit("/s", 1)[-1].removesuffix(".bin")
    body = (index.encode() * (SYNTHETIC_SIZE // max(len(index), 1) + 1))[
        :SYNTHETIC_SIZE
    ]
    start_response(
        "200 OK",
        [("Content-Type", "application/octet-stream"),
         ("Content-Length", str(len(body))), ("ETag", f'"{int(index):032x}"')],
    )  # fmt: skip
    return [body]


def _capped(query: str, most: int) -> str:
    """A ListObjectsV2 query asking for at most ``most`` keys.

    >>> _capped("list-type=2&max-keys=1000&prefix=a", 250)
    'list-type=2&max-keys=250&prefix=a'
    """
    params = [p for p in query.split("&") if not p.startswith("max-keys=")]
    asked = [int(p[9:]) for p in query.split("&") if p.startswith("max-keys=")]
    keys = min([most, *asked])
    return "&".join([*params[:1], f"max-keys={keys}", *params[1:]])


def _object_path(environ: Environ) -> str:
    """``/bucket/key`` as the client named it. PATH_INFO is already decoded
    (as latin-1 bytes), so a key holding ``%41`` or unicode would be counted
    under another name; the raw URI decoded once is the key itself."""
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if raw is None:
        return unquote(environ.get("PATH_INFO", ""))
    return unquote(raw.split("?", 1)[0])


class S3Emulator:
    """moto's S3 on ``127.0.0.1:port`` with request counting and fault injection.

    >>> emu = S3Emulator().start()
    >>> emu.endpoint_url.startswith("http://127.0.0.1:")
    True
    >>> emu.stop()
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1"):
        self.host = host
        self.port = port
        self.gets: Counter[str] = Counter()
        self.get_bytes: Counter[str] = Counter()  # body bytes sent per object
        self.get_times: list[float] = []  # monotonic arrival time of every object GET
        self.requests = 0
        self.lists = 0  # ListObjectsV2 requests (pages), failed ones included
        self.list_errors = 0  # of those, answered with an injected error
        self.cpu_s = 0.0  # CPU time the storage side spent serving requests
        self.in_flight = 0  # requests being served now (their latency included)
        self.most_in_flight = 0  # the most at once since the counts were reset
        self.faults = FaultPlan()
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that point at this emulator with fake credentials."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url},
        }

    def start(self) -> S3Emulator:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )

        class _QuietHandler(
            MotoRequestHandler
        ):  # one log line per GET drowns the tests
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass

        moto_app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(
            self.host,
            self.port,
            self._metered(self._wrap(moto_app)),
            threaded=True,
            request_handler=_QuietHandler,
        )
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def reset_counts(self) -> None:
        with self._lock:
            self.gets.clear()
            self.get_bytes.clear()
            self.get_times.clear()
            self.requests = 0
            self.lists = 0
            self.list_errors = 0
            self.cpu_s = 0.0
            self.most_in_flight = self.in_flight

    def set_faults(self, plan: FaultPlan) -> None:
        with self._lock:
            self.faults = plan
            self._rng = random.Random(plan.seed)

    @property
    def total_gets(self) -> int:
        return sum(self.gets.values())

    @property
    def total_get_bytes(self) -> int:
        return sum(self.get_bytes.values())

    def _metered(
        self, app: Callable[[Environ, StartResponse], Iterable[bytes]]
    ) -> Callable[..., Any]:
        """Count the CPU time of every request's thread, body included, so a
        benchmark can tell the storage side's cost from the client's, and
        the requests in flight at once."""

        def metered(environ: Environ, start_response: StartResponse) -> Iterator[bytes]:
            started = time.thread_time()
            with self._lock:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                yield from app(environ, start_response)
            finally:
                used = time.thread_time() - started
                with self._lock:
                    self.cpu_s += used
                    self.in_flight -= 1

        return metered

    def _wrap(
        self, app: Callable[[Environ, StartResponse], Iterable[bytes]]
    ) -> Callable[..., Any]:
        def middleware(
            environ: Environ, start_response: StartResponse
        ) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path.startswith("/_emulator/"):
                return self._control(environ, start_response, path)
            method = environ.get("REQUEST_METHOD", "GET")
            query = environ.get("QUERY_STRING", "")
            is_object_get = (
                method == "GET" and path.count("/") >= 2 and "list-type" not in query
            )
            is_list = method == "GET" and "list-type" in query
            list_fails = False
            with self._lock:
                self.requests += 1
                plan = self.faults
                roll = self._rng.random()
                truncate = self._rng.random() < plan.truncate_rate
                reset = self._rng.random() < plan.reset_rate
                stall = self._rng.random() < plan.stall_rate
                delay = plan.latency_s + (plan.stall_s if stall else 0.0)
                if plan.latency_median_s:
                    delay += self._rng.lognormvariate(
                        math.log(plan.latency_median_s), plan.latency_sigma
                    )
                if is_object_get:
                    self.gets[_object_path(environ)] += 1
                    self.get_times.append(time.monotonic())
                elif is_list:
                    self.lists += 1  # ListObjectsV2 pages
                    list_fails = self._rng.random() < plan.list_error_rate
                    self.list_errors += list_fails
            if is_list:
                if plan.list_latency_s:
                    time.sleep(plan.list_latency_s)
                if plan.list_page_keys:
                    environ["QUERY_STRING"] = _capped(query, plan.list_page_keys)
                if list_fails:
                    return self._error(plan.error_status, start_response)
                if path.startswith("/" + SYNTHETIC_BUCKET):
                    return _synthetic_page(path.strip("/"), query, start_response)
                return app(environ, start_response)
            if not is_object_get:
                return app(environ, start_response)
            if delay:
                time.sleep(delay)
            if reset:
                return _drop_connection(environ, start_response)
            if roll < plan.error_rate:
                return self._error(plan.error_status, start_response)
            if truncate:
                return self._truncated(app, environ, start_response)
            if path.startswith("/" + SYNTHETIC_BUCKET):
                return self._counted(_synthetic_object(path, start_response), path)
            if plan.bandwidth_bytes_per_s:
                body = _paced(app(environ, start_response), plan.bandwidth_bytes_per_s)
            else:
                body = app(environ, start_response)
            return self._counted(body, _object_path(environ))

        return middleware

    def _error(self, status: int, start_response: StartResponse) -> list[bytes]:
        body = _ERROR_BODY.get(status, _ERROR_BODY[500])
        start_response(
            f"{status} Error",
            [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
        )
        return [body]

    def _counted(self, body: Iterable[bytes], path: str) -> Iterator[bytes]:
        # Counted as each part is handed to the server, before it is sent: a
        # client holding the whole body always finds it counted (a count
        # made when the body ends races the client's next look at it).
        for part in body:
            with self._lock:
                self.get_bytes[path] += len(part)
            yield part

    def _truncated(
        self,
        app: Callable[..., Iterable[bytes]],
        environ: Environ,
        start_response: StartResponse,
    ) -> Iterable[bytes]:
        captured: dict[str, Any] = {}

        def capture(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Any:
            captured["status"], captured["headers"] = status, headers
            return lambda _data: None

        body = b"".join(app(environ, capture))
        half = body[: len(body) // 2]
        headers = [
            (k, str(len(half)) if k.lower() == "content-length" else v)
            for k, v in captured["headers"]
        ]
        start_response(captured["status"], headers)
        return [half]

    def _control(
        self, environ: Environ, start_response: StartResponse, path: str
    ) -> Iterable[bytes]:
        if path == "/_emulator/stats":
            with self._lock:
                body = json.dumps(
                    {
                        "gets": dict(self.gets),
                        "total_gets": self.total_gets,
                        "requests": self.requests,
                        "lists": self.lists,
                        "list_errors": self.list_errors,
                        "cpu_s": self.cpu_s,
                        "faults": asdict(self.faults),
                    }
                )
        elif path == "/_emulator/faults" and environ.get("REQUEST_METHOD") == "POST":
            size = int(environ.get("CONTENT_LENGTH") or 0)
            self.set_faults(
                FaultPlan(**json.loads(environ["wsgi.input"].read(size) or b"{}"))
            )
            body = json.dumps(asdict(self.faults))
        elif path == "/_emulator/reset" and environ.get("REQUEST_METHOD") == "POST":
            self.reset_counts()
            body = "{}"
        else:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"unknown emulator endpoint"]
        data = body.encode()
        start_response(
            "200 OK",
            [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
        )
        return [data]

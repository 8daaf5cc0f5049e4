"""What one chunk costs each side over Flight and over the TCP stream, beside a
raw loopback socket (issue 30).

    .venv/bin/python bench/flight_cost.py --sizes-mib 1,4,16

For each size, one chunk-like file of that many random bytes in /dev/shm,
served in a process of its own, twice: by a Flight server that streams it
as one ``large_binary`` row the way ``endpoint/flight.py`` does (mapped per
request, ``mapped``, or kept mapped, ``kept``), and by a socket server that
``sendall``s it per one-byte request; and by the project's TCP stream server
(``endpoint/stream.py``, ``sendfile``) in front of an endpoint that answers
every ``get`` with that file written as a chunk file. This process is the
client: DoGet + ``read_all`` (with the gRPC channel options of
``--client-options``), ``recv_into`` one reused buffer, or the project's
``StreamClient`` (its columns viewed, as a rank gets them; ``stream`` with
its receive buffers reused once free, ``stream_fresh`` with a new buffer
per chunk). Prints one JSON line per size: best GB/s
and CPU-seconds per GB of the client and of the server, per path. CPU per
GB is the figure that holds when other work shares the cores.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

COPY_BUFFER_BYTES = 4 * 2**20
CLIENT_OPTIONS = {  # gRPC channel arguments tried on the client
    "default": [],
    "tuned": [
        ("grpc.http2.max_frame_size", 16777215),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 64 * 2**20),
        ("grpc.experimental.tcp_min_read_chunk_size", 4 * 2**20),
        ("grpc.experimental.tcp_max_read_chunk_size", 16 * 2**20),
        ("grpc.experimental.tcp_read_chunk_size", 16 * 2**20),
    ],
}


def _flight_server(port: int, path: str) -> None:
    import pyarrow as pa
    import pyarrow.flight as flight

    schema = pa.schema([("status", pa.string()), ("data", pa.large_binary())])
    with open(path, "rb") as f:
        kept = pa.py_buffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))

    class Server(flight.FlightServerBase):
        def do_get(self, context: Any, ticket: Any) -> Any:
            data = kept
            if ticket.ticket == b"mapped":
                with open(path, "rb") as f:
                    data = pa.py_buffer(
                        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    )
            offsets = pa.py_buffer(pa.array([0, data.size], pa.int64()).buffers()[1])
            column = pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, data])
            batch = pa.record_batch([pa.array(["hit"]), column], schema=schema)
            return flight.RecordBatchStream(pa.Table.from_batches([batch]))

    Server(f"grpc://127.0.0.1:{port}").serve()


def _stream_server(port: int, path: str) -> None:
    from shardcache_server.endpoint.service import EndpointSettings
    from shardcache_server.endpoint.stream import serve_stream

    class OneChunk:
        settings = EndpointSettings(stream_port=port, flight_token="bench")

        def handle(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
            if message["op"] != "get":
                return {"result": None}, []
            return {"statuses": ["hit"]}, [(Path(path), False)]

    serve_stream(OneChunk()).serve_forever()  # type: ignore[arg-type]


def _socket_server(port: int, nbytes: int) -> None:
    server = socket.create_server(("127.0.0.1", port))
    payload = memoryview(bytearray(COPY_BUFFER_BYTES))
    while True:  # the start probe connects and leaves first
        conn, _ = server.accept()
        while conn.recv(1):
            left = nbytes
            while left > 0:
                conn.sendall(payload[: min(left, COPY_BUFFER_BYTES)])
                left -= COPY_BUFFER_BYTES
        conn.close()


def _start(*args: str) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, "--serve", *args, str(port)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"server {args} did not start")


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _measure(fn: Any, nbytes: int, reps: int, server_pid: int) -> dict[str, float]:
    fn()  # warm: connection, first mapping
    best, c0, s0 = float("inf"), _cpu_s(os.getpid()), _cpu_s(server_pid)
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    gb = reps * nbytes / 1e9
    return {
        "gb_per_s": round(nbytes / best / 1e9, 3),
        "client_cpu_s_per_gb": round((_cpu_s(os.getpid()) - c0) / gb, 3),
        "server_cpu_s_per_gb": round((_cpu_s(server_pid) - s0) / gb, 3),
    }


def _one_size(nbytes: int, options: list[tuple[str, Any]]) -> dict[str, Any]:
    import numpy as np
    import pyarrow.flight as flight

    from shardcache.chunk_file import write_chunk_file
    from shardcache.config import ClientConfig
    from shardcache.transport.stream import StreamClient

    path = f"/dev/shm/flight-cost-{os.getpid()}-{nbytes}.bin"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).bytes(nbytes))
    chunk = f"/dev/shm/flight-cost-{os.getpid()}-{nbytes}.chunk"
    write_chunk_file(chunk, {"_": np.frombuffer(Path(path).read_bytes(), np.uint8)})
    reps = max(8, 256 * 2**20 // nbytes)
    fsrv, fport = _start("flight", path)
    ssrv, sport = _start("socket", str(nbytes))
    tsrv, tport = _start("stream", chunk)
    try:
        client = flight.FlightClient(
            f"grpc://127.0.0.1:{fport}", generic_options=options or None
        )
        sock = socket.create_connection(("127.0.0.1", sport))
        sink = memoryview(bytearray(nbytes))

        def recv() -> None:
            sock.sendall(b"g")
            got = 0
            while got < nbytes:
                got += sock.recv_into(sink[got:])

        def get(mode: bytes) -> Any:
            return lambda: client.do_get(flight.Ticket(mode)).read_all()

        def stream(kept: int) -> Any:
            reader = StreamClient(
                ClientConfig(remote_url=f"tcp://127.0.0.1:{tport}", remote_token="bench")
            )
            reader._buffers.kept = kept
            request = {"op": "get", "items": [["c0", "v", 0]]}
            return lambda: reader._chunks(request)

        return {
            "mib": nbytes / 2**20,
            "socket": _measure(recv, nbytes, reps, ssrv.pid),
            "flight_mapped": _measure(get(b"mapped"), nbytes, reps, fsrv.pid),
            "flight_kept": _measure(get(b"kept"), nbytes, reps, fsrv.pid),
            "stream": _measure(stream(4), nbytes, reps, tsrv.pid),
            "stream_fresh": _measure(stream(0), nbytes, reps, tsrv.pid),
        }
    finally:
        fsrv.kill()
        ssrv.kill()
        tsrv.kill()
        os.unlink(path)
        os.unlink(chunk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="1,4,16")
    ap.add_argument("--client-options", default="default", choices=CLIENT_OPTIONS)
    ap.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        kind, arg, port = args.serve
        if kind == "flight":
            _flight_server(int(port), arg)
        elif kind == "stream":
            _stream_server(int(port), arg)
        else:
            _socket_server(int(port), int(arg))
        return
    for mib in args.sizes_mib.split(","):
        row = _one_size(int(float(mib) * 2**20), CLIENT_OPTIONS[args.client_options])
        print(json.dumps({"client_options": args.client_options, **row}), flush=True)


if __name__ == "__main__":
    main()

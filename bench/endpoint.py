"""Pods outside Ray (issue 18): warm samples/s of one rank through the node-local
endpoint beside the in-Ray path, and the cross-node streams (the TCP stream and
Arrow Flight) beside a loopback socket.

    .venv/bin/python bench/endpoint.py --samples 8192 --sample-bytes 4096

One Ray node on loopback, a local Redis, ``--samples`` files of
``--sample-bytes`` under a temp directory (a ``file://`` source: the cold
read is not what is measured). This process is the cache worker (a Ray
driver running the endpoint on a Unix socket and on Flight); each rank is a
subprocess: ``ray`` (a Ray driver, the Ray path) or ``endpoint`` (no Ray,
``SHARDCACHE_ENDPOINT``). A rank reads one cold epoch, then ``--epochs``
warm epochs with ``ds.loader(--batch-size)``; the best warm epoch counts.
``remote`` streams every chunk of the (warm) dataset over Flight
(``FlightClient.resolve``) and ``tcp`` over the TCP stream
(``StreamClient.resolve``, ``sendfile`` to ``recv_into``), all in one
request and then one chunk per request (a batch-sized transfer:
``--chunk-samples`` sets the chunk), and
``socket`` copies the same bytes over a loopback TCP socket, as one
transfer and as one request/reply per chunk (sendall / recv_into, 4 MiB
buffers); each with the CPU-seconds per GB it cost. Prints one JSON line.
Compare the warm figures: the rank that runs first (``ray``) also pays for
starting the node's build workers in its cold epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[1]
COPY_BUFFER_BYTES = 4 * 2**20  # per sendall / recv_into of the loopback baseline
# The stream's dataset as the endpoint rank registered it (a file:// source).
STREAM_SPEC = {"protocol": "file", "storage_options": {}, "chunk_bytes": 16 * 2**20}


def _rank(mode: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank: a cold epoch, then warm epochs; samples/s of each."""
    from shardcache import DistributedCachedDataset

    ds = DistributedCachedDataset(
        cfg["url"],
        name=cfg["name"],
        rank=0,
        world_size=1,
        chunk_samples=cfg["chunk_samples"],
    )
    rates = []
    for epoch in range(cfg["epochs"] + 1):
        ds.set_epoch(epoch)
        started, n = time.perf_counter(), 0
        for batch in ds.loader(cfg["batch_size"]):
            n += len(batch)
        rates.append(n / (time.perf_counter() - started))
    ds.close()
    return {
        "mode": mode,
        "cold_samples_per_s": rates[0],
        "warm_samples_per_s": max(rates[1:]),
        "ray_imported": "ray" in sys.modules,
    }


def _spawn(mode: str, cfg: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--rank", mode, json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} rank failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _loopback_copy(nbytes: int, transfers: int = 1) -> tuple[float, float]:
    """GB/s of ``transfers`` request/reply exchanges of ``nbytes`` each over
    one loopback TCP connection (a sender thread; the receiver fills one
    preallocated buffer per transfer, as a client of chunk bytes would), and
    the CPU-seconds per GB both sides spent (this process)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = memoryview(bytearray(COPY_BUFFER_BYTES))

    def send() -> None:
        conn, _ = server.accept()
        while conn.recv(1):  # one byte asks for one transfer
            left = nbytes
            while left > 0:
                conn.sendall(payload[: min(left, COPY_BUFFER_BYTES)])
                left -= COPY_BUFFER_BYTES
        conn.close()

    sender = threading.Thread(target=send)
    sender.start()
    sink = memoryview(bytearray(nbytes))
    got = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(transfers):
            sock.sendall(b"g")
            filled = 0
            while filled < nbytes:
                n = sock.recv_into(sink[filled:])
                if not n:
                    break
                filled += n
            got += filled
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu0
    sender.join()
    server.close()
    return got / elapsed / 1e9, cpu / (got / 1e9)


def _stream(
    client: Any, spec: dict[str, Any], per_request: int
) -> tuple[float, float, int]:
    """Best GB/s of 3 passes over every chunk of the dataset ``spec`` names
    through ``client.resolve``, ``per_request`` chunks per request; the
    CPU-seconds per GB of that pass (this process: the client and the Flight
    server's threads), and the bytes."""
    name = spec["name"]
    manifest, digest = client.manifest(spec)
    generation = client.index.generation(name)
    items = manifest.chunk_items(range(len(manifest.layout)))
    best, cpu_per_gb, nbytes = 0.0, 0.0, 0
    for _ in range(3):
        started, cpu0, nbytes = time.perf_counter(), time.process_time(), 0
        for i in range(0, len(items), per_request):
            chunks = client.resolve(
                name, generation, items[i : i + per_request], digest
            )
            nbytes += sum(
                int(sum(c.nbytes for c in cols.values())) for _, cols in chunks
            )
        rate = nbytes / (time.perf_counter() - started) / 1e9
        if rate > best:
            best = rate
            cpu_per_gb = (time.process_time() - cpu0) / (nbytes / 1e9)
    return best, cpu_per_gb, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--sample-bytes", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3, help="warm epochs")
    parser.add_argument(
        "--chunk-samples",
        type=int,
        default=4096,
        help="samples per chunk; the batch-sized stream moves one chunk per request",
    )
    parser.add_argument("--rank", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        print(json.dumps(_rank(args.rank[0], json.loads(args.rank[1]))))
        return

    import numpy as np
    import ray

    from shardcache.config import ClientConfig
    from shardcache.embedded import (
        free_port,
        start_loopback_cluster,
        start_redis_server,
    )
    from shardcache.transport.flight import FlightClient
    from shardcache.transport.stream import StreamClient
    from shardcache_server.endpoint import Endpoint, EndpointSettings, serve_unix
    from shardcache_server.endpoint.flight import serve_flight
    from shardcache_server.endpoint.stream import serve_stream

    tmp = Path(tempfile.mkdtemp(prefix="sc-endpoint-bench-"))
    data = tmp / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(args.samples):
        (data / f"s{i:07d}.bin").write_bytes(rng.bytes(args.sample_bytes))
    redis_proc, redis_url = start_redis_server(tmp, password="bench")
    cluster = start_loopback_cluster(1, 2 * args.samples * args.sample_bytes + 2**28)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
    token = "bench-token"
    settings = EndpointSettings(
        redis_url=redis_url,
        namespace="bench",
        ray_address=cluster.address,
        endpoint_socket=str(tmp / "endpoint.sock"),
        # memory-backed, as the chart's emptyDir (medium: Memory)
        endpoint_shm_dir=tempfile.mkdtemp(prefix="sc-bench-", dir="/dev/shm"),
        endpoint_shm_bytes=4 * args.samples * args.sample_bytes + 2**26,
        flight_port=free_port(),
        stream_port=free_port(),
        flight_token=token,
        node_name="bench-node",
    )
    endpoint = Endpoint(settings)
    endpoint.start()
    unix = serve_unix(endpoint)
    threading.Thread(target=unix.serve_forever, daemon=True).start()
    flight = serve_flight(endpoint)
    threading.Thread(target=flight.serve, daemon=True).start()
    stream = serve_stream(endpoint)
    threading.Thread(target=stream.serve_forever, daemon=True).start()
    base_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SHARDCACHE_", "RAY_"))
    }
    base_env["PYTHONPATH"] = f"{ROOT / 'sdk'}:{ROOT / 'services'}"
    base_env["SHARDCACHE_NAMESPACE"] = "bench"
    url = f"file://{data}/"
    cfg = {
        "url": url,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "chunk_samples": args.chunk_samples,
    }
    try:
        ray_rank = _spawn(
            "ray",
            {**cfg, "name": "bench-ray"},
            {
                **base_env,
                "SHARDCACHE_REDIS_URL": redis_url,
                "SHARDCACHE_RAY_ADDRESS": cluster.address,
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            },
        )
        endpoint_rank = _spawn(
            "endpoint",
            {**cfg, "name": "bench-endpoint"},
            {**base_env, "SHARDCACHE_ENDPOINT": settings.endpoint_socket},
        )
        # The remote stream: every chunk of the (now warm) endpoint dataset,
        # all in one request (up to 128 chunks) and one chunk per request.
        client = FlightClient(
            ClientConfig(
                namespace="bench",
                remote_url=f"grpc://127.0.0.1:{settings.flight_port}",
                remote_token=token,
            )
        )
        spec = {
            **STREAM_SPEC,
            "name": "bench-endpoint",
            "urls": url,
            "chunk_samples": args.chunk_samples,
        }
        whole, whole_cpu, nbytes = _stream(client, spec, 128)
        per_chunk, per_chunk_cpu, _ = _stream(client, spec, 1)
        tcp_client = StreamClient(
            ClientConfig(
                namespace="bench",
                remote_url=f"tcp://127.0.0.1:{settings.stream_port}",
                remote_token=token,
            )
        )
        tcp_whole, tcp_whole_cpu, _ = _stream(tcp_client, spec, 128)
        tcp_chunk, tcp_chunk_cpu, _ = _stream(tcp_client, spec, 1)
        chunks = -(-args.samples // args.chunk_samples)
        loopback, loopback_cpu = max(_loopback_copy(nbytes) for _ in range(3))
        loopback_per_chunk, loopback_per_chunk_cpu = max(
            _loopback_copy(nbytes // chunks, chunks) for _ in range(3)
        )
        print(
            json.dumps(
                {
                    "samples": args.samples,
                    "sample_bytes": args.sample_bytes,
                    "batch_size": args.batch_size,
                    "ray_path": ray_rank,
                    "endpoint": endpoint_rank,
                    "remote_stream_gb_per_s": round(whole, 3),
                    "loopback_socket_gb_per_s": round(loopback, 3),
                    "stream_bytes": nbytes,
                    "chunk_bytes": nbytes // chunks,
                    "remote_per_chunk_gb_per_s": round(per_chunk, 3),
                    "tcp_stream_gb_per_s": round(tcp_whole, 3),
                    "tcp_per_chunk_gb_per_s": round(tcp_chunk, 3),
                    "loopback_per_chunk_gb_per_s": round(loopback_per_chunk, 3),
                    # CPU-seconds per GB moved (both ends, this process): the
                    # figure that holds when other work shares the cores.
                    "cpu_s_per_gb": {
                        "remote_stream": round(whole_cpu, 3),
                        "loopback_socket": round(loopback_cpu, 3),
                        "remote_per_chunk": round(per_chunk_cpu, 3),
                        "tcp_stream": round(tcp_whole_cpu, 3),
                        "tcp_per_chunk": round(tcp_chunk_cpu, 3),
                        "loopback_per_chunk": round(loopback_per_chunk_cpu, 3),
                    },
                    "cpus": os.cpu_count(),
                }
            )
        )
    finally:
        unix.shutdown()
        flight.shutdown()
        stream.shutdown()
        endpoint.files.clear()
        Path(settings.endpoint_shm_dir).rmdir()
        ray.shutdown()
        cluster.shutdown()
        redis_proc.terminate()


if __name__ == "__main__":
    main()

"""The TCP stream between a rank and another node's cache worker, on the wire.

The server and client are the real ones, over real loopback sockets, plain
and TLS (an openssl certificate); the endpoint behind the server answers
from chunk files written by ``chunk_file.py``, so what is checked here is
the transport alone: bytes equal to the files, aligned views, the token
refused before any request reaches the endpoint, files handed over once
deleted, a dropped server reported as the project's error. A rank reading
a real cache worker this way, in a pod of its own, is
``test_endpoint.py::test_endpoint_allow_remote_streams_from_another_nodes_worker``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardcache.chunk_file import write_chunk_file
from shardcache.config import ClientConfig
from shardcache.embedded import free_port
from shardcache.errors import ConfigError, EndpointUnavailable, SourceNotFound
from shardcache.transport.stream import StreamClient
from shardcache.transport.wire import error_reply
from shardcache_server.endpoint.service import EndpointSettings
from shardcache_server.endpoint.stream import serve_stream

from helpers import self_signed_certificate

TOKEN = "stream-token-7"


class _Files:
    """Answers as the endpoint does: a reply and the chunk files to hand over."""

    def __init__(self, settings: EndpointSettings, files: dict[str, tuple[Path, bool]]):
        self.settings = settings
        self.files = files
        self.seen: list[dict[str, Any]] = []

    def handle(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        self.seen.append(message)
        if message["op"] != "get":
            return {"result": "ok"}, []
        keys = [key for key, _, _ in message["items"]]
        if "gone" in keys:
            return error_reply(SourceNotFound("object gone was deleted")), []
        return {"statuses": ["hit", "disk-read", "fetched"][: len(keys)]}, [
            self.files[k] for k in keys
        ]


def _certificate(directory: Path) -> tuple[Path, Path]:
    return self_signed_certificate(directory / "stream.crt", directory / "stream.key")


@pytest.fixture(params=["tcp", "tls"])
def served(request, tmp_path):
    """A stream server on loopback with three chunk files behind it."""
    columns = {
        "a": {"_": np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)},
        "b": {"_": np.full((2, 5), 7, dtype=np.int64), "y": np.arange(2)},
        # larger than a socket buffer many times over, odd-sized rows
        "c": {"_": np.random.default_rng(0).integers(0, 255, (9, 700_001), np.uint8)},
    }
    files = {}
    for key, cols in columns.items():
        path = tmp_path / f"{key}.chunk"
        write_chunk_file(path, cols)
        files[key] = (path, key == "b")  # b is handed over once
    tls = {}
    if request.param == "tls":
        cert, key = _certificate(tmp_path)
        tls = {"flight_tls_cert": str(cert), "flight_tls_key": str(key)}
    settings = EndpointSettings(stream_port=free_port(), flight_token=TOKEN, **tls)
    endpoint = _Files(settings, files)
    server = serve_stream(endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = ClientConfig(
        remote_url=f"{request.param}://127.0.0.1:{settings.stream_port}",
        remote_token=TOKEN,
        remote_ca=tls.get("flight_tls_cert"),
        request_timeout_s=10,
    )
    yield {"server": server, "endpoint": endpoint, "columns": columns,
           "files": files, "config": config}  # fmt: skip
    server.shutdown()
    server.server_close()


def test_stream_chunks_arrive_equal_aligned_and_as_peer_hits(served):
    client = StreamClient(served["config"])
    got = client._chunks({"op": "get", "items": [["a", "1", 0], ["b", "1", 0], ["c", "1", 0]]})
    assert [status for status, _ in got] == ["remote-hit", "remote-hit", "fetched"]
    for (_, cols), key in zip(got, "abc", strict=True):
        expected = served["columns"][key]
        assert set(cols) == set(expected)
        for name, array in expected.items():
            assert cols[name].dtype == array.dtype and np.array_equal(cols[name], array)
            assert cols[name].flags.aligned and cols[name].ctypes.data % 64 == 0
    assert not served["files"]["b"][0].exists()  # handed over once: deleted
    assert served["files"]["a"][0].exists()
    sent = sum(path.stat().st_size for path, _ in (served["files"]["a"], served["files"]["c"]))
    assert client.received_bytes > sent and client.received_s > 0
    # The token went with the first frame only and never reached the endpoint.
    assert [m["op"] for m in served["endpoint"].seen] == ["hello", "get"]
    assert all("token" not in m for m in served["endpoint"].seen)
    # The connection is kept: a control call is one more frame on it.
    assert client.call("generation", name="x") == "ok"
    assert [m["op"] for m in served["endpoint"].seen] == ["hello", "get", "generation"]


def test_stream_error_replies_are_the_projects_errors_and_the_connection_lives_on(served):
    client = StreamClient(served["config"])
    with pytest.raises(SourceNotFound, match="gone was deleted"):
        client._chunks({"op": "get", "items": [["gone", "1", 0]]})
    (_, cols), = client._chunks({"op": "get", "items": [["a", "1", 0]]})
    assert np.array_equal(cols["_"], served["columns"]["a"]["_"])


def test_stream_refuses_a_wrong_token_before_any_request(served):
    for token in ("nope", None):
        config = served["config"].model_copy(update={"remote_token": token})
        with pytest.raises(ConfigError, match="missing or wrong token"):
            StreamClient(config)._chunks({"op": "get", "items": [["a", "1", 0]]})
    assert served["endpoint"].seen == []


def test_stream_without_its_server_is_endpoint_unavailable_naming_the_url(served):
    client = StreamClient(served["config"])
    client.call("generation", name="x")
    served["server"].shutdown()
    served["server"].server_close()
    # The kept connection may still be served by its handler thread, so ask a
    # fresh client too: nobody listens on the port any more.
    with pytest.raises(EndpointUnavailable, match="SHARDCACHE_REMOTE_URL"):
        StreamClient(served["config"]).call("generation", name="x")


def test_stream_port_needs_a_token_and_both_tls_files():
    with pytest.raises(ConfigError, match="SHARDCACHE_FLIGHT_TOKEN"):
        serve_stream(_Files(EndpointSettings(stream_port=free_port()), {}))
    with pytest.raises(ConfigError, match="or neither"):
        serve_stream(
            _Files(
                EndpointSettings(
                    stream_port=free_port(), flight_token="t", flight_tls_cert="/x.crt"
                ),
                {},
            )
        )


def test_stream_reuses_a_receive_buffer_only_once_nothing_views_it(served):
    client = StreamClient(served["config"])

    def chunk_a():
        ((_, cols),) = client._chunks({"op": "get", "items": [["a", "1", 0]]})
        return cols["_"]

    held = chunk_a()
    sample = held[1]  # a sample a training step keeps
    del held
    again = chunk_a()
    # The first buffer is still viewed by `sample`: a new one was taken.
    assert not np.shares_memory(again, sample)
    assert np.array_equal(sample, served["columns"]["a"]["_"][1])
    address = again.ctypes.data
    del again
    reused = chunk_a()  # the second buffer is free again: written in place
    assert reused.ctypes.data == address
    assert np.array_equal(reused, served["columns"]["a"]["_"])
    assert np.array_equal(sample, served["columns"]["a"]["_"][1])  # untouched
    import torch

    tensor = torch.from_numpy(reused)
    del reused
    other = chunk_a()  # the tensor views the buffer: never written again
    assert other.ctypes.data != tensor.data_ptr()
    assert len(client._buffers._raw) <= client._buffers.kept

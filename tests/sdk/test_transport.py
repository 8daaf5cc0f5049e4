"""The transports without a cluster: the wire format over a real socket pair, how
the read path is chosen, preprocess by name, and the Transport protocol's cut."""

from __future__ import annotations

import contextlib
import os
import socket

import numpy as np
import pytest

from shardcache.chunk_file import read_chunk_buffer, write_chunk_file
from shardcache.chunks import FAILED
from shardcache.config import ClientConfig
from shardcache.decoders import raw_bytes
from shardcache.delivery import collate
from shardcache.errors import ConfigError, EndpointUnavailable, ShardCacheError
from shardcache.fingerprint import fingerprint
from shardcache.manifest import Manifest
from shardcache.reader import ChunkReader
from shardcache.transport.base import Status, Transport
from shardcache.transport.direct import CacheClient
from shardcache.transport.flight import FlightClient
from shardcache.transport.read_path import open_client
from shardcache.transport.stream import StreamClient
from shardcache.transport.unix import EndpointClient, _map_fd
from shardcache.transport.wire import (
    callable_name,
    load_callable,
    recv_frame,
    send_frame,
)


def test_endpoint_frames_carry_json_and_read_only_descriptors(tmp_path):
    path = tmp_path / "c0.chunk"
    write_chunk_file(path, {"_": np.arange(12, dtype=np.int32).reshape(3, 4)})
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.open(path, os.O_RDONLY)
    try:
        send_frame(a, {"op": "get", "statuses": ["hit"], "big": "x" * 100_000}, [fd])
        message, fds = recv_frame(b)
    finally:
        os.close(fd)
        a.close()
        b.close()
    assert message["statuses"] == ["hit"] and len(message["big"]) == 100_000
    (got,) = fds
    columns, _ = _map_fd(got, "chunk c0")
    os.close(got)  # the mapping outlives the descriptor
    assert columns["_"].tolist() == np.arange(12).reshape(3, 4).tolist()
    with pytest.raises(ValueError):
        columns["_"][0, 0] = 1  # read-only


def test_endpoint_frame_refuses_a_closed_peer():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.close()
    with pytest.raises(EOFError):
        recv_frame(b)
    b.close()


def test_endpoint_open_client_chooses_the_read_path(tmp_path):
    missing = str(tmp_path / "endpoint.sock")
    with pytest.raises(EndpointUnavailable, match="node gpu-7.*endpoint.sock"):
        open_client(ClientConfig(endpoint=missing, node_name="gpu-7"))
    with pytest.raises(EndpointUnavailable, match="gpu-7"):
        open_client(ClientConfig(node_name="gpu-7"))  # the pod says where it is
    with pytest.raises(ConfigError, match="SHARDCACHE_REMOTE_URL"):
        open_client(ClientConfig(node_name="gpu-7", allow_remote=True))
    remote = open_client(
        ClientConfig(allow_remote=True, remote_url="grpc://10.0.0.1:8815")
    )
    assert isinstance(remote, FlightClient) and remote.remote
    for url in ("tcp://10.0.0.1:8816", "tls://cache.ns.svc:8816"):
        stream = open_client(ClientConfig(allow_remote=True, remote_url=url))
        assert isinstance(stream, StreamClient) and stream.remote
    for url in ("http://x:1", "tcp://x", "tcp://:8816", "tls://x:port"):
        with pytest.raises(ConfigError, match="remote_url"):
            open_client(ClientConfig(allow_remote=True, remote_url=url))
    with pytest.raises(ConfigError, match="remote_ca"):
        open_client(
            ClientConfig(
                allow_remote=True,
                remote_url="tls://x:8816",
                remote_ca=str(tmp_path / "missing.crt"),
            )
        )
    assert isinstance(open_client(ClientConfig()), CacheClient)  # a Ray node
    server = socket.socket(socket.AF_UNIX)
    server.bind(missing)
    try:
        assert isinstance(open_client(ClientConfig(endpoint=missing)), EndpointClient)
    finally:
        server.close()


def _script_fn(data: bytes) -> bytes:
    return data


def test_endpoint_preprocess_goes_by_importable_name_with_the_same_fingerprint():
    assert callable_name(raw_bytes, "preprocess") == "shardcache.decoders:raw_bytes"
    with pytest.raises(ConfigError, match="module-level"):
        callable_name(lambda b: b, "preprocess")
    _script_fn.__module__ = "__main__"  # as if defined in the training script
    with pytest.raises(ConfigError, match="module-level"):
        callable_name(_script_fn, "preprocess")
    name = "shardcache.decoders:raw_bytes"
    assert load_callable(name, fingerprint(raw_bytes), "preprocess") is raw_bytes
    with pytest.raises(ConfigError, match="differs"):
        load_callable(name, "0" * 16, "preprocess")
    with pytest.raises(ConfigError, match="cannot import"):
        load_callable("no_such_module:f", "0" * 16, "preprocess")


def test_the_librarys_own_decode_reaches_the_stores_as_itself_from_a_checkout(
    monkeypatch,
):
    """User code from a module that is not installed travels by value, so
    that kept store processes run the code as it is now. The library's own
    default ``.npy`` decode must not: the builder knows it by identity and
    reads local ``.npy`` files straight into the chunk's column. Installed
    editable, as the README's bootstrap installs it, shardcache's own files
    are not under an installed root, and every build took the general path
    (two more copies of every byte)."""
    import sys

    import ray.cloudpickle

    from shardcache.decoders import decode_npy
    from shardcache.transport import direct

    monkeypatch.setattr(direct, "is_installed", lambda path: False)  # a checkout
    module = sys.modules["shardcache.decoders"]
    try:
        direct._pickle_user_code_by_value(decode_npy)
        assert ray.cloudpickle.loads(ray.cloudpickle.dumps(decode_npy)) is decode_npy
    finally:
        with contextlib.suppress(ValueError):  # registered only without the fix
            ray.cloudpickle.unregister_pickle_by_value(module)


def test_endpoint_chunk_buffer_rejects_foreign_bytes():
    from shardcache.errors import ChunkFileError

    with pytest.raises(ChunkFileError, match="not a chunk file"):
        read_chunk_buffer(b"x" * 64, "streamed chunk")


def test_remote_chunk_bytes_are_viewed_in_place_unless_a_column_would_be_misaligned(
    tmp_path,
):
    import pyarrow as pa

    from shardcache.transport.flight import _columns

    for dtype, copied in ((np.uint8, False), (np.int64, True)):
        path = tmp_path / f"{np.dtype(dtype).name}.chunk"
        write_chunk_file(path, {"_": np.arange(24, dtype=dtype).reshape(4, 6)})
        raw = bytearray(1) + bytearray(path.read_bytes())  # received at offset 1
        buf = pa.py_buffer(raw).slice(1)
        columns = _columns(buf)
        assert columns["_"].tolist() == np.arange(24).reshape(4, 6).tolist()
        assert columns["_"].flags.aligned
        assert np.shares_memory(columns["_"], np.frombuffer(raw, np.uint8)) != copied


def test_transport_every_client_implements_the_protocol(tmp_path):
    clients = [
        CacheClient(ClientConfig()),
        EndpointClient(ClientConfig(), str(tmp_path / "endpoint.sock")),
        FlightClient(ClientConfig(remote_url="grpc://10.0.0.1:8815")),
        StreamClient(ClientConfig(remote_url="tcp://10.0.0.1:8816")),
    ]
    assert [isinstance(c, Transport) for c in clients] == [True] * 4
    assert [(c.needs_ray, c.remote) for c in clients] == [
        (True, False),
        (False, False),
        (False, True),
        (False, True),
    ]


class _ListTransport:
    """A transport over chunks held in a dict: what a test double needs to
    implement for the reader, and nothing else (the cut of transport/base.py)."""

    needs_ray = False
    remote = False
    index = None
    redis_url = ""
    retryable_errors = (ShardCacheError,)

    def __init__(self, chunks: dict[str, dict[str, np.ndarray]]):
        self.config = ClientConfig()
        self.chunks = chunks
        self.calls: list[list[str]] = []

    def manifest(self, spec, token="", *, early=False):
        raise NotImplementedError

    def leading(self, name, digest):
        return None

    def manifest_of(self, name, digest):
        raise NotImplementedError

    def map_manifest(self, handle):
        return handle

    def install(self, spec, preprocess, target=None):
        pass

    def resolve(
        self, name, generation, items, digest=None, *, prefer_files=False, reader=""
    ):
        self.calls.append([key for key, _, _ in items])
        status = Status.FETCHED if len(self.calls) == 1 else Status.HIT
        return [(status, self.chunks[key]) for key, _, _ in items]

    def drop_corrupt(self, name, generation, chunk, version):
        return False


def _two_chunk_reader() -> tuple[_ListTransport, ChunkReader]:
    """A reader over 6 samples in chunks c0 (0-2) and c1 (3-5) of a dict."""
    manifest = Manifest.from_entries(
        "file", [f"/d/{i}" for i in range(6)], [4] * 6, ["e"] * 6
    )
    manifest.columns["chunk_starts"] = np.array([0, 3, 6])
    transport = _ListTransport(
        {
            "c0": {"_": np.arange(3)[:, None] * [1, 1], FAILED: np.zeros(3, bool)},
            "c1": {"_": np.arange(3, 6)[:, None] * [1, 1], FAILED: np.zeros(3, bool)},
        }
    )
    reader = ChunkReader(transport, "ds", manifest, manifest.digest, 2**20, 5.0)
    reader.use_generation(1)
    return transport, reader


def test_transport_a_test_double_drives_the_reader_and_statuses_count_as_origins():
    transport, reader = _two_chunk_reader()
    assert isinstance(transport, Transport)
    indices = np.array([5, 0, 4])
    chunk_ids, rows = reader.locate(indices)
    chunks = reader.chunks_for(chunk_ids)
    batch = collate(chunks, chunk_ids, rows, indices, False, reader.manifest.url)
    assert batch[:, 0].tolist() == [5, 0, 4]
    assert reader.count(chunk_ids, indices)["source"] == 3  # Status.FETCHED
    reader.new_epoch()
    assert reader.count(chunk_ids, indices)["local"] == 3  # held since
    assert transport.calls == [["c0", "c1"]]  # one call for the batch's chunks


def test_a_sample_read_from_the_source_counts_as_source_once_per_epoch():
    # The loop, then ds[i] over the same samples in the same epoch (or a
    # padded repeat): one GET per object, so one source count per sample.
    transport, reader = _two_chunk_reader()
    first = np.array([0, 1, 3, 3])  # row 3 twice in one batch
    chunk_ids, _ = reader.locate(first)
    reader.chunks_for(chunk_ids)
    assert reader.count(chunk_ids, first) == {
        **dict.fromkeys(reader.counts, 0),
        "source": 3, "source_bytes": 12, "local": 1, "local_bytes": 4,
    }  # fmt: skip
    again = np.arange(6)
    chunk_ids, _ = reader.locate(again)
    reader.chunks_for(chunk_ids)
    batch = reader.count(chunk_ids, again)
    assert (batch["source"], batch["local"]) == (3, 3)  # 2, 4, 5 are new
    assert (reader.counts["source"], reader.counts["local"]) == (6, 4)
    reader.new_epoch()
    assert reader.count(chunk_ids, again)["local"] == 6


def test_transport_an_error_crosses_the_wire_as_its_own_type_and_never_as_a_builtin():
    from shardcache.errors import BackendError, SourceNotFound
    from shardcache.transport.wire import error_reply, raise_reply_error

    with pytest.raises(SourceNotFound, match="gone"):
        raise_reply_error(error_reply(SourceNotFound("gone")))
    with pytest.raises(BackendError, match="boom") as err:
        raise_reply_error({"error": {"type": "SystemExit", "message": "boom"}})
    assert type(err.value) is BackendError
    raise_reply_error({"result": 1})  # no error: returns

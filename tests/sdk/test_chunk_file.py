"""Chunk files round-trip a chunk's columns without pickle and refuse bad files."""

from __future__ import annotations

import numpy as np
import pytest

from shardcache.chunk_file import read_chunk_file, write_chunk_file
from shardcache.chunks import Chunk
from shardcache.errors import ChunkFileError
from shardcache_server.columns import build_chunk


def test_chunk_file_round_trips_a_ragged_dict_chunk_zero_copy(tmp_path):
    samples = [
        {"img": np.full((i + 1, 2), i, np.uint8), "y": np.array(i, np.float32)}
        for i in range(5)
    ]
    columns = build_chunk(samples)
    write_chunk_file(tmp_path / "c", columns, {"version": "abc"})
    back, meta = read_chunk_file(tmp_path / "c")
    assert meta == {"version": "abc"}
    assert set(back) == set(columns)
    for name, array in columns.items():
        assert back[name].dtype == array.dtype and np.array_equal(back[name], array)
        assert not back[name].flags.writeable  # a read-only mapping, not a copy
        assert back[name].ctypes.data % 64 == 0
    chunk = Chunk(back)
    assert np.array_equal(chunk.sample(3)["img"], samples[3]["img"])


def test_chunk_file_refuses_object_columns_and_corrupt_files(tmp_path):
    with pytest.raises(ChunkFileError, match="'names'"):
        write_chunk_file(tmp_path / "x", {"names": np.array(["a", None], dtype=object)})
    (tmp_path / "junk").write_bytes(b"not a chunk file at all")
    with pytest.raises(ChunkFileError, match="bad magic"):
        read_chunk_file(tmp_path / "junk")
    write_chunk_file(tmp_path / "c", {"_": np.arange(1000, dtype=np.int64)})
    data = (tmp_path / "c").read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 2])
    with pytest.raises(ChunkFileError, match="corrupt or truncated"):
        read_chunk_file(tmp_path / "cut")
    with pytest.raises(ChunkFileError, match="cannot map"):
        read_chunk_file(tmp_path / "missing")

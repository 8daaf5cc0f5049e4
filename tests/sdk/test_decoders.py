"""decode_npy reads every .npy numpy writes, as np.load does, through its header cache."""

from __future__ import annotations

import io

import numpy as np
import pytest

from shardcache.decoders import decode_npy, npy_layout


def _npy(array: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buf = io.BytesIO()
    if version is None:
        np.save(buf, array, allow_pickle=True)
    else:
        np.lib.format.write_array(buf, array, version=version)
    return buf.getvalue()


@pytest.mark.parametrize(
    "array",
    [
        np.full((3, 224, 224), 7, np.uint8),
        np.arange(12, dtype=">f8").reshape(3, 4),
        np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        np.zeros((0, 3), np.int16),
        np.array(5.0),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<f2")]),
    ],
    ids=["image", "big-endian", "fortran", "empty", "scalar", "structured"],
)
def test_decode_npy_equals_np_load_and_is_writable(array):
    data = _npy(array)
    out, ref = decode_npy(data), np.load(io.BytesIO(data))
    assert (out.dtype, out.shape) == (ref.dtype, ref.shape)
    assert np.array_equal(out, ref)
    assert out.flags.f_contiguous == ref.flags.f_contiguous
    assert out.flags.writeable  # a copy, not a read-only view of the bytes


def test_decode_npy_reads_format_2_and_3_headers():
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    for version in [(1, 0), (2, 0), (3, 0)]:
        assert np.array_equal(decode_npy(_npy(array, version)), array)


def test_decode_npy_parses_each_distinct_header_once():
    npy_layout.cache_clear()
    for i in range(20):
        decode_npy(_npy(np.full((4, 4), i, np.float32)))
    decode_npy(_npy(np.zeros(3, np.int8)))
    assert npy_layout.cache_info().misses == 2


def test_decode_npy_refuses_object_arrays_and_bad_bytes_like_np_load():
    with pytest.raises(ValueError, match="allow_pickle"):
        decode_npy(_npy(np.array([1, "x"], dtype=object)))
    with pytest.raises(ValueError):
        decode_npy(_npy(np.zeros(100, np.float64))[:-8])  # the data cut short
    with pytest.raises(ValueError):
        decode_npy(b"not a numpy file at all")

"""build_chunk: samples laid out as a chunk's columns, read back with Chunk."""

from __future__ import annotations

import numpy as np
import pytest

from shardcache.chunks import Chunk
from shardcache.errors import PreprocessError
from shardcache_server.columns import build_chunk


def test_build_chunk_equal_shapes_stack_and_read_back_zero_copy():
    samples = [np.full((3, 2), i, dtype=np.float32) for i in range(5)]
    chunk = Chunk(build_chunk(samples))
    assert chunk.columns["_"].shape == (5, 3, 2)
    assert np.array_equal(chunk.sample(4), samples[4])
    assert np.shares_memory(chunk.sample(4), chunk.columns["_"])


def test_build_chunk_ragged_concatenates_with_offsets():
    samples = [np.arange(n, dtype=np.int16) for n in (1, 3, 0, 2)]
    chunk = Chunk(build_chunk(samples))
    assert "_" not in chunk.columns and chunk.columns["_/data"].shape == (6,)
    for i, s in enumerate(samples):
        assert np.array_equal(chunk.sample(i), s)


def test_build_chunk_dicts_of_mixed_layouts():
    samples = [
        {"image": np.full((2, 2), i, np.uint8), "tokens": np.arange(i + 1)}
        for i in range(3)
    ]
    chunk = Chunk(build_chunk(samples))
    assert chunk.fields == ["image", "tokens"] and not chunk.is_plain
    assert "image" in chunk.columns and "tokens/data" in chunk.columns
    got = chunk.sample(2)
    assert np.array_equal(got["image"], samples[2]["image"])
    assert np.array_equal(got["tokens"], samples[2]["tokens"])


def test_build_chunk_failed_member_is_marked_and_rest_served():
    chunk = Chunk(
        build_chunk(
            [np.ones(2), None, np.zeros(2)],
            errors={1: ("SourceNotFound", "s3://b/1 is gone")},
        )
    )
    assert chunk.failed.tolist() == [False, True, False]
    assert chunk.error(1) == ("SourceNotFound", "s3://b/1 is gone")
    assert chunk.error(0) is None
    assert np.array_equal(chunk.sample(2), np.zeros(2))


@pytest.mark.parametrize(
    "samples, match",
    [
        ([np.zeros(2, np.float32), np.zeros(2, np.int64)], "dtype"),
        ([np.zeros(2), np.zeros((2, 2))], "dimensions"),
    ],
)
def test_build_chunk_disagreeing_samples_name_both_members(samples, match):
    with pytest.raises(PreprocessError, match=match) as err:
        build_chunk(samples, names=["s3://b/x", "s3://b/y"])
    assert "s3://b/x" in str(err.value) and "s3://b/y" in str(err.value)


def test_a_sample_with_other_fields_fails_alone_and_names_both_sets():
    # A tar sample missing its .cls: the others build, it is a failed member
    # (the rank raises PreprocessError for it, or skips it alone).
    samples = [{"jpg": np.zeros(2), "cls": np.int64(i)} for i in range(4)]
    samples[2] = {"jpg": np.zeros(2)}
    names = [f"s.tar#b{i}" for i in range(4)]
    chunk = Chunk(build_chunk(samples, names=names))
    kind, message = chunk.error(2)
    assert kind == "PreprocessError" and "s.tar#b2" in message and "'cls'" in message
    assert [chunk.error(i) for i in (0, 1, 3)] == [None] * 3
    assert int(chunk.sample(3)["cls"]) == 3

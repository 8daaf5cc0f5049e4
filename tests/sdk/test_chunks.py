"""Chunk layout, columnar build, gather and the compact manifest: pure functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardcache.chunks import Chunk, batch_shape, build_chunk, gather, plan_chunks
from shardcache.errors import CollateError, PreprocessError
from shardcache.manifest import Manifest


def test_plan_chunks_bounds_count_and_bytes_and_covers():
    sizes = np.random.default_rng(0).integers(1, 5000, size=10_000)
    layout = plan_chunks(sizes, max_bytes=100_000, max_samples=64)
    assert layout.starts[0] == 0 and layout.starts[-1] == len(sizes)
    assert (layout.sizes() >= 1).all() and (layout.sizes() <= 64).all()
    per_chunk = np.add.reduceat(sizes, layout.starts[:-1])
    # a chunk closes after the member that crosses a bucket boundary
    assert (per_chunk <= 100_000 + sizes.max()).all()
    idx = np.array([0, 63, 64, 9_999])
    assert (layout.starts[layout.chunk_of(idx)] <= idx).all()


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
        ([{"a": np.zeros(1)}, {"b": np.zeros(1)}], "same fields"),
    ],
)
def test_build_chunk_disagreeing_samples_name_both_members(samples, match):
    with pytest.raises(PreprocessError, match=match) as err:
        build_chunk(samples, names=["s3://b/x", "s3://b/y"])
    assert "s3://b/x" in str(err.value) and "s3://b/y" in str(err.value)


def test_gather_equals_stacking_the_samples():
    rng = np.random.default_rng(1)
    chunks = [Chunk(build_chunk([rng.random(4) for _ in range(10)])) for _ in range(3)]
    picks = [(c, r) for c in range(3) for r in (0, 9, 5)]
    rng.shuffle(picks)
    in_batch = [chunks[c] for c, _ in picks]
    rows = [r for _, r in picks]
    out = torch.empty(
        (len(picks), *batch_shape(in_batch, rows, "_")), dtype=torch.float64
    )
    gather(in_batch, rows, "_", out.numpy())
    expected = np.stack([chunks[c].sample(r) for c, r in picks])
    assert np.array_equal(out.numpy(), expected)


def test_batch_shape_of_ragged_samples_is_collate_error():
    chunk = Chunk(build_chunk([np.zeros(2), np.zeros(3)]))
    with pytest.raises(CollateError, match=r"\[2\] and \[3\]"):
        batch_shape([chunk, chunk], [0, 1], "_")


def test_manifest_versions_change_only_for_the_changed_chunk():
    urls = [f"s3://b/{i:03d}" for i in range(100)]
    etags = [f"e{i}" for i in range(100)]
    a = Manifest.from_entries("s3", urls, [10] * 100, etags)
    etags[42] = "changed"
    b = Manifest.from_entries("s3", urls, [10] * 100, etags)
    layout = a.plan(max_bytes=1 << 20, max_samples=16)
    va, vb = a.chunk_versions(layout), b.chunk_versions(layout)
    changed = np.flatnonzero(va != vb).tolist()
    assert changed == [int(layout.chunk_of(np.array([42]))[0])]
    lo, hi = layout.bounds(changed[0])
    assert b.changed_rows(lo, hi, a.hashes[lo:hi]).tolist() == [42 - lo]
    assert a.digest != b.digest


def test_manifest_round_trips_through_its_object_form():
    m = Manifest.from_entries("file", ["/d/é", "/d/b"], [1, 2], ["x", "y"])
    back = Manifest.from_object(m.to_object())
    assert back.urls() == ["/d/é", "/d/b"] and back.digest == m.digest

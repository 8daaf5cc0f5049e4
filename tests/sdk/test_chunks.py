"""Chunk layout, gather and the compact manifest: pure functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardcache.chunks import Chunk, batch_shape, gather, plan_chunks
from shardcache.errors import CollateError
from shardcache.manifest import Manifest
from shardcache_server.columns import build_chunk  # makes chunks to read


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


def test_gather_equals_stacking_the_samples():
    rng = np.random.default_rng(1)
    chunks = [Chunk(build_chunk([rng.random(4) for _ in range(10)])) for _ in range(3)]
    picks = [(c, r) for c in range(3) for r in (0, 9, 5)]
    rng.shuffle(picks)
    by_id = dict(enumerate(chunks))
    ids, rows = [c for c, _ in picks], [r for _, r in picks]
    out = torch.empty(
        (len(picks), *batch_shape(by_id, ids, rows, "_")), dtype=torch.float64
    )
    gather(by_id, ids, rows, "_", out.numpy())
    expected = np.stack([chunks[c].sample(r) for c, r in picks])
    assert np.array_equal(out.numpy(), expected)


def test_batch_shape_of_ragged_samples_is_collate_error():
    chunk = Chunk(build_chunk([np.zeros(2), np.zeros(3)]))
    with pytest.raises(CollateError, match=r"\[2\] and \[3\]"):
        batch_shape({7: chunk}, [7, 7], [0, 1], "_")


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
    assert np.flatnonzero(b.row_hashes(lo, hi) != a.row_hashes(lo, hi)).tolist() == [
        42 - lo
    ]
    assert a.digest != b.digest


def test_manifest_round_trips_through_its_object_form():
    m = Manifest.from_entries("file", ["/d/é", "/d/b"], [1, 2], ["x", "y"])
    back = Manifest.from_object(m.to_object())
    assert back.urls() == ["/d/é", "/d/b"] and back.digest == m.digest


@pytest.mark.parametrize(
    "make",
    [
        lambda i: np.float32(i),  # scalar rows: a (B,) batch
        lambda i: np.full((0, 3), i),  # an empty first axis
        lambda i: np.full((3, 0), i),  # an empty last axis
        lambda i: np.full((2, 3), i, dtype=np.int16),
    ],
    ids=["scalar", "empty", "empty-last", "2d"],
)
def test_gather_of_any_row_shape_equals_stacking(make):
    chunks = {
        c: Chunk(build_chunk([make(10 * c + r) for r in range(4)])) for c in (0, 1)
    }
    ids, rows = [1, 0, 1, 0], [3, 0, 0, 2]
    shape = batch_shape(chunks, ids, rows, "_")
    out = np.empty((4, *shape), dtype=chunks[0].field("_", 0).dtype)
    gather(chunks, ids, rows, "_", out)
    expected = np.stack([chunks[c].sample(r) for c, r in zip(ids, rows, strict=True)])
    assert np.array_equal(out, expected)


def test_gather_reads_a_ragged_chunks_rows_of_the_batchs_shape():
    """A chunk of mixed shapes is not stacked; its rows of the batch's shape
    gather beside a stacked chunk's."""
    ragged = Chunk(build_chunk([np.full(2, 1.0), np.full(3, 2.0), np.full(2, 3.0)]))
    stacked = Chunk(build_chunk([np.full(2, 4.0), np.full(2, 5.0)]))
    chunks = {0: ragged, 1: stacked}
    assert ragged.stacked.get("_") is None and stacked.stacked.get("_") is not None
    ids, rows = [0, 1, 0], [2, 1, 0]
    out = np.empty((3, *batch_shape(chunks, ids, rows, "_")))
    gather(chunks, ids, rows, "_", out)
    assert out.tolist() == [[3.0, 3.0], [5.0, 5.0], [1.0, 1.0]]
    with pytest.raises(CollateError):
        batch_shape(chunks, [0, 0], [0, 1], "_")

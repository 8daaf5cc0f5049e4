"""A listing that runs long publishes its first whole chunks while it goes on:
each prefix is the finished listing's first objects and chunks, in a flat
and a nested prefix, through the store's listings and a real Ray store."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from shardcache.manifest import Manifest
from shardcache.segments import WHOLE_LISTING
from shardcache_server import listing, objects
from shardcache_server.emulator import FaultPlan
from shardcache_server.listing import (
    Listings,
    cut_prefix,
    list_in_thread,
    list_with_layout,
)
from shardcache_server.objects import list_source

PAGE_KEYS = 10
LATENCY_S = 0.03  # per LIST page: 30 pages take about a second


@pytest.fixture
def slow_pages(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "LIST_PAGE_KEYS", PAGE_KEYS)
    s3.set_faults(FaultPlan(list_latency_s=LATENCY_S))


def _rows(m: Manifest) -> list[tuple[str, int, str]]:
    return [(m.url(i), m.size(i), m.etag(i)) for i in range(len(m))]


def _fill(s3fs_client: Any, bucket: str, keys: list[str]) -> None:
    # Sizes vary so that byte buckets, not only sample runs, cut the chunks.
    s3fs_client.pipe({f"{bucket}/{k}": b"x" * (1 + i % 7) for i, k in enumerate(keys)})


@pytest.mark.parametrize(
    "layout",
    ["flat", "nested"],
)
def test_prefixes_are_the_finished_listings_first_objects(
    s3: Any, s3fs_client: Any, bucket: str, slow_pages: None, layout: str
) -> None:
    if layout == "flat":
        keys = [f"f/{i:05d}" for i in range(400)]
    else:  # sub-prefixes listed concurrently, joined in key order
        keys = [f"f/{d:02d}/{i:03d}" for d in range(8) for i in range(50)]
        keys += [f"f/top{i}" for i in range(5)]
    _fill(s3fs_client, bucket, keys)
    got: list[Manifest] = []
    final = list_source(
        f"s3://{bucket}/f/", s3.storage_options(), on_prefix=got.append,
        stream_after_s=0.1,
    )  # fmt: skip
    assert len(final) == len(keys)  # the copies left the writers whole
    assert got, "a listing of ~1 s published no prefix after 0.1 s"
    rows = _rows(final)
    lengths = [len(p) for p in got]
    assert lengths == sorted(lengths) and lengths[-1] < len(keys)
    assert all(b >= 2 * a for a, b in zip(lengths, lengths[1:], strict=False))
    for prefix in got:
        assert _rows(prefix) == rows[: len(prefix)]
        assert prefix.digest != final.digest


def test_a_short_listing_publishes_no_prefix(
    s3: Any, s3fs_client: Any, bucket: str
) -> None:
    _fill(s3fs_client, bucket, [f"s/{i}" for i in range(30)])
    got: list[Manifest] = []
    list_source(f"s3://{bucket}/s/", s3.storage_options(), on_prefix=got.append)
    assert got == []  # under stream_after_s (2 s): only the whole


def test_prefix_chunks_are_the_final_chunks(
    s3: Any, s3fs_client: Any, bucket: str, slow_pages: None
) -> None:
    keys = [f"c/{i:05d}" for i in range(300)]
    _fill(s3fs_client, bucket, keys)
    spec = {
        "urls": f"s3://{bucket}/c/",
        "storage_options": s3.storage_options(),
        "chunk_samples": 16,
        "chunk_bytes": 40,
    }
    got: list[Manifest] = []
    final = list_with_layout(spec, None, on_prefix=got.append, stream_after_s=0.1)
    assert got
    starts = final.columns["chunk_starts"]
    versions = final.chunk_versions(final.layout)
    lengths = [len(p) for p in got]
    assert final.prefix_ends.tolist() == lengths  # every rank cuts the same segments
    assert [p.prefix_ends.tolist() for p in got] == [
        lengths[: i + 1] for i in range(len(got))
    ]
    for prefix in got:
        assert not prefix.is_prefix  # marked where it is published (the task)
        mine = prefix.columns["chunk_starts"]
        assert int(mine[-1]) == len(prefix)  # whole chunks only
        assert np.array_equal(starts[: len(mine)], mine)
        k = len(mine) - 1
        assert np.array_equal(prefix.chunk_versions(prefix.layout), versions[:k])


def test_a_streamed_listings_first_chunk_comes_in_pieces(
    s3: Any,
    s3fs_client: Any,
    bucket: str,
    slow_pages: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job waiting on a streamed listing first reads a piece of its
    first chunk (RAMP_PIECES of them), announced by the first prefix and
    kept by the finished listing. A listing of the same objects made again
    with no job waiting (a store listing by digest) plans the same chunks,
    and one whose first chunk is small keeps it whole."""
    monkeypatch.setattr(listing, "RAMP_MIN_OBJECTS", 32)
    monkeypatch.setattr(listing, "RAMP_PIECES", 16)
    keys = [f"r/{i:05d}" for i in range(320)]
    _fill(s3fs_client, bucket, keys)
    spec = {
        "urls": f"s3://{bucket}/r/",
        "storage_options": s3.storage_options(),
        "chunk_samples": 32,
    }
    got: list[Manifest] = []
    final = list_with_layout(spec, None, on_prefix=got.append, stream_after_s=0.1)
    assert got
    starts = final.columns["chunk_starts"]
    assert starts[:18].tolist() == [*range(0, 32, 2), 32, 64]
    for prefix in got:
        mine = prefix.columns["chunk_starts"]
        assert np.array_equal(starts[: len(mine)], mine)
        assert prefix.prefix_ends[0] != WHOLE_LISTING  # never one segment
    again = list_with_layout(spec, None)
    assert np.array_equal(again.columns["chunk_starts"], starts)
    assert again.digest == final.digest
    small = list_with_layout({**spec, "chunk_samples": 31}, None)
    assert small.columns["chunk_starts"][:3].tolist() == [0, 31, 62]


def test_a_fresh_listing_a_job_waits_for_is_one_segment_from_pieces(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listed before any prefix was due, for a job waiting on it: when a full
    shuffle's first batch would wait for COLD_FIRST_BATCH_READS reads, the
    listing carries one segment, the whole listing (its first epoch read
    chunk by chunk). Not when the first batch is cheap, when no job waits
    (a refresh), or when a previous listing's chunks are kept."""
    monkeypatch.setattr(listing, "COLD_FIRST_BATCH_READS", 200)
    monkeypatch.setattr(listing, "RAMP_MIN_OBJECTS", 64)
    monkeypatch.setattr(listing, "RAMP_PIECES", 16)
    for i in range(400):
        (tmp_path / f"{i:04d}.bin").write_bytes(b"x")
    spec = {"urls": f"file://{tmp_path}", "chunk_samples": 64}

    def waited(spec: dict[str, Any], previous: Any = None) -> Manifest:
        return list_with_layout(spec, previous, on_prefix=lambda _: None)

    cold = waited(spec)
    assert cold.prefix_ends.tolist() == [WHOLE_LISTING, 400] and not cold.is_prefix
    assert cold.columns["chunk_starts"][:18].tolist() == [
        *range(0, 64, 4),
        64,
        128,
    ]
    assert waited({**spec, "chunk_samples": 2}).prefix_ends.tolist() == []
    plain = list_with_layout(spec, None)
    assert plain.prefix_ends.tolist() == []
    assert np.array_equal(plain.columns["chunk_starts"], cold.columns["chunk_starts"])
    assert waited(spec, plain).prefix_ends.tolist() == []  # may be cached


def test_the_final_keeps_the_chunks_a_prefix_announced(
    s3: Any, s3fs_client: Any, bucket: str, slow_pages: None
) -> None:
    """A previous listing with the same first objects but not the same whole
    (objects added at the end): the prefix takes its chunks, and so must the
    finished listing, though it plans the rest afresh."""
    keys = [f"k/{i:05d}" for i in range(200)]
    _fill(s3fs_client, bucket, keys)
    spec = {
        "urls": f"s3://{bucket}/k/",
        "storage_options": s3.storage_options(),
        "chunk_samples": 16,
    }
    first = list_with_layout(spec, None)
    # Odd chunk starts a plan would never make (kept across refreshes).
    first.columns["chunk_starts"] = np.array([0, *range(5, 200, 9), 200], np.int64)
    _fill(s3fs_client, bucket, [*keys, *(f"k/z{i:04d}" for i in range(200))])
    got: list[Manifest] = []
    final = list_with_layout(spec, first, on_prefix=got.append, stream_after_s=0.1)
    assert got and len(final) == 400
    starts = final.columns["chunk_starts"]
    for prefix in got:
        mine = prefix.columns["chunk_starts"]
        assert np.array_equal(starts[: len(mine)], mine)
    assert int(starts[-1]) == 400 and np.all(np.diff(starts) > 0)


def test_cut_prefix_without_a_whole_chunk_is_none() -> None:
    m = Manifest.from_entries("s3", ["s3://b/a", "s3://b/b"], [1, 1], ["e", "e"])
    assert cut_prefix(m, None, {"chunk_samples": 16}) is None
    cut = cut_prefix(m, None, {"chunk_samples": 1})
    assert cut is not None and len(cut) == 1


def test_listings_answer_early_then_the_whole_for_the_same_token(
    s3: Any, s3fs_client: Any, bucket: str, slow_pages: None
) -> None:
    keys = [f"e/{i:05d}" for i in range(500)]
    _fill(s3fs_client, bucket, keys)
    listings = Listings(
        lambda ref: ref, list_in_thread(lambda value: value, stream_after_s=0.2)
    )
    spec = {
        "name": "early",
        "urls": f"s3://{bucket}/e/",
        "storage_options": s3.storage_options(),
        "chunk_samples": 16,
    }

    async def run() -> tuple[Manifest, list[int], Manifest, float, float]:
        started = time.monotonic()
        _, digest, first, _ = await listings.publish_early(spec, "open/job-1")
        answered_s = time.monotonic() - started
        assert listings.held("early", digest) is not None  # builds can map it
        seen = [len(first)]
        while (lead := listings.leading("early", digest)) and lead[2] == "listing":
            seen.append(len(listings.held("early", lead[1])[1]))  # type: ignore[index]
            await asyncio.sleep(0.05)
        whole = listings.answered("early", "open/job-1")  # the token's own listing
        return first, seen, whole, answered_s, time.monotonic() - started

    first, seen, whole, answered_s, total_s = asyncio.run(run())
    # One copy held: an earlier prefix is answered with the whole listing now.
    assert listings.held("early", first.digest)[1] is whole  # type: ignore[index]
    assert first.is_prefix and not whole.is_prefix
    assert answered_s < total_s / 2  # ~0.2 s of a ~1.5 s listing
    assert seen == sorted(seen)
    assert len(whole) == 500
    mine = first.columns["chunk_starts"]
    assert np.array_equal(whole.columns["chunk_starts"][: len(mine)], mine)
    assert _rows(first) == _rows(whole)[: len(first)]


def test_a_ray_store_answers_early_on_both_nodes(
    ray_cluster: Any,
    node_ids: list[str],
    s3: Any,
    s3fs_client: Any,
    bucket: str,
    redis_url: str,
    namespace: str,
) -> None:
    """The listing task streams its prefixes to the store that lists; the
    other node's store forwards an early request and adopts what it gets."""
    import ray

    from shardcache_server.cluster import ensure_stores, store_for_node
    from shardcache_server.settings import ServiceSettings

    # The task lists in its own worker, at S3's 1,000 keys per page: four
    # pages at 0.5 s each.
    keys = [f"r/{i:05d}" for i in range(3_500)]
    s3fs_client.pipe({f"{bucket}/{k}": b"v" for k in keys})
    s3.set_faults(FaultPlan(list_latency_s=0.5))
    ensure_stores(
        ServiceSettings(redis_url=redis_url, namespace=namespace, stream_after_s=0.2)
    )
    here, there = (store_for_node(namespace, n) for n in node_ids)
    spec = {
        "name": "rs",
        "urls": f"s3://{bucket}/r/",
        "protocol": "s3",
        "storage_options": s3.storage_options(),
        "chunk_bytes": 0,
        "chunk_samples": 64,
    }
    ref, digest = ray.get(here.manifest.remote(spec, "open/j", early=True))
    first = Manifest.from_object(ray.get(ref))
    assert first.is_prefix and 0 < len(first) < len(keys)
    ref2, _ = ray.get(there.manifest.remote(spec, "open/j", early=True))
    joined = Manifest.from_object(ray.get(ref2))
    assert _rows(joined) == [(f"s3://{bucket}/{k}", 1, joined.etag(i))
                             for i, k in enumerate(keys[: len(joined)])]  # fmt: skip
    assert ray.get(here.manifest_of.remote("rs", digest))  # held for builds
    lengths = [len(first)]
    # The other node's store asks the one that lists what follows the prefix.
    while (got := ray.get(there.leading.remote("rs", digest)))[2] == "listing":
        lengths.append(len(Manifest.from_object(ray.get(got[0]))))
        time.sleep(0.1)
    assert got[2] == "done"
    whole = Manifest.from_object(ray.get(got[0]))
    whole_ref, whole_digest = ray.get(there.manifest.remote(spec, "open/j"))
    assert whole_digest == got[1]
    assert Manifest.from_object(ray.get(whole_ref)).prefix_ends.tolist() == (
        whole.prefix_ends.tolist()
    )  # the token's own listing
    assert not whole.is_prefix and len(whole) == len(keys)
    assert lengths == sorted(lengths)
    mine = first.columns["chunk_starts"]
    assert np.array_equal(whole.columns["chunk_starts"][: len(mine)], mine)
    assert whole_digest != digest


def test_each_token_keeps_its_own_listing_and_prefixes_lead_to_it(
    s3: Any, s3fs_client: Any, bucket: str, slow_pages: None
) -> None:
    """A later listing of the same objects has the same digest but not the
    same prefix ends: a job's ranks still get their own listing, and a
    prefix in hand still leads to the listing it came from."""
    _fill(s3fs_client, bucket, [f"t/{i:05d}" for i in range(500)])
    listings = Listings(
        lambda ref: ref, list_in_thread(lambda value: value, stream_after_s=0.2)
    )
    spec = {
        "name": "tok",
        "urls": f"s3://{bucket}/t/",
        "storage_options": s3.storage_options(),
        "chunk_samples": 16,
    }

    async def run() -> tuple[Manifest, Manifest, Manifest, Any]:
        _, _, first, rest = await listings.publish_early(spec, "open/a")
        assert rest is not None
        _, _, a = await rest
        s3.set_faults(FaultPlan())  # job b's listing is fast: never read early
        _, _, b = await listings.publish(spec, "open/b")
        return first, a, b, listings.leading("tok", first.digest)

    first, a, b, lead = asyncio.run(run())
    assert a.digest == b.digest and len(a.prefix_ends) and not len(b.prefix_ends)
    assert listings.answered("tok", "open/a") is a  # not b, though b came later
    assert listings.answered("tok", "open/b") is b
    assert lead is not None and lead[1] == a.digest and lead[2] == "done"


def test_a_failed_listing_tells_the_prefix_holders(
    s3: Any, s3fs_client: Any, bucket: str, slow_pages: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(objects, "LIST_RETRIES", 0)
    _fill(s3fs_client, bucket, [f"x/{i:05d}" for i in range(500)])
    listings = Listings(
        lambda ref: ref, list_in_thread(lambda value: value, stream_after_s=0.2)
    )
    spec = {"name": "fail", "urls": f"s3://{bucket}/x/",
            "storage_options": s3.storage_options(), "chunk_samples": 16}  # fmt: skip

    async def run() -> Any:
        _, digest, _, rest = await listings.publish_early(spec, "open/f")
        s3.set_faults(FaultPlan(list_error_rate=1.0, error_status=500))
        with pytest.raises(Exception, match="listing"):
            await rest
        return listings.leading("fail", digest)

    assert asyncio.run(run())[2] == "failed"

"""Chunk-level store behaviour without Ray: many objects per chunk, a real
Redis and the S3 emulator (GETs counted at the server)."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

from shardcache.chunks import Chunk
from shardcache.decoders import raw_bytes
from shardcache.manifest import Manifest
from shardcache_server.emulator import FaultPlan
from shardcache_server.settings import ServiceSettings

from helpers import local_shard, register_dataset

COUNT = 10  # objects, all in one chunk


def _setup(s3, s3fs_client, bucket, redis_url, preprocess=raw_bytes, **settings):
    s3fs_client.pipe(
        {f"{bucket}/d/{i:03d}.bin": bytes([i]) * 100 for i in range(COUNT)}
    )
    ns = f"t{uuid.uuid4().hex[:8]}"
    cfg = ServiceSettings(
        redis_url=redis_url, namespace=ns, stats_flush_s=0.05, backoff_s=0.01,
        **settings,
    )  # fmt: skip
    index, spec, items = register_dataset(
        s3, f"s3://{bucket}/d/", redis_url, ns, preprocess, chunk_samples=COUNT
    )
    assert len(items) == 1
    return cfg, index, spec, items


def _items(manifest: Manifest):
    return manifest.chunk_items(range(len(manifest.layout)))


def _samples(result) -> list[bytes]:
    chunk = Chunk(result[1])
    return [bytes(chunk.sample(r)) for r in range(len(chunk))]


def test_chunk_changed_member_is_the_only_object_read_again(
    s3, s3fs_client, bucket, redis_url
):
    cfg, index, spec, items = _setup(s3, s3fs_client, bucket, redis_url)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        first = (await shard.get("ds", 1, items))[0]
        gets_before = s3.total_gets
        s3fs_client.pipe({f"{bucket}/d/004.bin": b"\xff" * 150})  # new size too
        ref, digest = await shard.manifest(spec, "job/1")  # refresh: re-list
        manifest = Manifest.from_object(ref)
        new_items = _items(manifest)
        second = (await shard.get("ds", 1, new_items, digest=digest))[0]
        again = (await shard.get("ds", 1, new_items, digest=digest))[0]
        await asyncio.sleep(0.2)
        await shard.close()
        return first, gets_before, new_items, second, again

    first, gets_before, new_items, second, again = asyncio.run(scenario())
    assert first[0] == "fetched" and gets_before == COUNT
    assert new_items[0][1] != items[0][1]  # the chunk's version changed
    assert s3.total_gets == COUNT + 1  # only the changed member was read
    got = _samples(second)
    assert got[4] == b"\xff" * 150  # never the stale bytes
    assert got[:4] + got[5:] == [bytes([i]) * 100 for i in range(COUNT) if i != 4]
    assert second[0] == "fetched" and again[0] == "hit"
    entries = index.entries("ds", 1)
    assert entries[items[0][0]]["etag"] == new_items[0][1]


def _no_twos(data: bytes) -> np.ndarray:
    """A preprocess that fails, every time, for the object of 2s."""
    if data[:1] == b"\x02":
        raise ValueError("not a sample")
    return np.frombuffer(data, np.uint8)


def test_a_failed_row_stays_failed_when_its_chunk_is_rebuilt_around_it(
    s3, s3fs_client, bucket, redis_url
):
    # A row that failed for good is cached as failed; when another member
    # changes, the rebuild copies the rows that did not change, and the
    # failed row's placeholder (zeros) must not be copied as a sample.
    cfg, index, spec, items = _setup(s3, s3fs_client, bucket, redis_url, _no_twos)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, _no_twos)
        first = (await shard.get("ds", 1, items))[0]
        s3fs_client.pipe({f"{bucket}/d/004.bin": b"\xff" * 150})
        ref, digest = await shard.manifest(spec, "job/1")  # refresh: re-list
        new_items = _items(Manifest.from_object(ref))
        second = (await shard.get("ds", 1, new_items, digest=digest))[0]
        await asyncio.sleep(0.2)
        await shard.close()
        return first, second, new_items

    first, second, new_items = asyncio.run(scenario())
    assert first[0] == "fetched" and Chunk(first[1]).error(2)[0] == "PreprocessError"
    assert s3.total_gets == COUNT + 1  # the rebuild read only the changed member
    rebuilt = Chunk(second[1])
    assert rebuilt.error(2) is not None, "the failed row came back as a sample"
    assert rebuilt.error(2)[0] == "PreprocessError"
    assert bytes(rebuilt.sample(4)) == b"\xff" * 150
    entry = index.entries("ds", 1)[new_items[0][0]]
    assert entry["failed"] == 1 and entry["error"][0] == "PreprocessError"


def test_chunk_member_that_is_gone_is_named_cached_and_not_read_again(
    s3, s3fs_client, bucket, redis_url
):
    # A failure the object gives every time (gone, undecodable) is cached with
    # its row marked: one bad object costs one read, not its chunk every epoch.
    cfg, index, spec, items = _setup(s3, s3fs_client, bucket, redis_url)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        s3fs_client.rm(f"{bucket}/d/007.bin")  # gone after the listing
        first = (await shard.get("ds", 1, items))[0]
        reads = s3.total_gets
        again = (await shard.get("ds", 1, items))[0]
        info = await shard.info()
        await asyncio.sleep(0.2)
        await shard.close()
        return first, again, reads, info

    (status, value), (status_again, _), reads, info = asyncio.run(scenario())
    chunk = Chunk(value)
    assert status == "fetched" and status_again == "hit"
    assert s3.total_gets == reads  # the second epoch read nothing
    assert chunk.failed.tolist() == [i == 7 for i in range(COUNT)]
    kind, message = chunk.error(7)
    assert kind == "SourceNotFound" and f"s3://{bucket}/d/007.bin" in message
    assert bytes(chunk.sample(3)) == bytes([3]) * 100
    assert info["entries"] == 1 and index.entries("ds", 1)
    assert any(e["kind"] == "fetch_error" for e in index.events())


def test_chunk_whose_reads_fail_for_now_is_served_uncached_and_read_again(
    s3, s3fs_client, bucket, redis_url
):
    # 503s past the retries may not come back: the chunk is served with its
    # rows marked, not cached, and the next request reads them again.
    cfg, index, spec, items = _setup(s3, s3fs_client, bucket, redis_url, fetch_retries=1)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        s3.set_faults(FaultPlan(error_rate=1.0, error_status=503))
        first = (await shard.get("ds", 1, items))[0]
        during = (await shard.info())["entries"]
        s3.set_faults(FaultPlan())
        again = (await shard.get("ds", 1, items))[0]
        info = await shard.info()
        await asyncio.sleep(0.2)
        await shard.close()
        return first, during, again, info

    (status, value), during, (status_again, value_again), info = asyncio.run(scenario())
    assert status == "uncached" and during == 0
    assert Chunk(value).failed.all()
    assert Chunk(value).error(0)[0] == "RemoteFetchError"
    assert status_again == "fetched" and not Chunk(value_again).failed.any()
    assert _samples((status_again, value_again)) == [bytes([i]) * 100 for i in range(COUNT)]
    assert info["entries"] == 1


def test_chunk_larger_than_the_budget_is_served_uncached(
    s3, s3fs_client, bucket, redis_url
):
    cfg, index, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, cache_bytes=500
    )

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        out = [(await shard.get("ds", 1, items))[0] for _ in range(2)]
        info = await shard.info()
        await shard.close()
        return out, info

    out, info = asyncio.run(scenario())
    assert [r[0] for r in out] == ["uncached", "uncached"]
    assert _samples(out[1]) == [bytes([i]) * 100 for i in range(COUNT)]
    assert info["used_bytes"] == 0 and info["entries"] == 0


def test_chunk_whose_samples_disagree_on_dtype_is_a_preprocess_error(
    s3, s3fs_client, bucket, redis_url
):
    def mixed(data: bytes) -> np.ndarray:
        dtype = np.float32 if data[0] == 5 else np.uint8
        return np.frombuffer(data, np.uint8).astype(dtype)

    cfg, _, spec, items = _setup(s3, s3fs_client, bucket, redis_url, mixed)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, mixed)
        out = (await shard.get("ds", 1, items))[0]
        await shard.close()
        return out

    res = asyncio.run(scenario())
    assert res[:2] == ("error", "PreprocessError")
    assert "float32" in res[2] and f"s3://{bucket}/d/005.bin" in res[2]


@pytest.mark.parametrize("order", ["forward", "backward"])
def test_objects_added_and_removed_read_only_what_is_new(
    s3, s3fs_client, bucket, redis_url, order
):
    # 40 objects in chunks of 4. One added before the first and one removed
    # in the middle move every row after them by one: rows are found by URL
    # and ETag in the chunk's earlier build and its neighbours, not re-read.
    per_chunk, count = 4, 40
    s3fs_client.pipe(
        {f"{bucket}/m/{i:03d}.bin": bytes([i]) * 100 for i in range(count)}
    )
    ns = f"t{uuid.uuid4().hex[:8]}"
    cfg = ServiceSettings(redis_url=redis_url, namespace=ns, stats_flush_s=0.05)
    _, spec, items = register_dataset(
        s3, f"s3://{bucket}/m/", redis_url, ns, raw_bytes, chunk_samples=per_chunk
    )

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        for item in items:
            await shard.get("ds", 1, [item])
        before = s3.total_gets
        s3fs_client.pipe({f"{bucket}/m/000a.bin": b"\xaa" * 100})
        s3fs_client.rm(f"{bucket}/m/020.bin")
        ref, digest = await shard.manifest(spec, "job/2")  # the next job's listing
        new_items = _items(Manifest.from_object(ref))
        asked = new_items if order == "forward" else new_items[::-1]
        got = {}
        for item in asked:
            (res,) = await shard.get("ds", 1, [item], digest=digest)
            got[item[0]] = _samples(res)
        await shard.close()
        return before, new_items, got

    before, new_items, got = asyncio.run(scenario())
    assert before == count and len(new_items) == count // per_chunk
    expected = [bytes([0]) * 100, b"\xaa" * 100] + [
        bytes([i]) * 100 for i in range(1, count) if i != 20
    ]
    assert [s for key, _, _ in new_items for s in got[key]] == expected
    read = s3.total_gets - before
    if order == "backward":
        assert read == 1  # the new object; every moved row was still held
    else:
        # A chunk rebuilt first no longer has the row its successor took from
        # it: at most one read per chunk for that, never the whole prefix.
        assert 1 <= read <= 1 + len(new_items)


def _doubled(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8) * 2  # another preprocess: generation 2


def test_a_retired_generation_builds_with_its_own_preprocess_not_the_new_chunks(
    s3, s3fs_client, bucket, redis_url
):
    # A rank mid-epoch on generation 1 asks for a chunk after the preprocess
    # changed: the chunk held for generation 2 has the same URLs and ETags,
    # but its rows are the new preprocess's, so none may be copied.
    per_chunk, count = 4, 12
    s3fs_client.pipe({f"{bucket}/r/{i:03d}.bin": bytes([i]) * 10 for i in range(count)})
    ns = f"t{uuid.uuid4().hex[:8]}"
    cfg = ServiceSettings(redis_url=redis_url, namespace=ns, stats_flush_s=0.05)
    url = f"s3://{bucket}/r/"
    _, old, items = register_dataset(s3, url, redis_url, ns, raw_bytes, chunk_samples=per_chunk)
    _, new, _ = register_dataset(s3, url, redis_url, ns, _doubled, chunk_samples=per_chunk)
    assert (old["generation"], new["generation"]) == (1, 2)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(old, raw_bytes)
        await shard.get("ds", 1, [items[0]])
        await shard.install(new, _doubled)  # generation 1 retired, kept readable
        (fresh,) = await shard.get("ds", 2, [items[1]])
        before = s3.total_gets
        (retired,) = await shard.get("ds", 1, [items[1]])
        await shard.close()
        return fresh, retired, s3.total_gets - before

    fresh, retired, read = asyncio.run(scenario())
    assert _samples(fresh) == [bytes([2 * i]) * 10 for i in range(4, 8)]
    assert _samples(retired) == [bytes([i]) * 10 for i in range(4, 8)]
    assert read == per_chunk  # its rows read again, not copied from generation 2

"""CacheShard logic without Ray: a real Redis and the S3 emulator; ``put``/``get``
are identity and chunks are built in a thread (one object per chunk here, so
per-object expectations read directly; see test_chunked_store.py for more)."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest

from shardcache.decoders import raw_bytes
from shardcache.keys import parse_chunk_key
from shardcache_server.emulator import FaultPlan
from shardcache_server.settings import ServiceSettings

from helpers import local_shard, register_dataset, view


def _setup(
    s3,
    s3fs_client,
    bucket,
    redis_url,
    count=10,
    nbytes=100,
    preprocess=raw_bytes,
    **settings,
):
    s3fs_client.pipe(
        {f"{bucket}/d/{i:03d}.bin": bytes([i]) * nbytes for i in range(count)}
    )
    ns = f"t{uuid.uuid4().hex[:8]}"
    cfg = ServiceSettings(
        redis_url=redis_url,
        namespace=ns,
        stats_flush_s=0.05,
        backoff_s=0.01,
        **settings,
    )
    index, spec, items = register_dataset(
        s3, f"s3://{bucket}/d/", redis_url, ns, preprocess
    )
    return cfg, index, spec, items


CHUNK_OVERHEAD = (
    11  # bytes of a one-member chunk besides its sample: failed flag, "{}", checksum
)


def _url(bucket, i):
    return f"s3://{bucket}/d/{i:03d}.bin"


def _run(coro):
    return asyncio.run(coro)


def _get_once(cfg, spec, items, after_register=None):
    """One store, one ``get`` of ``items`` under generation 1: (results, info).

    ``after_register`` changes the source after the store listed it.
    """

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        if after_register is not None:
            after_register()
        out = [view(r) for r in await shard.get("ds", 1, items)]
        info = await shard.info()
        await shard.close()
        return out, info

    return _run(scenario())


def test_shard_fetches_once_then_hits_and_records_index(
    s3, s3fs_client, bucket, redis_url
):
    cfg, index, spec, items = _setup(s3, s3fs_client, bucket, redis_url)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        # 16 concurrent requests for the same 10 keys share one fetch each.
        rounds = await asyncio.gather(*(shard.get("ds", 1, items) for _ in range(16)))
        again = await shard.get("ds", 1, items)
        await asyncio.sleep(0.2)
        await shard.close()
        return rounds, again

    rounds, again = _run(scenario())
    assert s3.total_gets == 10
    assert all(
        np.array_equal(view(r)[1], np.full(100, i, np.uint8))
        for i, r in enumerate(rounds[0])
    )
    assert {r[0] for r in again} == {"hit"}
    entries = index.entries("ds", 1)
    assert len(entries) == 10
    e = entries[items[0][0]]
    assert e["etag"] == items[0][1] and e["samples"] == 1 and e["size"] == 100
    assert e["owner"] == "node-a" and e["nbytes"] == 100 + CHUNK_OVERHEAD
    stats = index.stats("ds")
    assert stats.remote_reads == 10 and stats.hits >= 10


def test_shard_preprocess_error_names_key_and_spares_others(
    s3, s3fs_client, bucket, redis_url
):
    def picky(data: bytes) -> np.ndarray:
        if data[0] == 3:
            raise ValueError("cannot decode")
        return np.frombuffer(data, np.uint8).copy()

    cfg, index, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, preprocess=picky
    )

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, picky)
        out = [view(r) for r in await shard.get("ds", 1, items)]
        await asyncio.sleep(0.2)
        info = await shard.info()
        await shard.close()
        return out, info

    out, info = _run(scenario())
    bad = out[3]
    assert bad[0] == "error" and bad[1] == "PreprocessError"
    assert _url(bucket, 3) in bad[2] and "cannot decode" in bad[2]
    assert all(r[0] == "fetched" for i, r in enumerate(out) if i != 3)
    # its chunk is served with the member marked and cached so: the same
    # bytes fail the same way, so reading them again each epoch buys nothing
    assert info["entries"] == 10
    assert items[3][0] in index.entries("ds", 1)
    assert any(
        e["kind"] == "fetch_error" and e["key"] == items[3][0] for e in index.events()
    )


@pytest.mark.parametrize("returned", [b"bytes", [1, 2], np.array(["a"], dtype=object)])
def test_shard_preprocess_returning_non_array_is_preprocess_error(
    s3, s3fs_client, bucket, redis_url, returned
):
    def bad(data: bytes):
        return returned

    cfg, _, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, count=1, preprocess=bad
    )

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, bad)
        out = [view(r) for r in await shard.get("ds", 1, items)]
        await shard.close()
        return out

    (res,) = _run(scenario())
    assert (
        res[0] == "error"
        and res[1] == "PreprocessError"
        and "numpy array" in res[2]
        or "object" in res[2]
    )


def test_shard_invalidation_over_pubsub_frees_memory(
    s3, s3fs_client, bucket, redis_url
):
    cfg, index, spec, items = _setup(s3, s3fs_client, bucket, redis_url)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        await shard.get("ds", 1, items)
        before = (await shard.info())["used_bytes"]
        await asyncio.sleep(0.3)  # listener subscribed
        index.invalidate("ds")
        deadline = time.monotonic() + 5
        while (await shard.info())["entries"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        after = await shard.info()
        retired = await shard.get("ds", 1, items[:1])
        await shard.close()
        return before, after, retired

    before, after, retired = _run(scenario())
    full = 10 * (100 + CHUNK_OVERHEAD)
    assert before == full and after["used_bytes"] == 0
    assert after["generations"]["ds"] == 2
    # Generation 1 left the budget but stays readable for ranks mid-epoch.
    assert after["retired_bytes"] == full and retired[0][0] == "hit"


@pytest.mark.parametrize("policy,expected_hits", [("lru", 0), ("static", 5)])
def test_shard_eviction_hit_rate_under_cyclic_scan(
    s3, s3fs_client, bucket, redis_url, policy, expected_hits
):
    # 10 objects of 100 B, budget 500 B, read in the same order every epoch:
    # LRU always evicts what the next read needs (0 hits); static keeps half.
    cfg, index, spec, items = _setup(
        s3,
        s3fs_client,
        bucket,
        redis_url,
        cache_bytes=5 * (100 + CHUNK_OVERHEAD),
        eviction=policy,
    )

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        for it in items:
            await shard.get("ds", 1, [it])
        warm = [(await shard.get("ds", 1, [it]))[0][0] for it in items]
        info = await shard.info()
        await asyncio.sleep(0.3)
        await shard.close()
        return warm, info

    warm, info = _run(scenario())
    assert warm.count("hit") == expected_hits
    assert info["used_bytes"] <= 5 * (100 + CHUNK_OVERHEAD)
    assert len(index.entries("ds", 1)) == info["entries"]  # evictions update the index


def test_shard_retries_transient_503_then_succeeds(s3, s3fs_client, bucket, redis_url):
    cfg, _, spec, items = _setup(s3, s3fs_client, bucket, redis_url, count=4)
    s3.set_faults(FaultPlan(error_rate=0.5, error_status=503, seed=1))

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        out = [view(r) for r in await shard.get("ds", 1, items)]
        await shard.close()
        return out

    out = _run(scenario())
    assert [r[0] for r in out] == ["fetched"] * 4


def test_shard_truncated_object_is_detected_not_cached(
    s3, s3fs_client, bucket, redis_url
):
    cfg, _, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, count=1, fetch_retries=1
    )
    s3.set_faults(FaultPlan(truncate_rate=1.0))
    (res,), info = _get_once(cfg, spec, items)
    assert (
        res[0] == "error"
        and res[1] == "CorruptObjectError"
        and _url(bucket, 0) in res[2]
    )
    assert info["entries"] == 0


def test_shard_object_deleted_upstream_is_source_not_found(
    s3, s3fs_client, bucket, redis_url
):
    cfg, _, spec, items = _setup(s3, s3fs_client, bucket, redis_url, count=1)
    (res,), _ = _get_once(
        cfg, spec, items, after_register=lambda: s3fs_client.rm(_url(bucket, 0))
    )
    assert res[:2] == ("error", "SourceNotFound")


def test_shard_object_changed_after_listing_is_stale_not_corrupt(
    s3, s3fs_client, bucket, redis_url
):
    cfg, _, spec, items = _setup(s3, s3fs_client, bucket, redis_url, count=2)

    def rewrite():  # same size, new bytes, after the listing
        s3fs_client.pipe({_url(bucket, 1).removeprefix("s3://"): b"x" * 100})

    (ok, changed), info = _get_once(cfg, spec, items, after_register=rewrite)
    assert ok[0] == "fetched"
    assert changed[:2] == ("error", "StaleVersionError")
    assert _url(bucket, 1) in changed[2] and "refresh()" in changed[2]
    assert info["entries"] == 1  # the changed object was not cached
    assert s3.total_gets == 2  # not retried as if it were corruption


@pytest.mark.parametrize("grace_s", [60.0, 0.0])
def test_shard_invalidated_generation_stays_readable_for_grace(
    s3, s3fs_client, bucket, redis_url, grace_s
):
    cfg, index, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, retire_grace_s=grace_s
    )

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        await shard.get("ds", 1, items[:6])  # 6 cached under generation 1
        new = index.invalidate("ds")
        await shard.get("ds", new, items[:1])  # the store moves to generation 2
        old = [view(r) for r in await shard.get("ds", 1, items)]  # mid-epoch on 1
        info = await shard.info()
        await shard.close()
        return old, info

    s3.reset_counts()
    old, info = _run(scenario())
    if grace_s:
        assert [r[0] for r in old] == ["hit"] * 6 + ["uncached"] * 4
        assert all(
            np.array_equal(r[1], np.full(100, i, np.uint8)) for i, r in enumerate(old)
        )
        # 6 (gen 1) + 1 (gen 2) + 4 read once for gen 1 and not cached.
        assert s3.total_gets == 11
        assert info["retired_generations"] == 1
        # the 6 retired, plus the 4 built for generation 1 and kept with it
        assert info["retired_bytes"] == 10 * (100 + CHUNK_OVERHEAD)
        assert info["used_bytes"] + info["retired_bytes"] <= info["budget_bytes"]
    else:
        assert {r[0] for r in old} == {"error"}
        assert {r[1] for r in old} == {"StaleVersionError"}
        assert info["retired_bytes"] == 0


def test_shard_retired_values_give_way_to_new_entries(
    s3, s3fs_client, bucket, redis_url
):
    cfg, index, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, cache_bytes=10 * (100 + CHUNK_OVERHEAD)
    )

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        await shard.get("ds", 1, items)  # 10 x 100 bytes: the budget is full
        new = index.invalidate("ds")
        await shard.get("ds", new, items[:4])
        info = await shard.info()
        await shard.close()
        return info

    info = _run(scenario())
    assert info["used_bytes"] == 4 * (100 + CHUNK_OVERHEAD)
    assert info["retired_bytes"] == 6 * (100 + CHUNK_OVERHEAD)


def test_shard_survives_mixed_source_faults_with_bounded_retries(
    s3, s3fs_client, bucket, redis_url
):
    # A share of GETs answered 503 SlowDown, 500, dropped, or stalled past the
    # per-attempt timeout: every object still arrives intact, in few attempts.
    cfg, _, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, count=24, fetch_timeout_s=0.5
    )
    faults = [
        FaultPlan(error_rate=0.3, error_status=503, seed=1),
        FaultPlan(error_rate=0.3, error_status=500, seed=2),
        FaultPlan(reset_rate=0.3, seed=3),
        FaultPlan(stall_rate=0.2, stall_s=2.0, seed=4),
    ]

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        out = []
        for plan, chunk in zip(faults, (items[i::4] for i in range(4)), strict=True):
            s3.set_faults(plan)
            got = [view(r) for r in await shard.get("ds", 1, chunk)]
            out += zip(chunk, got, strict=True)
        await shard.close()
        return out

    out = _run(scenario())
    assert [res[0] for _, res in out] == ["fetched"] * len(items)
    for (key, _version, _size), res in out:
        i = parse_chunk_key(key)  # one object per chunk: chunk i is object i
        assert bytes(res[1]) == bytes([i]) * 100
    # Faults cost retries, bounded by 1 + fetch_retries attempts per object
    # (twice that for dropped connections, which aiohttp re-sends once).
    assert len(items) < s3.total_gets <= 2 * len(items) * (1 + cfg.fetch_retries)


@pytest.mark.parametrize(
    "plan",
    [
        FaultPlan(error_rate=1.0, error_status=500),
        FaultPlan(reset_rate=1.0),
        FaultPlan(stall_rate=1.0, stall_s=2.0),
    ],
    ids=["500", "dropped", "stalled"],
)
def test_shard_persistent_source_fault_is_remote_fetch_error_naming_key(
    s3, s3fs_client, bucket, redis_url, plan
):
    cfg, _, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, count=1, fetch_retries=2,
        fetch_timeout_s=0.3,
    )  # fmt: skip
    s3.set_faults(plan)
    (res,), info = _get_once(cfg, spec, items)
    assert res[:2] == ("error", "RemoteFetchError")
    assert _url(bucket, 0) in res[2] and "after 3 attempts" in res[2]
    # 1 + fetch_retries attempts, then it gives up. aiohttp re-sends an
    # idempotent GET once when the server drops the connection (RFC 9112
    # 9.3.1), so a dropped attempt reaches the server twice.
    assert s3.total_gets == 3 * (2 if plan.reset_rate else 1)
    assert info["entries"] == 0


def test_a_build_reads_as_source_for_its_own_reading_and_a_hit_for_others(
    s3, s3fs_client, bucket, redis_url
):
    """A chunk built for job A's epoch 0 is a source read for every rank of
    that reading (a rank asking after the build finished included), and a hit
    for job B, even when B's request joined the build while it ran."""
    cfg, _index, spec, items = _setup(s3, s3fs_client, bucket, redis_url, count=4)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        a, b = await asyncio.gather(
            shard.get("ds", 1, items, reader="job-a:0"),
            shard.get("ds", 1, items, reader="job-b:0"),
        )
        later = {
            reading: await shard.get("ds", 1, items, reader=reading)
            for reading in ("job-a:0", "job-a:1", "job-b:0", "")
        }
        await shard.close()
        return a, b, later

    a, b, later = _run(scenario())
    assert s3.total_gets == 4
    statuses = lambda results: {r[0] for r in results}  # noqa: E731
    assert (statuses(a), statuses(b)) == ({"fetched"}, {"hit"})
    assert {k: statuses(v) for k, v in later.items()} == {
        "job-a:0": {"fetched"},  # another rank of the reading that built it
        "job-a:1": {"hit"},  # the job's next epoch
        "job-b:0": {"hit"},
        "": {"hit"},  # a caller that names no reading (a DataLoader worker)
    }

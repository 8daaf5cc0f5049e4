"""Augmented variants in the store: the variant build, the budget rule, and
the plain ``CacheShard`` serving, pre-building and falling back (a real
Redis and the S3 emulator; builds run in a thread, as in test_shard.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from test_shard import CHUNK_OVERHEAD, _run, _setup

from shardcache.checksum import is_intact, seal
from shardcache.chunks import Chunk
from shardcache.decoders import raw_bytes
from shardcache.keys import stats_key
from shardcache.variants import VariantSpec, variant_rng
from shardcache_server.columns import build_chunk
from shardcache_server.eviction import make_policy
from shardcache_server.store.retired import RetiredGenerations
from shardcache_server.store.table import Cached, HeldTable
from shardcache_server.variants import VariantRequest, build_variant

from helpers import local_shard

VARIANT_OVERHEAD = 8  # bytes a variant has beyond its base: the __variant__ column


def _jitter(x, rng):
    """A deterministic-given-rng augmentation of a uint8 row."""
    out = x[::-1] if rng.random() < 0.5 else x
    return np.clip(out * rng.uniform(0.5, 1.5), 0, 255).astype(np.uint8)


def _picky(x, rng):
    if x[0] == 3:
        raise ValueError("row three")
    return x


def _base(rows=4, width=6):
    return seal(build_chunk([np.full(width, r, np.uint8) for r in range(rows)]))


def test_build_variant_rows_are_augment_of_base_with_their_own_generator():
    base = _base()
    req = VariantRequest("ds", base, lo=10, variant=2, seed=5, augment=_jitter)
    columns, report = build_variant(req)
    chunk = Chunk(columns)
    assert chunk.variant == 2 and is_intact(columns) and not report["errors"]
    for row in range(4):
        expected = _jitter(np.full(6, row, np.uint8), variant_rng(5, 2, 10 + row))
        assert np.array_equal(chunk.sample(row), expected)
    # Rebuilt (after an eviction, on another node): bit-identical.
    again, _ = build_variant(VariantRequest("ds", base, 10, 2, 5, _jitter))
    assert all(np.array_equal(columns[k], again[k]) for k in columns)
    other, _ = build_variant(VariantRequest("ds", base, 10, 3, 5, _jitter))
    assert not np.array_equal(other["_"], columns["_"])
    assert np.array_equal(Chunk(base).sample(1), np.full(6, 1, np.uint8))  # untouched


def test_build_variant_marks_the_rows_augment_fails_on():
    columns, report = build_variant(VariantRequest("ds", _base(), 0, 0, 0, _picky))
    chunk = Chunk(columns)
    assert chunk.failed.tolist() == [False, False, False, True]
    kind, message = chunk.error(3)
    assert kind == "PreprocessError" and "augment" in message and "row three" in message
    assert report["errors"] and is_intact(columns)


def _cached(nbytes):
    return Cached("ref", "v", 1, nbytes, np.zeros(0, np.uint64))


def test_table_holds_variants_only_in_free_room_and_never_evicts_for_them():
    table = HeldTable(make_policy("lru", 100), RetiredGenerations(60))
    assert table.admit("ds", "c0", _cached(40)) == (True, [])
    assert table.admit("ds", "c0.v0", _cached(40)) == (True, [])
    # No room left: the next variant is refused, nothing is evicted for it.
    assert table.admit("ds", "c0.v1", _cached(40)) == (False, [])
    assert ("ds", "c0.v0") in table and ("ds", "c0") in table
    # A newer copy of a held variant replaces it in its own room.
    assert table.admit("ds", "c0.v0", _cached(45)) == (True, [])
    assert table.variant_room(15) and not table.variant_room(16)


def test_table_makes_room_for_a_base_chunk_from_the_variants_first():
    table = HeldTable(make_policy("lru", 100), RetiredGenerations(60))
    table.admit("ds", "c0", _cached(30))
    table.admit("ds", "c0.v0", _cached(30))
    table.admit("ds", "c0.v1", _cached(30))
    table.hit("ds", "c0", "v", 1)  # the base is the least recently admitted
    admitted, evicted = table.admit("ds", "c1", _cached(50))
    # Both variants go (oldest first), the older base chunk stays.
    assert admitted and evicted == [("ds", "c0.v0"), ("ds", "c0.v1")]
    assert ("ds", "c0") in table and ("ds", "c1") in table


async def _settled(shard, timeout_s=20.0):
    """Wait until the shard's background variant builds are done."""
    deadline = time.monotonic() + timeout_s
    while (await shard.info())["variant_builds"]:
        assert time.monotonic() < deadline, "background variant builds never ended"
        await asyncio.sleep(0.05)


def _with_variants(spec, k=3, seed=4):
    variants = VariantSpec.validate(_jitter, k, seed)
    assert variants is not None
    return {**spec, "variants": variants.install()}, variants


def test_shard_builds_the_asked_variant_then_the_others_in_the_background(
    s3, s3fs_client, bucket, redis_url
):
    cfg, _, spec, items = _setup(s3, s3fs_client, bucket, redis_url, count=4)
    spec, variants = _with_variants(spec)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        first = await shard.get("ds", 1, [variants.item(it, 1) for it in items])
        await _settled(shard)
        later = {
            v: await shard.get("ds", 1, [variants.item(it, v) for it in items])
            for v in (0, 2)
        }
        info = await shard.info()
        await shard.close()
        return first, later, info

    first, later, info = _run(scenario())
    # Epoch 0's variant: built on demand from the base read for it.
    assert {r[0] for r in first} == {"fetched"}
    for i, (_, columns) in enumerate(first):
        chunk = Chunk(columns)
        expected = _jitter(np.full(100, i, np.uint8), variant_rng(4, 1, i))
        assert chunk.variant == 1 and np.array_equal(chunk.sample(0), expected)
    # The other variants were built in the background: hits, no source read.
    for v, results in later.items():
        assert {r[0] for r in results} == {"hit"}
        assert [Chunk(c).variant for _, c in results] == [v] * 4
    assert s3.total_gets == 4
    base_bytes = 100 + CHUNK_OVERHEAD
    assert info["used_bytes"] == 4 * base_bytes + 12 * (base_bytes + VARIANT_OVERHEAD)


@pytest.mark.parametrize("room_for", [0, 2])
def test_shard_serves_the_base_form_where_the_budget_holds_no_variant(
    s3, s3fs_client, bucket, redis_url, room_for
):
    base_bytes = 100 + CHUNK_OVERHEAD
    budget = 4 * base_bytes + room_for * (base_bytes + VARIANT_OVERHEAD) + 10
    cfg, index, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, count=4, cache_bytes=budget
    )
    spec, variants = _with_variants(spec, k=4)

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        await shard.get("ds", 1, items)  # the base chunks, cached first
        epochs = []
        for v in range(4):
            epochs.append(
                await shard.get("ds", 1, [variants.item(it, v) for it in items])
            )
            await _settled(shard)
        info = await shard.info()
        await shard.close()  # flushes the store's counters to the index
        return epochs, info

    epochs, info = _run(scenario())
    served = [[Chunk(c).variant for _, c in results] for results in epochs]
    assert all(status != "error" for results in epochs for status, *_ in results)
    views = sum(v is not None for row in served for v in row)
    # The stores keep the variants that fit; every other read is the base form.
    assert views == room_for
    counters = index.client.hgetall(stats_key(cfg.namespace, "ds"))
    assert int(counters.get("variant_fallbacks", 0)) == 16 - room_for
    assert info["used_bytes"] <= budget and s3.total_gets == 4


def _mirror(x, rng):
    return x[::-1].copy()


def test_shard_a_new_augment_rebuilds_only_the_variants_from_the_cached_base(
    s3, s3fs_client, bucket, redis_url
):
    cfg, _, spec, items = _setup(s3, s3fs_client, bucket, redis_url, count=4)
    old_spec, old = _with_variants(spec)
    new = VariantSpec.validate(_mirror, 3, 4)
    assert new is not None
    new_spec = {**spec, "variants": new.install()}

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(old_spec, raw_bytes)
        await shard.get("ds", 1, items[:1])  # chunk 0: its base only
        await shard.get("ds", 1, [old.item(it, 0) for it in items[1:]])
        await _settled(shard)
        await shard.install(new_spec, raw_bytes)  # the job changed augment
        # A rank still on the old augment asking for a variant not held is
        # served the base form, never a view of the new augment.
        stale = await shard.get("ds", 1, [old.item(items[0], 1)])
        rebuilt = await shard.get("ds", 1, [new.item(it, 0) for it in items])
        await _settled(shard)
        await shard.close()
        return stale, rebuilt

    stale, rebuilt = _run(scenario())
    assert Chunk(stale[0][1]).variant is None
    assert {r[0] for r in rebuilt} == {"hit"}  # built from the held bases
    for i, (_, columns) in enumerate(rebuilt):
        expected = np.full(100, i, np.uint8)[::-1]
        assert Chunk(columns).variant == 0
        assert np.array_equal(Chunk(columns).sample(0), expected)
    assert s3.total_gets == 4  # the base was never read again

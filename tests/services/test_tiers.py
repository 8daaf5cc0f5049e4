"""Store-level eviction and the disk tier without Ray: a real Redis, the S3
emulator (GETs counted at the server), chunks built in a thread."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
from belady import belady_hits, node_calls

from shardcache import keys
from shardcache.chunks import Chunk
from shardcache.decoders import raw_bytes
from shardcache.sampler import ShardSampler
from shardcache_server.settings import ServiceSettings

from helpers import local_shard, register_dataset

PER_CHUNK = 4  # objects per chunk
CHUNKS = 16
SEED = 5


def _setup(s3, s3fs_client, bucket, redis_url, **settings):
    s3fs_client.pipe(
        {f"{bucket}/d/{i:03d}.bin": bytes([i]) * 100 for i in range(PER_CHUNK * CHUNKS)}
    )
    ns = f"t{uuid.uuid4().hex[:8]}"
    cfg = ServiceSettings(
        redis_url=redis_url, namespace=ns, stats_flush_s=0.05, backoff_s=0.01,
        **settings,
    )  # fmt: skip
    index, spec, items = register_dataset(
        s3, f"s3://{bucket}/d/", redis_url, ns, raw_bytes, chunk_samples=PER_CHUNK
    )
    assert len(items) == CHUNKS
    # What a rank of a 1-rank job sends (RankSession.store_spec).
    spec["order"] = {
        "rank": 0,
        "world_size": 1,
        "seed": SEED,
        "shuffle": True,
        "drop_last": False,
        "epoch": 0,
    }
    return cfg, index, spec, items


def _quarter_in_ram_and_disk(s3, s3fs_client, bucket, redis_url, tmp_path):
    """:func:`_setup` for a store whose RAM holds a quarter of the chunks
    (LRU) and whose disk tier holds them all."""
    return _setup(
        s3,
        s3fs_client,
        bucket,
        redis_url,
        cache_bytes=CHUNKS // 4 * _chunk_nbytes(),
        eviction="lru",
        disk_dir=str(tmp_path / "disk"),
    )


def _chunk_nbytes() -> int:
    """One chunk of 4 x 100 B samples: the stacked column, failed flags, "{}",
    the 8-byte checksum."""
    return PER_CHUNK * 100 + PER_CHUNK + 2 + 8


async def _epochs(shard, items, epochs, first=0):
    """A 1-rank job holding nothing, one sample per batch: a store call per
    sample, in the sampler's order. Returns the samples' bytes per epoch."""
    sampler = ShardSampler(np.full(CHUNKS, PER_CHUNK), 0, 1, seed=SEED)
    out = []
    for e in range(first, first + epochs):
        got = {}
        for i in sampler.order(e).tolist():
            c = i // PER_CHUNK
            status, value = (await shard.get("ds", 1, [items[c]]))[0]
            assert status in ("hit", "fetched", "uncached", "disk-read"), status
            got[i] = bytes(Chunk(value).sample(i % PER_CHUNK))
        out.append(got)
    return out


async def _cold_then_warm(s3, cfg, spec, items):
    """One store, a cold epoch, its disk writes flushed, a warm epoch:
    ``(cold, GETs after the cold epoch, warm, info)``."""
    shard = local_shard(cfg)
    await shard.install(spec, raw_bytes)
    cold = await _epochs(shard, items, 1)
    await shard.flush_disk()
    gets = s3.total_gets
    warm = await _epochs(shard, items, 1, first=1)
    info = await shard.info()
    await shard.close()  # stats flushed; the files stay
    return cold, gets, warm, info


def test_store_gets_at_half_cache_clairvoyant_equals_belady_min_and_beats_static(
    s3, s3fs_client, bucket, redis_url
):
    misses = {}
    for policy in ("clairvoyant", "static", "lru"):
        cfg, _, spec, items = _setup(
            s3,
            s3fs_client,
            bucket,
            redis_url,
            cache_bytes=CHUNKS // 2 * _chunk_nbytes(),
            eviction=policy,
        )
        s3.reset_counts()

        async def scenario(cfg=cfg, spec=spec, items=items):
            shard = local_shard(cfg)
            await shard.install(spec, raw_bytes)
            got = await _epochs(shard, items, 3)
            await shard.close()
            return got

        got = asyncio.run(scenario())
        assert all(v == bytes([i]) * 100 for g in got for i, v in g.items())
        misses[policy] = s3.total_gets // PER_CHUNK  # a miss reads 4 objects
    calls = node_calls(np.full(CHUNKS, PER_CHUNK), 1, (0,), SEED, 4, 1)
    seq = [c for call in calls for c in call]
    count = 3 * len(seq) // 4  # 3 epochs; the 4th is Belady's lookahead
    assert misses["clairvoyant"] == count - belady_hits(seq, CHUNKS // 2, count)
    assert misses["clairvoyant"] < misses["static"] < misses["lru"]


@pytest.mark.parametrize(
    "new_node", ["node-a", "node-b"], ids=["process-restart", "rolled-pod"]
)
def test_store_disk_tier_serves_ram_misses_and_survives_restart(
    s3, s3fs_client, bucket, redis_url, redis, tmp_path, new_node
):
    cfg, index, spec, items = _quarter_in_ram_and_disk(
        s3, s3fs_client, bucket, redis_url, tmp_path
    )
    expected = {i: bytes([i]) * 100 for i in range(PER_CHUNK * CHUNKS)}

    cold, cold_gets, warm, info = asyncio.run(_cold_then_warm(s3, cfg, spec, items))
    assert cold == [expected] and warm == [expected]
    assert cold_gets == PER_CHUNK * CHUNKS  # each object read once
    assert s3.total_gets == cold_gets  # the warm epoch read only RAM and disk
    assert info["disk_chunks"] == CHUNKS and info["entries"] == CHUNKS // 4
    stats = redis.hgetall(keys.stats_key(cfg.namespace, "ds"))
    assert int(stats["disk_hits"]) > 0 and int(stats["disk_writes"]) == CHUNKS
    # RAM hits and disk hits are counted apart; a disk hit is not a source read.
    assert int(stats["remote_reads"]) == PER_CHUNK * CHUNKS

    async def restarted_store():
        # A new incarnation on the same host and disk: the same Ray node (the
        # process crashed) or a new one (a rolled DaemonSet pod).
        shard = local_shard(cfg, new_node)
        await shard.ping()
        await asyncio.sleep(0.2)  # its predecessor's index entries are dropped
        await shard.install(spec, raw_bytes)
        got = await _epochs(shard, items, 1, first=2)
        await shard.close()
        return got

    assert asyncio.run(restarted_store()) == [expected]
    assert s3.total_gets == cold_gets  # zero GETs after the restart


def test_store_snapshot_counts_chunks_held_only_in_the_disk_tier(
    s3, s3fs_client, bucket, redis_url, tmp_path
):
    # What `shardcache verify` compares with the index: a chunk evicted from
    # memory keeps its index entry while its file serves it, so it is held.
    cfg, index, spec, items = _quarter_in_ram_and_disk(
        s3, s3fs_client, bucket, redis_url, tmp_path
    )

    async def held_after_an_epoch():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        await _epochs(shard, items, 1)
        await shard.flush_disk()
        held = await shard.snapshot("ds")
        await shard.close()
        return held

    held = asyncio.run(held_after_an_epoch())
    entries = index.entries("ds", index.generation("ds"))
    assert len(entries) == CHUNKS and set(entries) <= set(held)
    assert all(held[c]["etag"] == e["etag"] for c, e in entries.items())
    tiers = [v["tier"] for v in held.values()]
    assert tiers.count("memory") <= CHUNKS // 4 < tiers.count("disk")


def test_store_disk_tier_keeps_chunks_larger_than_the_whole_memory_budget(
    s3, s3fs_client, bucket, redis_url, redis, tmp_path
):
    # float32 images decode to ~4x their source bytes, so a 16 MiB chunk can
    # outgrow a small budget: memory holds none, the disk tier keeps them all.
    cfg, _, spec, items = _setup(
        s3,
        s3fs_client,
        bucket,
        redis_url,
        cache_bytes=_chunk_nbytes() - 1,
        disk_dir=str(tmp_path / "disk"),
    )
    expected = {i: bytes([i]) * 100 for i in range(PER_CHUNK * CHUNKS)}

    cold, cold_gets, warm, info = asyncio.run(_cold_then_warm(s3, cfg, spec, items))
    assert cold == [expected] and warm == [expected]
    assert cold_gets == PER_CHUNK * CHUNKS
    assert s3.total_gets == cold_gets  # the warm epoch read the disk tier
    assert info["entries"] == 0 and info["disk_chunks"] == CHUNKS
    stats = redis.hgetall(keys.stats_key(cfg.namespace, "ds"))
    assert int(stats["disk_writes"]) == CHUNKS
    # Every request but a chunk's first loads its file (one sample per call).
    assert int(stats["disk_hits"]) == (2 * PER_CHUNK - 1) * CHUNKS


def test_store_disk_tier_never_serves_a_file_of_another_generation(
    s3, s3fs_client, bucket, redis_url, tmp_path
):
    cfg, index, spec, items = _setup(
        s3, s3fs_client, bucket, redis_url, disk_dir=str(tmp_path / "disk")
    )

    async def scenario():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        await shard.get("ds", 1, items)
        await shard.flush_disk()
        await shard.close()
        gen = index.invalidate("ds")  # e.g. the preprocess changed
        again = local_shard(cfg)
        await again.install({**spec, "generation": gen}, raw_bytes)
        before = s3.total_gets
        out = await again.get("ds", gen, items)
        await again.close()
        return before, out

    before, out = asyncio.run(scenario())
    assert {r[0] for r in out} == {"fetched"}
    assert s3.total_gets == 2 * before  # every chunk read again, none from disk

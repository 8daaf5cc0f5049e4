from __future__ import annotations

import numpy as np
import pytest

from shardcache.chunks import ChunkLayout
from shardcache.errors import ConfigError
from shardcache.sampler import ShardSampler
from shardcache.sharding import assign_chunks, assign_shards, epoch_order, global_order

KEYS = [f"s3://bucket/train/{i:05d}.jpg" for i in range(1001)]
CHUNKS = np.array([64] * 15 + [41])  # 1,001 samples in 16 chunks


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_assign_shards_disjoint_covering_balanced(world):
    shards = assign_shards(KEYS, world, seed=7)
    flat = np.concatenate(shards)
    assert sorted(flat.tolist()) == list(range(len(KEYS)))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_assign_shards_is_deterministic_and_seeded():
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            assign_shards(KEYS, 4, 1), assign_shards(KEYS, 4, 1), strict=False
        )
    )
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(
            assign_shards(KEYS, 4, 1), assign_shards(KEYS, 4, 2), strict=False
        )
    )


def test_assign_shards_world_change_moves_about_one_over_n():
    def owners(world):
        out = np.empty(len(KEYS), int)
        for r, s in enumerate(assign_shards(KEYS, world)):
            out[s] = r
        return out

    moved = (owners(4) != owners(5)).mean()
    assert moved < 0.3  # ideal 1/5; a modulo split would move ~80%


def test_epoch_order_reshuffles_inside_stable_shard_and_pads_locally():
    shard = np.arange(10, 20)
    e0, e1 = epoch_order(shard, 12, 0, 0, True), epoch_order(shard, 12, 0, 1, True)
    assert set(e0) == set(e1) == set(shard) and len(e0) == 12
    assert not np.array_equal(e0, e1)


def test_global_order_matches_distributed_sampler_semantics():
    parts = [global_order(10, 3, r, 0, 0, True, False) for r in range(3)]
    assert [len(p) for p in parts] == [4, 4, 4]
    assert set(np.concatenate(parts)) == set(range(10))
    dropped = [global_order(10, 3, r, 0, 0, True, True) for r in range(3)]
    assert [len(p) for p in dropped] == [3, 3, 3]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_assign_chunks_disjoint_covering_balanced_mostly_whole(world):
    shards = assign_chunks(CHUNKS, world, seed=7)
    flat = np.concatenate(shards)
    assert sorted(flat.tolist()) == list(range(int(CHUNKS.sum())))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    starts = np.concatenate(([0], np.cumsum(CHUNKS)))
    owners_per_chunk = [
        {r for r, s in enumerate(shards) if np.any((s >= lo) & (s < hi))}
        for lo, hi in zip(starts[:-1], starts[1:], strict=True)
    ]
    split = sum(len(o) > 1 for o in owners_per_chunk)
    assert split <= world - 1  # whole chunks except at most one per rank boundary


def test_assign_chunks_stable_across_calls_and_seeded():
    a, b = assign_chunks(CHUNKS, 4, 1), assign_chunks(CHUNKS, 4, 1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    c = assign_chunks(CHUNKS, 4, 2)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_sampler_lengths_equal_across_ranks_pad_or_drop():
    for drop_last in (False, True):
        lens = {len(ShardSampler(CHUNKS, r, 3, drop_last=drop_last)) for r in range(3)}
        assert len(lens) == 1
        assert lens.pop() == (333 if drop_last else 334)


def test_sampler_resume_yields_exactly_the_rest_once():
    s = ShardSampler(CHUNKS, 1, 2, seed=3)
    s.set_epoch(2)
    full = list(s)
    s.resume(2, 100)
    assert list(s) == full[100:]
    assert list(s) == full  # the skip applies once


@pytest.mark.parametrize("rank,world", [(2, 2), (-1, 2), (0, 0)])
def test_sampler_bad_rank_or_world_is_config_error(rank, world):
    with pytest.raises(ConfigError, match="rank|world_size"):
        ShardSampler(CHUNKS, rank, world)


def test_sampler_bad_shuffle_mode():
    with pytest.raises(ConfigError, match="shuffle"):
        ShardSampler(CHUNKS, 0, 1, shuffle="sometimes")


def _chunk_loads(order: np.ndarray, chunk_size: int, cache_chunks: int) -> int:
    """Chunks an LRU cache of ``cache_chunks`` chunks loads for ``order``."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    loads = 0
    for chunk in (order // chunk_size).tolist():
        if chunk in cache:
            cache.move_to_end(chunk)
            continue
        loads += 1
        cache[chunk] = None
        if len(cache) > cache_chunks:
            cache.popitem(last=False)
    return loads


def test_block_shuffle_reads_each_chunk_once_where_a_full_shuffle_thrashes():
    # One rank's shard: 16 chunks of 64; its node's cache holds 4 chunks.
    chunks = np.repeat(np.arange(16), 64)
    shard = np.arange(len(chunks))
    layout = ChunkLayout.from_sizes([64] * 16)
    full = epoch_order(shard, len(shard), 3, 1, True)
    blocks = epoch_order(
        shard, len(shard), 3, 1, True, block_samples=128, layout=layout
    )
    assert sorted(blocks.tolist()) == shard.tolist()  # a permutation
    assert _chunk_loads(blocks, 64, 4) == 16  # every chunk once an epoch
    assert _chunk_loads(full, 64, 4) > 10 * 16  # nearly every sample a load
    # Each block of 128 samples is exactly two whole chunks, in random order.
    per_block = [set((blocks[b : b + 128] // 64).tolist()) for b in range(0, 1024, 128)]
    assert all(len(s) == 2 for s in per_block)
    assert [sorted(s) for s in per_block] != [[2 * b, 2 * b + 1] for b in range(8)]
    # Reshuffled per epoch, the same for the same (seed, epoch).
    again = epoch_order(shard, len(shard), 3, 1, True, block_samples=128, layout=layout)
    other = epoch_order(shard, len(shard), 3, 2, True, block_samples=128, layout=layout)
    assert np.array_equal(blocks, again) and not np.array_equal(blocks, other)


def test_sampler_shuffle_block_is_checked_and_kept_in_its_state():
    with pytest.raises(ConfigError, match="shuffle_block"):
        ShardSampler([64] * 4, 0, 1, shuffle_block=-1)
    with pytest.raises(ConfigError, match="shuffle='global'"):
        ShardSampler([64] * 4, 0, 1, shuffle="global", shuffle_block=64)
    s = ShardSampler([64] * 8, 0, 2, shuffle_block=64, seed=1)
    s.set_epoch(1)
    order = list(s)
    assert sorted(order) == sorted(s.shard.tolist())
    state = {**s.state_dict(), "yielded": 10}
    plain = ShardSampler([64] * 8, 0, 2, seed=1)
    with pytest.raises(ConfigError, match="shuffle_block=64"):
        plain.load_state_dict(state)
    same = ShardSampler([64] * 8, 0, 2, shuffle_block=64, seed=1)
    same.load_state_dict(state)
    assert list(same) == order[10:]


@pytest.mark.parametrize("world", [1, 3])
def test_sampler_keeps_no_per_sample_index_but_its_order(world):
    # The shard is kept as runs of whole chunks: a copy of the sampler (one
    # per DataLoader worker) and the rank itself keep a few bytes per chunk,
    # not 4 a sample; the shard property still gives the ascending indices.
    import pickle

    sizes = np.full(250, 4096)  # ~1 M samples
    sampler = ShardSampler(sizes, world - 1, world, seed=3)
    sampler.set_epoch(1)
    order = sampler.order()
    assert len(pickle.dumps(sampler)) < 64 * 1024
    shard = sampler.shard
    assert not shard.flags.writeable and np.all(np.diff(shard) > 0)
    assert np.isin(order, shard).all()
    expected = assign_chunks(sizes, world, 3)[world - 1]
    assert np.array_equal(shard, expected)
    copy = pickle.loads(pickle.dumps(sampler))
    assert np.array_equal(copy.shard, expected) and np.array_equal(copy.order(), order)

"""Clairvoyant eviction as a pure policy: its hits over shuffled epochs equal
an independent simulation of Belady's MIN on the same order, and beat LRU
and static at a cache of half the data."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from belady import belady_hits, node_calls

from shardcache.keys import chunk_key
from shardcache_server.eviction import POLICIES, SamplerOrder, make_policy

CHUNK = 100  # bytes per chunk (all equal: capacity is counted in chunks)


def policy_hits(policy, calls, dataset="ds"):
    hits = 0
    for call in calls:
        keys = [(dataset, chunk_key(c)) for c in call]
        policy.observe(keys)
        # As the store does: a call's hits are served before its misses are built.
        missed = [key for key in keys if key not in policy]
        for key in keys:
            if key in policy:
                policy.touch(key)
                hits += 1
        for key in missed:
            policy.admit(key, CHUNK)
        assert policy.used_bytes <= policy.budget_bytes
    return hits


def _run(name, order, calls, capacity):
    policy = make_policy(name, capacity * CHUNK)
    policy.learn("ds", order)
    return policy_hits(policy, calls)


def test_clairvoyant_hits_equal_belady_min_over_three_shuffled_epochs():
    # One rank, batches of one sample, chunks of 4 samples: the store sees
    # every use, so the policy must make exactly Belady's choices.
    sizes = np.full(32, 4)
    calls = node_calls(sizes, 1, (0,), seed=7, epochs=4, batch=1)
    seq = [c for call in calls for c in call]
    count = 3 * len(seq) // 4  # 3 epochs; the 4th is only Belady's lookahead
    capacity = 16  # half the chunks
    order = SamplerOrder(tuple(sizes.tolist()), 1, 7, True, False, (0,))
    hits = {n: _run(n, order, calls[:count], capacity) for n in POLICIES}
    assert hits["clairvoyant"] == belady_hits(seq, capacity, count)
    assert hits["lru"] < hits["static"] < hits["clairvoyant"]


def test_clairvoyant_plans_on_shuffle_blocks_and_equals_belady_min():
    # The rank shuffles in blocks of 4 chunks: the store must plan on that
    # order (the block is in the spec), and then makes Belady's choices.
    sizes = np.full(32, 4)
    calls = node_calls(sizes, 1, (0,), seed=7, epochs=4, batch=1, block=16)
    seq = [c for call in calls for c in call]
    count = 3 * len(seq) // 4
    capacity = 8  # a quarter of the chunks
    order = SamplerOrder(tuple(sizes.tolist()), 1, 7, True, False, (0,), block=16)
    hits = {n: _run(n, order, calls[:count], capacity) for n in POLICIES}
    assert hits["clairvoyant"] == belady_hits(seq, capacity, count)
    assert hits["clairvoyant"] > hits["lru"]
    # Planned on the whole-shard shuffle instead, it would choose worse.
    stale = _run("clairvoyant", replace(order, block=0), calls[:count], capacity)
    assert stale < hits["clairvoyant"]


@pytest.mark.parametrize(
    "world,ranks", [(2, (0, 1)), (4, (1, 2)), (2, (0,))], ids=["2of2", "2of4", "1of2"]
)
def test_clairvoyant_near_belady_min_with_ranks_sharing_a_node(world, ranks):
    sizes = np.full(48, 8)
    calls = node_calls(sizes, world, ranks, seed=3, epochs=4, batch=4)
    seq = [c for call in calls for c in call]
    n_calls = 3 * len(calls) // 4
    count = sum(len(c) for c in calls[:n_calls])
    capacity = len(set(seq)) // 2
    order = SamplerOrder(tuple(sizes.tolist()), world, 3, True, False, ranks)
    hits = {n: _run(n, order, calls[:n_calls], capacity) for n in POLICIES}
    best = belady_hits(seq, capacity, count)
    # The store never hears positions and ranks interleave: within 2% of MIN.
    assert hits["clairvoyant"] >= 0.98 * best
    assert hits["lru"] < hits["static"] < hits["clairvoyant"]


def test_clairvoyant_learns_ranks_one_registration_at_a_time():
    sizes = np.full(24, 4)
    calls = node_calls(sizes, 2, (0, 1), seed=3, epochs=3, batch=2)
    policy = make_policy("clairvoyant", 12 * CHUNK)
    for r in (1, 0, 1):  # ranks (and their workers) register in any order
        policy.learn("ds", SamplerOrder(tuple(sizes.tolist()), 2, 3, True, False, (r,)))
    full = SamplerOrder(tuple(sizes.tolist()), 2, 3, True, False, (0, 1))
    assert policy_hits(policy, calls) == _run("clairvoyant", full, calls, 12)


def test_clairvoyant_starts_at_the_epoch_the_ranks_registered_in():
    # A resumed job registers at epoch 5: the store plans from there.
    sizes = np.full(32, 2)
    calls = node_calls(sizes, 1, (0,), seed=1, epochs=8, batch=1)
    tail = calls[5 * 64 :]
    seq = [c for call in tail for c in call]
    order = SamplerOrder(tuple(sizes.tolist()), 1, 1, True, False, (0,), 5)
    assert _run("clairvoyant", order, tail[:128], 16) == belady_hits(seq, 16, 128)


def test_clairvoyant_restarted_job_with_same_sampler_plans_from_its_epoch():
    sizes = np.full(32, 2)
    calls = node_calls(sizes, 1, (0,), seed=1, epochs=6, batch=1)
    policy = make_policy("clairvoyant", 16 * CHUNK)
    order = SamplerOrder(tuple(sizes.tolist()), 1, 1, True, False, (0,))
    policy.learn("ds", order)
    policy_hits(policy, calls[:80])  # a first job ran into epoch 1, then died
    policy.learn("ds", replace(order, epoch=5))  # the resumed job registers
    policy.learn("ds", replace(order, epoch=5))  # and its DataLoader workers
    # Before its first batch, every chunk's next use is its first position
    # in epoch 5 (the clock stands just before position 0).
    epoch5 = [c for call in calls[5 * 64 :] for c in call]
    first = {c: epoch5.index(c) for c in set(epoch5)}
    assert {c: policy.next_use(("ds", chunk_key(c))) for c in first} == {
        c: p + 1 for c, p in first.items()
    }


def test_clairvoyant_evicts_chunks_of_unknown_datasets_first():
    sizes = (1, 1, 1, 1)
    policy = make_policy("clairvoyant", 2 * CHUNK)
    policy.learn("known", SamplerOrder(sizes, 1, 0, False, False, (0,)))
    assert policy.admit(("other", "c0"), CHUNK) == (True, [])
    policy.observe([("known", "c0")])
    assert policy.admit(("known", "c0"), CHUNK) == (True, [])
    # c1 is needed in this epoch; the unknown dataset's chunk never is.
    policy.observe([("known", "c1")])
    assert policy.admit(("known", "c1"), CHUNK) == (True, [("other", "c0")])
    # Both unknown: nothing to prefer, so keep what is cached (as static).
    assert policy.admit(("other", "c9"), CHUNK) == (False, [])


def test_clairvoyant_refuses_chunk_larger_than_budget():
    assert make_policy("clairvoyant", 10).admit(("ds", "c0"), 11) == (False, [])

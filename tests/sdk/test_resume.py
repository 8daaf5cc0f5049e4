"""Elastic resume as sampler arithmetic: save at 4 ranks mid-epoch, resume at any world."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from shardcache.errors import ConfigError
from shardcache.resume import merge_states, plan_resume
from shardcache.sampler import ShardSampler, batch_bounds, first_steps

CHUNKS = np.array([64] * 15 + [41])  # 1,001 samples in 16 chunks
N = int(CHUNKS.sum())
OLD_NODES = ["nodeA", "nodeA", "nodeB", "nodeB"]  # 4 ranks, 2 per node


def _save(world, steps, batch, *, epoch=2, seed=3, nodes=None, **kw):
    """Run ``world`` samplers ``steps`` batches in lockstep; return (states, seen)."""
    nodes = nodes or [f"n{r}" for r in range(world)]
    states, seen = [], []
    for r in range(world):
        s = ShardSampler(CHUNKS, r, world, seed=seed, **kw)
        s.set_epoch(epoch)
        consumed = min(steps * batch, len(s))
        seen += list(s)[:consumed]
        states.append({**s.state(), "consumed": consumed, "node": nodes[r]})
    return states, seen


def _resume(merged, world, nodes, **kw):
    samplers = [
        ShardSampler(CHUNKS, r, world, seed=merged["seed"], **kw) for r in range(world)
    ]
    for s in samplers:
        s.resume_elastic(merged, nodes)
    return samplers


@pytest.mark.parametrize("new_world", [1, 2, 3, 4, 6, 7])
@pytest.mark.parametrize("steps,batch", [(5, 16), (3, 7), (0, 8)])
def test_resume_at_any_world_yields_every_remaining_sample_once(
    new_world, steps, batch
):
    states, seen = _save(4, steps, batch, nodes=OLD_NODES)
    nodes = [f"node{'ABC'[r % 3]}" for r in range(new_world)]
    samplers = _resume(merge_states(states), new_world, nodes)
    rest = [i for s in samplers for i in s]
    assert Counter(seen + rest) == Counter(range(N))  # each sample exactly once
    lens = [len(s) for s in samplers]
    assert max(lens) - min(lens) <= 1
    assert lens == [len(list(s)) for s in samplers]


def test_resume_with_another_batch_size_keeps_ddp_steps_equal_and_exact():
    states, seen = _save(4, 6, 10, nodes=OLD_NODES)
    for world, batch in [(2, 32), (6, 5), (6, 11), (3, 1), (5, 181)]:
        samplers = _resume(merge_states(states), world, None)
        shortest = min(samplers[0].lengths())
        steps, rest = set(), []
        for s in samplers:
            order = s.order()
            bounds = batch_bounds(len(order), shortest, batch)
            steps.add(len(bounds))
            rest += [int(i) for lo, hi in bounds for i in order[lo:hi]]
        assert len(steps) == 1, (world, batch, steps)  # DDP: same number of steps
        assert Counter(seen + rest) == Counter(range(N))


def test_batch_sampler_gives_every_rank_the_same_steps_and_resumes():
    # 1,001 - 4 * 40 = 841 left over 7 ranks: 121 on one rank, 120 on six;
    # batch 8 divides 120, so plain batching would give one rank a 16th step.
    states, seen = _save(4, 5, 8)
    samplers = _resume(merge_states(states), 7, None)
    assert sorted(len(s) for s in samplers) == [120] * 6 + [121]
    batches = [list(s.batches(8)) for s in samplers]
    assert {len(b) for b in batches} == {15}
    assert Counter(seen + [i for b in batches for x in b for i in x]) == Counter(
        range(N)
    )
    # Stateful: save after 3 batches, restore into a fresh sampler.
    bs = samplers[0].batches(8)
    it = iter(bs)
    head = [next(it) for _ in range(3)]
    state = bs.state_dict()
    fresh = ShardSampler(CHUNKS, 0, 7, seed=3).batches(8)
    fresh.load_state_dict(state)
    assert head + list(fresh) == batches[0]


def test_batch_bounds_folds_a_one_sample_last_step_into_the_previous_batch():
    # 4 ranks, 17 samples left: lengths 5, 4, 4, 4 with batch 4 would give one
    # rank a second step nobody else takes.
    assert batch_bounds(5, 4, 4) == [(0, 5)]
    assert batch_bounds(4, 4, 4) == [(0, 4)]
    assert batch_bounds(0, 0, 4) == []


def test_resume_moves_no_more_than_the_minimum_the_new_shape_allows():
    states, seen = _save(4, 4, 16, nodes=OLD_NODES)
    merged = merge_states(states)
    holder = {}  # remaining sample -> the node whose rank read its chunk
    for r, st in enumerate(states):
        s = ShardSampler(CHUNKS, r, 4, seed=3)
        s.set_epoch(2)
        for i in s.order()[st["consumed"] :]:
            if int(i) not in seen:  # padding repeats consumed samples
                holder[int(i)] = OLD_NODES[r]
    held = Counter(holder.values())
    remaining = len(holder)
    cases = [
        ["nodeA", "nodeB"],  # shrink to one rank per node
        ["nodeA", "nodeA", "nodeB", "nodeB", "nodeC", "nodeC"],  # a node joins
        ["nodeA", "nodeA", "nodeA"],  # nodeB is gone
        ["nodeB", "nodeB", "nodeA", "nodeA"],  # same size, ranks swapped nodes
    ]
    for nodes in cases:
        plan = plan_resume(CHUNKS, merged, len(nodes), nodes)
        assert plan.remaining == remaining
        ceil = -(-remaining // len(nodes))
        room = Counter(nodes)
        bound = sum(max(0, k - ceil * room[n]) for n, k in held.items())
        # At least what the node capacities force to move, at most one sample
        # per rank more (which ranks take the +1 of an uneven split).
        assert bound <= plan.moved <= bound + len(nodes), (nodes, plan.moved, bound)
        assert plan.moved == plan.min_moved
        for r, order in enumerate(plan.orders):
            stay = sum(holder[int(i)] == nodes[r] for i in order)
            assert stay >= len(order) - plan.moved
    swapped = plan_resume(CHUNKS, merged, 4, cases[3])
    assert swapped.moved == 0  # by node, not by rank number


def test_resume_of_a_resumed_epoch_chains_exactly():
    states, seen = _save(4, 3, 16, nodes=OLD_NODES)
    nodes6 = [f"node{'ABC'[r // 2]}" for r in range(6)]
    six = _resume(merge_states(states), 6, nodes6)
    it = [iter(s) for s in six]
    for _ in range(20):  # 20 samples per rank at 6 ranks
        seen += [next(i) for i in it]
    # Each rank's own state now carries the epoch it resumed from.
    again = [
        {**s.state(), "consumed": 20, "node": nodes6[r]} for r, s in enumerate(six)
    ]
    three = _resume(merge_states(again), 3, ["nodeA", "nodeC", "nodeC"])
    rest = [i for s in three for i in s]
    assert Counter(seen + rest) == Counter(range(N))


def test_resume_drop_last_gives_equal_lengths_and_drops_fewer_than_the_world():
    states, seen = _save(4, 2, 16, drop_last=True)
    samplers = _resume(merge_states(states), 6, None, drop_last=True)
    lens = {len(s) for s in samplers}
    assert len(lens) == 1
    rest = [i for s in samplers for i in s]
    assert len(set(rest)) == len(rest) and not set(rest) & set(seen)
    covered = 4 * (N // 4)  # drop_last dropped N % 4 at 4 ranks
    assert 0 <= covered - len(seen) - len(rest) < 6


def test_resume_global_shuffle_mode_is_exact_too():
    states, seen = _save(4, 5, 9, shuffle="global")
    samplers = _resume(merge_states(states), 3, None, shuffle="global")
    rest = [i for s in samplers for i in s]
    assert Counter(seen + rest) == Counter(range(N))


def test_resume_plan_epoch_only_then_next_epoch_is_the_new_worlds_shard():
    states, _ = _save(4, 2, 8)
    s = _resume(merge_states(states), 2, None)[1]
    s.set_epoch(3)
    plain = ShardSampler(CHUNKS, 1, 2, seed=3)
    plain.set_epoch(3)
    assert list(s) == list(plain) and len(s) == len(plain)


def test_merge_states_rejects_missing_duplicate_or_disagreeing_ranks():
    states, _ = _save(4, 1, 4)
    with pytest.raises(ConfigError, match=r"ranks \[3\] are missing"):
        merge_states(states[:3])
    with pytest.raises(ConfigError, match="given twice"):
        merge_states([*states[:3], states[0]])
    other = {**states[3], "epoch": 5}
    with pytest.raises(ConfigError, match="disagree on epoch"):
        merge_states([*states[:3], other])
    with pytest.raises(ConfigError, match="seed"):
        ShardSampler(CHUNKS, 0, 2, seed=4).resume_elastic(merge_states(states), None)


def test_sampler_state_dict_round_trip_mid_iteration():
    s = ShardSampler(CHUNKS, 1, 3, seed=9)
    s.set_epoch(4)
    it = iter(s)
    head = [next(it) for _ in range(37)]
    state = s.state_dict()
    assert state["yielded"] == 37 and state["epoch"] == 4
    fresh = ShardSampler(CHUNKS, 1, 3, seed=9)
    fresh.load_state_dict(state)
    assert head + list(fresh) == list(s.order(4))
    with pytest.raises(ConfigError, match="rank"):
        ShardSampler(CHUNKS, 0, 3, seed=9).load_state_dict(state)


def test_first_steps_are_the_chunks_of_each_ranks_first_batches():
    world, steps, batch = 3, 2, 8
    heads = first_steps(CHUNKS, world, steps, batch, seed=5, epoch=1)
    starts = np.concatenate(([0], np.cumsum(CHUNKS)))
    for r, chunks in enumerate(heads):
        s = ShardSampler(CHUNKS, r, world, seed=5)
        s.set_epoch(1)
        first = list(s)[: steps * batch]
        need = np.searchsorted(starts, first, side="right") - 1
        assert set(chunks.tolist()) == set(need.tolist())
        assert chunks[0] == need[0]


def _owner_nodes(shards, nodes):
    out = np.empty(N, dtype=object)
    for r, shard in enumerate(shards):
        out[shard] = nodes[r]
    return out


def test_later_epochs_after_a_resume_keep_chunks_on_their_nodes():
    from shardcache.sharding import assign_chunks

    states, _ = _save(4, 2, 8, nodes=OLD_NODES)
    two = _resume(merge_states(states), 2, ["nodeA", "nodeB"])
    for s in two:
        s.set_epoch(3)  # past the resumed epoch: the new world's own shards
    orders = [list(s) for s in two]
    assert len(orders[0]) == len(orders[1]) == 501  # 1,001 over 2, one padded
    assert sorted(set(orders[0]) | set(orders[1])) == list(range(N))
    assert set(two[0].shard.tolist()).isdisjoint(two[1].shard.tolist())
    before = _owner_nodes(assign_chunks(CHUNKS, 4, 3), OLD_NODES)
    after = _owner_nodes([s.shard for s in two], ["nodeA", "nodeB"])
    held = Counter(before.tolist())
    bound = sum(max(0, k - 501) for k in held.values())
    moved = int((before != after).sum())
    assert moved <= bound + 2
    # Rendezvous over rank numbers alone would move about half.
    plain = _owner_nodes(assign_chunks(CHUNKS, 2, 3), ["nodeA", "nodeB"])
    assert int((before != plain).sum()) > 4 * moved + N // 5


def test_resume_at_a_later_epoch_of_a_resumed_world_chains_exactly():
    states, _ = _save(4, 2, 8, nodes=OLD_NODES)
    nodes2 = ["nodeA", "nodeB"]
    two = _resume(merge_states(states), 2, nodes2)
    for s in two:
        s.set_epoch(3)
    seen = [i for s in two for i in list(s)[:100]]
    again = [
        {**s.state(), "consumed": 100, "node": nodes2[r]} for r, s in enumerate(two)
    ]
    assert all(st["basis"] is not None and st["resumed_from"] is None for st in again)
    merged = merge_states(again)
    # Small and plain: JSON, O(ranks), whatever the dataset size.
    assert len(json.dumps(merged)) < 1000
    three = _resume(merge_states(again), 3, ["nodeA", "nodeB", "nodeC"])
    rest = [i for s in three for i in s]
    assert Counter(seen + rest) == Counter(range(N))
    # The same world restored from one rank's own state continues its order.
    same = ShardSampler(CHUNKS, 1, 2, seed=3)
    same.load_state_dict({**again[1], "yielded": 100})
    assert list(same) == list(two[1].order(3))[100:]


@pytest.mark.parametrize("new_world", [2, 3, 6])
def test_resume_with_shuffle_blocks_is_exact_and_keeps_block_locality(new_world):
    states, seen = _save(4, 3, 16, nodes=OLD_NODES, shuffle_block=128)
    merged = merge_states(states)
    assert merged["block"] == 128
    nodes = [f"node{'AB'[r % 2]}" for r in range(new_world)]
    samplers = _resume(merged, new_world, nodes, shuffle_block=128)
    rest = [i for s in samplers for i in s]
    assert Counter(seen + rest) == Counter(range(N))
    # The resumed epoch keeps the chunk blocks: a rank's first 128 samples
    # come from fewer chunks than a full shuffle of its share touches.
    full = _resume(merged_full := merge_states(_save(4, 3, 16, nodes=OLD_NODES)[0]),
                   new_world, nodes)  # fmt: skip
    assert merged_full["block"] == 0

    def chunks_of_first(sampler) -> int:
        first = np.asarray(list(sampler)[:128])
        return len(np.unique(np.searchsorted(np.cumsum(CHUNKS), first, "right")))

    assert sum(map(chunks_of_first, samplers)) < sum(map(chunks_of_first, full))


@pytest.mark.parametrize("bad", [-1, "1", 1.5, True, None])
def test_set_epoch_takes_a_whole_number_and_names_anything_else(bad):
    s = ShardSampler(CHUNKS, 0, 1)
    with pytest.raises(ConfigError, match=r"set_epoch\(epoch\) takes an integer"):
        s.set_epoch(bad)
    s.set_epoch(np.int64(2))
    assert s.epoch == 2


def test_a_loop_restarting_at_epoch_0_after_a_resume_is_warned(caplog):
    """A README trial looped ``range(0, epochs)`` after ``load_state_dict``
    and got 32 samples twice with nothing said. Going on to the next epoch
    says nothing, whatever was left of the resumed one (a state saved at an
    epoch's end under drop_last has fewer samples than the epoch)."""
    s = ShardSampler(CHUNKS, 1, 3, seed=9)
    s.set_epoch(1)
    it = iter(s)
    [next(it) for _ in range(32)]
    mid = s.state_dict()
    with caplog.at_level("WARNING", logger="shardcache"):
        for epoch in (1, 2):
            resumed = ShardSampler(CHUNKS, 1, 3, seed=9)
            resumed.load_state_dict(mid)
            resumed.set_epoch(epoch)
        assert caplog.records == []
        resumed = ShardSampler(CHUNKS, 1, 3, seed=9)
        resumed.load_state_dict(mid)
        resumed.set_epoch(0)
        (record,) = caplog.records
        assert "set_epoch(0) after a resume loaded for epoch 1 drops it" in (
            record.getMessage()
        )
        assert "range(ds.sampler.epoch, epochs)" in record.getMessage()
        # An elastic resume (every rank's states, another world) too.
        states, _ = _save(4, 5, 16, epoch=2)
        (elastic,) = _resume(merge_states(states), 1, ["n0"])
        elastic.set_epoch(0)
    assert len(caplog.records) == 2

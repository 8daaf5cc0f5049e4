"""The first epoch of a listing read while it was listed: segment by segment,
the same count on every rank, and the same order however much of the
listing a rank had seen."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from shardcache.chunks import ChunkLayout
from shardcache.errors import ConfigError
from shardcache.sampler import ShardSampler
from shardcache.segments import (
    WHOLE_LISTING,
    GrowingListing,
    segment_bounds,
    segment_order,
)


def _layout(rng: np.random.Generator, chunks: int) -> np.ndarray:
    return rng.integers(1, 40, size=chunks)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_segment_is_dealt_whole_and_evenly(world: int, drop_last: bool) -> None:
    rng = np.random.default_rng(world)
    sizes = _layout(rng, 30)
    layout = ChunkLayout.from_sizes(sizes)
    starts = layout.starts
    ends = [int(starts[3]), int(starts[9]), int(starts[20])]
    for number, bounds in enumerate(segment_bounds(starts, ends, True)):
        orders = [
            segment_order(layout, bounds, number, world, r, seed=5, shuffle=True,
                          drop_last=drop_last)
            for r in range(world)
        ]  # fmt: skip
        assert len({len(o) for o in orders}) == 1  # every rank the same count
        got = Counter(int(i) for o in orders for i in o)
        lo, hi = bounds
        assert set(got) <= set(range(lo, hi))
        if drop_last:
            assert sum(got.values()) == (hi - lo) // world * world
            assert max(got.values()) == 1
        else:
            assert set(got) == set(range(lo, hi))  # nothing left out
            assert sum(got.values()) - (hi - lo) < world  # at most W - 1 padded


def _sampler(sizes: np.ndarray, listing: GrowingListing, rank: int) -> ShardSampler:
    return ShardSampler(sizes, rank, 2, seed=3, listing=listing)


def test_a_rank_that_saw_fewer_prefixes_deals_the_same_order() -> None:
    """One rank follows the listing as it grows (its sampler waits for the
    next prefix); the other is built on the finished listing: the same
    first epoch, and the ranks' counts equal at every segment's end."""
    rng = np.random.default_rng(0)
    sizes = _layout(rng, 40)
    starts = ChunkLayout.from_sizes(sizes).starts
    ends = [int(starts[4]), int(starts[12]), int(starts[25])]
    steps = iter([(12, ends[:2], False), (25, ends, False), (40, ends, True)])
    growing = _sampler(sizes[:4], GrowingListing(ends[:1], complete=False), 0)
    asked: list[bool] = []

    def grow(wait: bool) -> None:
        asked.append(wait)
        if wait:
            chunks, known, done = next(steps)
            growing.extend(sizes[:chunks], known, done)

    growing.follow(grow)
    growing.set_epoch(0)
    streamed = list(growing)
    whole = _sampler(sizes, GrowingListing(ends, complete=True), 0)
    whole.set_epoch(0)
    assert streamed == whole.order().tolist() == list(whole)
    assert True in asked  # it waited for the listing, and only then
    other = _sampler(sizes, GrowingListing(ends, complete=True), 1)
    other.set_epoch(0)
    assert len(other) == len(whole)
    assert Counter(streamed + list(other)).keys() == set(range(int(sizes.sum())))
    # Epoch 1 reads the finished listing with the stable shard: exact.
    for s in (whole, other):
        s.set_epoch(1)
    epoch_1 = list(whole) + list(other)
    n = int(sizes.sum())
    assert set(epoch_1) == set(range(n)) and len(epoch_1) - n == n % 2  # one pad


def test_a_copy_that_cannot_follow_says_so() -> None:
    sizes = np.array([4, 4, 4])
    sampler = _sampler(sizes[:1], GrowingListing([4], complete=False), 0)
    with pytest.raises(ConfigError, match="still being listed"):
        len(sampler)
    assert sampler.known_order().size == 2  # the first segment's half: no wait


def test_a_resume_of_the_first_epoch_reads_the_saved_segments() -> None:
    rng = np.random.default_rng(1)
    sizes = _layout(rng, 20)
    starts = ChunkLayout.from_sizes(sizes).starts
    saved_ends = [int(starts[3]), int(starts[10])]
    first = _sampler(sizes, GrowingListing(saved_ends), 0)
    first.set_epoch(0)
    order = first.order().tolist()
    state = first.state()
    assert state["segments"] == saved_ends
    # The new job's listing published other prefixes (or none): the saved
    # segments decide the resumed epoch's order.
    again = _sampler(sizes, GrowingListing([int(starts[7])]), 0)
    again.use_segments(state["segments"])
    again.resume(0, 50)
    again.set_epoch(0)
    assert list(again) == order[50:]
    # Epoch 1 has no segments: its state says so.
    again.set_epoch(1)
    assert again.state()["segments"] is None


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_first_epoch_state_resumes_at_another_world_size(new_world: int) -> None:
    """An elastic resume of a segmented first epoch deals exactly the samples
    the old ranks had not read: the old orders are recomputed from the
    saved segments (resume.plan.world_orders)."""
    sizes = np.array([8] * 10)
    ends = [32]  # segments (0, 32) and (32, 80)
    old = [ShardSampler(sizes, r, 2, listing=GrowingListing(ends)) for r in range(2)]
    consumed = [10, 23]  # rank 1 is past the first segment
    seen = [i for s, c in zip(old, consumed, strict=True) for i in list(s)[:c]]
    merged = {**old[0].state(), "consumed": consumed, "nodes": ["a", "b"]}
    assert merged["segments"] == ends
    rest = []
    for r in range(new_world):
        sampler = ShardSampler(sizes, r, new_world, listing=GrowingListing(ends))
        sampler.resume_elastic(merged, ["a"] * new_world)
        rest += list(sampler)
    assert not set(seen) & set(rest)
    assert sorted(set(seen) | set(rest)) == list(range(80))
    assert len(rest) - len(set(rest)) < new_world  # padding only


def test_a_state_saved_at_the_first_epochs_end_resumes_to_nothing_left() -> None:
    sizes = np.array([8] * 10)
    old = [ShardSampler(sizes, r, 2, listing=GrowingListing([32])) for r in range(2)]
    merged = {**old[0].state(), "consumed": [len(list(s)) for s in old],
              "nodes": ["a", "b"]}  # fmt: skip
    sampler = ShardSampler(sizes, 0, 3, listing=GrowingListing([32]))
    plan = sampler.resume_elastic(merged, ["a", "a", "b"])
    assert plan.remaining == 0 and list(sampler) == []


def test_the_first_segment_is_read_chunk_by_chunk() -> None:
    """A cold first batch waits for the chunks it touches: in the first
    segment, one; later segments (prefetched while the one before is read)
    shuffle across their chunks."""
    layout = ChunkLayout.from_sizes(np.full(20, 50))
    first = segment_order(
        layout, (0, 500), 0, 2, 0, seed=1, shuffle=True, drop_last=False
    )
    later = segment_order(
        layout, (500, 1000), 1, 2, 0, seed=1, shuffle=True, drop_last=False
    )
    assert len(set(layout.chunk_of(first[:50]).tolist())) == 1
    assert sorted(first.tolist()) != first.tolist()  # still shuffled within
    assert len(set(layout.chunk_of(later[:50]).tolist())) > 1


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize(("pieces", "world"), [(16, 1), (16, 2), (16, 4), (16, 8), (16, 16), (64, 32), (64, 64)])  # fmt: skip
def test_the_listings_small_first_pieces_are_read_first(
    pieces: int, world: int, whole: bool
) -> None:
    """A listing's first chunk comes in pieces (the services' RAMP_PIECES,
    64): every rank holds one while there are enough (they are dealt
    evenly, not by the rendezvous score alone, which left 1-2 of 8 ranks
    and 5-6 of 16 without one: their first batch, and so every rank's DDP
    step, waited for a whole chunk) and reads it before any whole chunk,
    so its first batch waits for a piece's build."""
    size = 1024 // pieces  # the first chunk, cut; the others whole
    layout = ChunkLayout.from_sizes(np.array([size] * pieces + [1024] * 24))
    small = set(range(pieces))
    n = int(layout.starts[-1])
    for seed in range(3):
        for rank in range(world):
            order = segment_order(
                layout, (0, n), 0, world, rank,
                seed=seed, shuffle=True, drop_last=False, whole=whole,
            )  # fmt: skip
            chunks = layout.chunk_of(order)
            held = len(set(chunks.tolist()) & small)
            assert held == pieces // world, (seed, rank)  # evenly, one at least
            assert set(chunks[: size * held].tolist()) <= small
            assert len(set(chunks[:size].tolist())) == 1  # one piece at a time


@pytest.mark.parametrize("world", [2, 3])
def test_a_whole_listing_as_one_segment_deals_the_stable_shards(world: int) -> None:
    """A fresh listing read chunk by chunk in its first epoch (one segment,
    the whole listing) gives each rank the chunks of its stable shard, so
    later epochs read them where the first one built them."""
    sizes = np.array([16] * 16 + [256] * 12)
    n = int(sizes.sum())
    for rank in range(world):
        one = ShardSampler(
            sizes, rank, world, seed=5, listing=GrowingListing([WHOLE_LISTING, n])
        )
        plain = ShardSampler(sizes, rank, world, seed=5)
        first = np.asarray(list(one))
        assert set(first.tolist()) == set(plain.shard.tolist())
        assert len(first) == len(list(plain))  # the same count as any epoch
        assert len(set(one.layout.chunk_of(first[:16]).tolist())) == 1
        one.set_epoch(1)
        assert list(one) == list(plain.order(1))


def test_a_prefix_that_is_the_whole_listing_deals_alike_before_and_after() -> None:
    """A streamed listing whose one prefix turned out to be all of it (ends
    ``[n]``): a rank that started on the prefix and one that got the
    finished listing deal the same order (only WHOLE_LISTING marks a
    listing dealt as the stable shards)."""
    layout = ChunkLayout.from_sizes(np.array([16] * 16 + [256] * 12))
    n = int(layout.starts[-1])
    for rank in range(3):
        early = GrowingListing([n], complete=False)
        first = early.orders(layout, 3, rank, seed=2, shuffle=True, drop_last=False)
        early.grew([n], True)
        late = GrowingListing([n], complete=True)
        order = dict(seed=2, shuffle=True, drop_last=False)
        assert np.array_equal(first[0], late.orders(layout, 3, rank, **order)[0])
        assert np.array_equal(early.orders(layout, 3, rank, **order)[0], first[0])


def test_the_stateful_protocol_resumes_the_saved_segments_too() -> None:
    """torchdata's StatefulDataLoader restores through the sampler's own
    ``load_state_dict``: the saved segments decide the order there too."""
    rng = np.random.default_rng(2)
    sizes = _layout(rng, 12)
    starts = ChunkLayout.from_sizes(sizes).starts
    first = _sampler(sizes, GrowingListing([int(starts[2]), int(starts[6])]), 1)
    first.set_epoch(0)
    it = iter(first)
    head = [next(it) for _ in range(40)]
    saved = first.state_dict()
    again = _sampler(sizes, GrowingListing(), 1)  # a listing read whole: no ends
    again.load_state_dict(saved)
    assert head + list(again) == first.order().tolist()


def test_a_pass_begun_while_the_listing_grew_is_not_audited_midway() -> None:
    """The delivery audit starts at a pass's first batch: one begun while
    the listing grew is left unchecked (a check from its middle would see a
    pass already under way and call it sharded twice)."""
    sizes = np.full(8, 64)
    ends = [128]
    sampler = _sampler(sizes[:2], GrowingListing(ends, complete=False), 0)
    sampler.follow(lambda wait: wait and sampler.extend(sizes, ends, True))
    sampler.set_epoch(0)
    it = iter(sampler)
    for _ in range(4):  # the listing ends while the second batch is drawn
        sampler.audit(np.array([next(it) for _ in range(64)]))
    assert sampler.listing.complete

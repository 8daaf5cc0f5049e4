"""A mixture's order and its deal over ranks, as pure functions: weights held
in every window, each draw dealt once, and a resume at any world size that
delivers exactly what is left."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardcache.errors import ConfigError
from shardcache.mix_order import (
    check_mixture,
    mixture_order,
    normalise_weights,
    window_tolerance,
)
from shardcache.mix_progress import Progress, deal, deal_lengths
from shardcache.mix_sampler import MixtureSampler, merge_mix_states


def _window_counts(components: np.ndarray, k: int, m: int) -> np.ndarray:
    onehot = np.eye(k, dtype=np.int64)[components]
    prefix = np.vstack([np.zeros(k, dtype=np.int64), np.cumsum(onehot, axis=0)])
    return prefix[m:] - prefix[:-m]


def test_mix_order_holds_weights_in_every_window():
    rng = np.random.default_rng(7)
    for _ in range(40):
        k = int(rng.integers(2, 6))
        w = normalise_weights(rng.random(k) + 0.01)
        order = mixture_order([500] * k, w, seed=1, epoch=0, epoch_samples=2000)
        tol = window_tolerance(w)
        for m in (1, 3, 8, 32, 100, 777):
            dev = np.abs(_window_counts(order.components, k, m) - w * m).max(axis=0)
            assert (dev <= tol + 1e-9).all(), (w, m, dev, tol)


def test_mix_order_cycle_reads_every_sample_once_per_pass():
    sizes, w = [100, 10, 5], [0.7, 0.2, 0.1]
    order = mixture_order(sizes, w, seed=3, epoch=1)
    counts = np.bincount(order.components, minlength=3)
    assert counts[0] == 100  # the longest-lasting component: every sample once
    assert len(order) == 100 + counts[1] + counts[2]
    for k, n in enumerate(sizes):
        idx = order.indices[order.components == k]
        passes = math.ceil(len(idx) / n)
        for p in range(passes):  # each pass is a permutation of the component
            chunk = idx[p * n : (p + 1) * n]
            assert len(set(chunk.tolist())) == len(chunk)
        assert set(idx.tolist()) == set(range(n))


def test_mix_order_end_epoch_stops_before_the_first_repeat():
    order = mixture_order(
        [100, 10, 5], [0.7, 0.2, 0.1], seed=0, epoch=0, on_exhausted="end_epoch"
    )
    for k, n in enumerate([100, 10, 5]):
        idx = order.indices[order.components == k].tolist()
        assert len(idx) == len(set(idx)) <= n
    # One more position would repeat a sample of some component.
    longer = mixture_order(
        [100, 10, 5], [0.7, 0.2, 0.1], seed=0, epoch=0, epoch_samples=len(order) + 1
    )
    extra = int(longer.components[-1])
    assert np.count_nonzero(longer.components == extra) > [100, 10, 5][extra]


def test_mix_order_is_a_pure_function_and_reshuffles_by_epoch():
    a = mixture_order([50, 20], [0.5, 0.5], seed=4, epoch=0)
    b = mixture_order([50, 20], [0.5, 0.5], seed=4, epoch=0)
    c = mixture_order([50, 20], [0.5, 0.5], seed=4, epoch=1)
    assert np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.components, c.components)  # weights fix the interleave
    assert not np.array_equal(a.indices, c.indices)


def test_mix_order_zero_weight_leaves_a_component_out():
    order = mixture_order([10, 10, 10], [1, 0, 1], seed=0, epoch=0)
    assert 1 not in order.components.tolist() and len(order) == 20


@pytest.mark.parametrize(
    ("weights", "words"),
    [
        ([0.5, -0.5], "code=-0.5"),
        ([0.5, float("nan")], "code=nan"),
        ([0, 0], "all zero"),
        ([1], "one weight per component"),
        (["a", 1], "must be numbers"),
    ],
)
def test_mix_bad_weights_are_config_errors(weights, words):
    with pytest.raises(ConfigError, match=words):
        check_mixture([4, 4], weights, names=["web", "code"])


def test_mix_weights_are_normalised_and_empty_component_is_named():
    assert normalise_weights([2, 2, 4]).tolist() == [0.25, 0.25, 0.5]
    with pytest.raises(ConfigError, match="'books' has no samples"):
        check_mixture([4, 4, 0], [1, 1, 1], names=["web", "code", "books"])
    with pytest.raises(ConfigError, match="on_exhausted"):
        check_mixture([4], [1], on_exhausted="stop")


def test_deal_covers_the_rest_once_with_lengths_one_apart():
    for count, world, block in [(0, 3, 4), (7, 3, 2), (100, 4, 5), (101, 6, 8)]:
        rest = np.arange(1000, 1000 + count)
        got = [deal(rest, world, r, block) for r in range(world)]
        assert sorted(np.concatenate(got).tolist()) == rest.tolist()
        assert [len(g) for g in got] == deal_lengths(count, world, block)
        assert (
            max(deal_lengths(count, world, block))
            - min(deal_lengths(count, world, block))
            <= 1
        )


def _resume_chain(length, steps):
    """Run ``steps`` of (world, block, consumed per rank); the delivered
    positions of each and the progress at the end."""
    progress, delivered = Progress(), []
    for world, block, consumed in steps:
        rest = progress.rest(length)
        for r in range(world):
            delivered += deal(rest, world, r, block)[: consumed[r]].tolist()
        progress = progress.advance(length, world, block, consumed)
    return progress, delivered


def test_progress_resumes_at_any_world_even_when_ranks_are_uneven():
    length = 137
    # 4 ranks in lockstep, then 3 ranks uneven (one ran ahead), then 6 to the end.
    progress, delivered = _resume_chain(
        length, [(4, 5, [10, 10, 10, 10]), (3, 4, [8, 12, 9])]
    )
    assert progress.skipped  # the uneven counts are recorded exactly
    rest = progress.rest(length)
    delivered += np.concatenate([deal(rest, 6, r, 3) for r in range(6)]).tolist()
    assert sorted(delivered) == list(range(length))


def _sampler(world, rank, **kw):
    kw.setdefault("block", 5)
    return MixtureSampler(
        [60, 30, 30], ["web", "code", "books"], [0.5, 0.25, 0.25],
        rank=rank, world_size=world, seed=2, **kw,
    )  # fmt: skip


def test_mixture_sampler_state_of_4_ranks_resumes_at_2_3_6_exactly_once():
    old = [_sampler(4, r) for r in range(4)]
    full = [s.order()[:10].tolist() for s in old]  # two batches a rank
    states = []
    for s in old:
        state = s.state_dict()
        state["consumed"] = 10
        states.append(state)
    merged = merge_mix_states(states)
    assert merged["start"] == 40 and merged["skipped"] == []
    for world in (2, 3, 6):
        new = [_sampler(world, r) for r in range(world)]
        for s in new:
            s.load_state_dict(merged)
        rest = [list(s) for s in new]
        lengths = [len(x) for x in rest]
        assert max(lengths) - min(lengths) <= 1
        got = sorted(sum(full, []) + sum(rest, []))
        assert got == list(range(120)), world  # 60 + 30 + 30: each once


def test_mixture_sampler_own_state_continues_and_curriculum_is_recorded():
    schedule = lambda e: [0.5, 0.25, 0.25] if e == 0 else [0.2, 0.4, 0.4]  # noqa: E731
    a = MixtureSampler(
        [60, 30, 30], ["web", "code", "books"], schedule, rank=1, world_size=2, block=5
    )
    a.set_epoch(1)
    first = list(a)[:7]
    state = {**a.state(), "consumed": 7}
    assert state["weights"] == [0.2, 0.4, 0.4]
    b = MixtureSampler(
        [60, 30, 30], ["web", "code", "books"], [1, 1, 1], rank=1, world_size=2, block=5
    )
    b.load_state_dict(state)  # the saved epoch keeps the weights it ran on
    assert first + list(b) == a.order().tolist()
    with pytest.raises(ConfigError, match="every rank's state"):
        MixtureSampler(
            [60, 30, 30], ["web", "code", "books"], [1, 1, 1], rank=0, world_size=3
        ).load_state_dict(state)

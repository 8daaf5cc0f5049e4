"""Rank and world from wherever a launcher puts them; the sampler as trainers see it."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from shardcache.audit import DeliveryAudit
from shardcache.errors import ConfigError, ShardedTwiceError
from shardcache.sampler import ShardSampler
from shardcache.world import World

SIZES = [10] * 8


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, (0, 1, "none")),
        ({"RANK": "3", "WORLD_SIZE": "4"}, (3, 4, "env")),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, (1, 2, "env")),  # Lightning
        ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "4"}, (1, 4, "env")),
        (
            {
                "LOCAL_RANK": "1",
                "GROUP_RANK": "1",
                "LOCAL_WORLD_SIZE": "2",
                "WORLD_SIZE": "4",
            },
            (3, 4, "env"),
        ),
    ],
)
def test_world_detect_reads_each_launchers_variables(env, expected):
    w = World.detect(env)
    assert (w.rank, w.world_size, w.source) == expected


@pytest.mark.parametrize(
    "env",
    [{"WORLD_SIZE": "2"}, {"LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "4"}],
)
def test_world_detect_unknowable_rank_is_a_config_error(env):
    with pytest.raises(ConfigError, match="rank"):
        World.detect(env)


def test_sampler_reads_world_at_first_use_not_at_construction(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # and no rank: fine until used
    s = ShardSampler(SIZES, None, None, shuffle=False)
    monkeypatch.setenv("LOCAL_RANK", "1")  # the launcher said it since
    assert (s.rank, s.num_replicas) == (1, 2)
    assert isinstance(s, DistributedSampler)
    assert s.total_size == 2 * s.num_samples == 80
    assert set(s.shard).isdisjoint(ShardSampler(SIZES, 0, 2, shuffle=False).shard)


def test_sampler_unknowable_rank_raises_at_first_use(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    s = ShardSampler(SIZES, None, None)
    with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
        iter(s)


def test_sampler_set_epoch_calls_back_and_pickles_without_the_callback():
    seen = []
    s = ShardSampler(SIZES, 0, 2)
    s.bind(lambda e, resuming: seen.append((e, resuming)))
    s.set_epoch(1)
    assert seen == [(1, False)] and s.epoch == 1
    copy = pickle.loads(pickle.dumps(s))  # a lambda: would fail if kept
    assert copy.epoch == 1 and copy._on_epoch is None
    assert np.array_equal(copy.order(), s.order())


def test_audit_ignores_a_plain_loader_and_its_workers():
    order = np.arange(200)
    for workers in (1, 2):
        a = DeliveryAudit()
        for b in range(0, 4):  # worker 0's batches: every workers-th
            start = b * workers * 20
            a.check(order, order[start : start + 20], 2, workers)


def test_audit_raises_on_every_second_batch():
    order = np.random.default_rng(0).permutation(200)
    a = DeliveryAudit()
    a.check(order, order[20:40], 2, 1)  # rank 1 under BatchSamplerShard
    with pytest.raises(ShardedTwiceError, match="accelerator.prepare"):
        a.check(order, order[60:80], 2, 1)


def test_audit_switches_off_for_foreign_samplers():
    order = np.random.default_rng(0).permutation(200)
    a = DeliveryAudit()
    a.check(order, np.arange(20), 2, 1)  # not a run of the order
    a.check(order, order[0:20], 2, 1)
    a.check(order, order[40:60], 2, 1)  # would raise if still checking

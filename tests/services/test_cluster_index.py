"""ClusterIndex: the stores' claims, ownership and writes, against a real Redis."""

from __future__ import annotations

import json
import threading
import uuid

import pytest

from shardcache import keys
from shardcache.index import INVALIDATE_CALL_TTL_S
from shardcache_server.index import ClusterIndex


@pytest.fixture
def index(redis_url):
    return ClusterIndex.from_url(redis_url, f"t{uuid.uuid4().hex[:8]}")


def test_cluster_index_invalidate_bumps_generation_atomically_and_drops_entries(index):
    index.register("ds", "s3://b/", "fp", 1, 1)
    index.record_entries("ds", 1, {"s3://b/x": {"etag": "e1"}})
    index.claim_owners("ds", 1, ["s3://b/x"], "node/1")
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(index.invalidate("ds")))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(2, 10))  # no lost update
    assert index.entries("ds", 1) == {} and index.owners("ds", 1) == {}
    assert index.invalidate("unknown") == 0


def test_cluster_index_invalidate_one_call_of_many_ranks_makes_one_generation(index):
    index.register("ds", "s3://b/", "fp", 1, 1)
    results: list[int] = []

    def call(reading: int) -> None:
        results.append(index.invalidate("ds", call="job/1", reading=reading))

    # Ranks still on generation 1, or moved to 2 by the first rank's call.
    threads = [threading.Thread(target=call, args=(1 + i % 2,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [2] * 8  # the first call made it, the others got it
    assert index.generation("ds") == 2
    key = keys.invalidated_key(index.ns, "ds", "job/1")
    assert 0 < index.client.ttl(key) <= INVALIDATE_CALL_TTL_S
    # A rank that reads a later generation than the call made is not in it;
    # the job's next call, another job's, and a call without a name are new.
    index.invalidate("ds")
    assert index.invalidate("ds", call="job/1", reading=3) == 4
    assert index.invalidate("ds", call="job/2", reading=4) == 5
    assert index.invalidate("ds", call="other/1", reading=5) == 6
    assert index.invalidate("ds") == 7


def test_cluster_index_invalidate_changed_drops_exactly_changed_keys_and_keeps_owners(
    index,
):
    index.register("ds", "s3://b/", "fp", 3, 3)
    index.record_entries("ds", 1, {u: {"etag": "old"} for u in ("a", "b", "c")})
    index.claim_owners("ds", 1, ["a", "b", "c"], "node-a/1")
    changed = index.invalidate_changed("ds", 1, {"a": "old", "b": "new", "c": "old"})
    assert changed == ["b"]
    assert sorted(index.entries("ds", 1)) == ["a", "c"]
    # The owner keeps "b": its old chunk is the base of the partial rebuild,
    # so another node asking for "b" is sent there rather than claiming it.
    assert index.claim_owners("ds", 1, ["b"], "node-b/1") == ["node-a/1"]


def test_cluster_index_refresh_racing_a_refetch_keeps_the_new_version(index):
    index.register("ds", "s3://b/", "fp", 1, 1)
    index.record_entries("ds", 1, {"a": {"etag": "old"}})
    pubsub = index.client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.invalidation_channel(index.ns))
    assert pubsub.get_message(timeout=2) is None  # consumes the subscribe reply
    # Rank 0 refreshes, its store re-fetches and records the new version ...
    assert index.invalidate_changed("ds", 1, {"a": "new"}) == ["a"]
    index.record_entries("ds", 1, {"a": {"etag": "new"}})
    # ... then rank 1 refreshes with the same listing: nothing left to drop.
    assert index.invalidate_changed("ds", 1, {"a": "new"}) == []
    assert index.entries("ds", 1)["a"]["etag"] == "new"
    msg = pubsub.get_message(timeout=2)
    # Stores learn the new ETag, so they evict only the old version's value.
    assert json.loads(msg["data"])["etags"] == {"a": "new"}
    assert pubsub.get_message(timeout=0.5) is None


def test_cluster_index_claim_gives_one_owner_and_takeover_needs_expected_owner(index):
    assert index.claim_owners("ds", 1, ["k1", "k2"], "A/1") == ["A/1", "A/1"]
    assert index.claim_owners("ds", 1, ["k1", "k3"], "B/1") == ["A/1", "B/1"]
    assert index.take_over("ds", 1, ["k1"], "X/9", "B/1") == [
        "A/1"
    ]  # wrong expectation: no change
    assert index.take_over("ds", 1, ["k1"], "A/1", "B/1") == ["B/1"]
    # Many paths in one call: unowned ones are taken, others' kept.
    assert index.take_over("ds", 1, ["k1", "k2", "k9"], "B/1", "C/1") == [
        "C/1",
        "A/1",
        "C/1",
    ]
    assert index.release("ds", 1, ["k1", "k2"], "C/1") == 1


def test_cluster_index_stats_series_and_ranks_roundtrip(index):
    index.flush_stats({("ds", 1): {"hits": 3, "misses": 1}}, "node-a", now=1000.0)
    index.flush_stats({("ds", 2): {"hits": 1}}, "node-b", now=1011.0)
    stats = index.stats("ds")
    assert (stats.hits, stats.misses, stats.hit_rate) == (4, 1, 0.8)
    assert index.node_stats("ds", "node-a").hits == 3
    assert index.generation_stats("ds", 1).misses == 1
    assert index.generation_stats("ds", 2).hits == 1
    series = index.series("ds", window_s=60, now=1015.0)
    assert [(b, s.hits) for b, s in series] == [(1000, 3), (1010, 1)]
    index.record_rank("ds", "job", 1, {"wait_p99_ms": 2.5})
    assert index.ranks("ds") == {"job/1": {"wait_p99_ms": 2.5}}

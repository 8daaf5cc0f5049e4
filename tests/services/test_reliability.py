"""Faults with real components: a node leaves, Redis restarts, tenants share a Redis."""

from __future__ import annotations

import time
import uuid
from urllib.parse import urlsplit

import pytest
import ray
from torch.utils.data import DataLoader

from shardcache import DistributedCachedDataset
from shardcache.decoders import raw_bytes
from shardcache.embedded import free_port, start_redis_server
from shardcache.errors import IndexUnavailable
from shardcache.index import RedisIndex
from shardcache_server.cluster import store_for_node
from shardcache_server.index import ClusterIndex

from helpers import Reader, cached_samples, register_dataset

pytestmark = pytest.mark.slow


def test_node_removed_keys_move_to_live_owner(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    s3fs_client.pipe({f"{bucket}/d/{i:02d}": f"v{i}".encode() * 8 for i in range(10)})
    index, spec, items = register_dataset(s3, f"s3://{bucket}/d/", redis_url, namespace)
    gen = spec["generation"]
    extra = ray_cluster.add_node(
        num_cpus=1,
        object_store_memory=80 * 2**20,
        node_ip_address="127.0.0.1",
        resources={"node9": 1},
    )
    ray_cluster.wait_for_nodes()
    doomed = Reader.options(resources={"node9": 0.01}).remote(redis_url, namespace)
    ray.get(doomed.install.remote(spec, raw_bytes))
    doomed_node = ray.get(doomed.node.remote())
    ray.get(doomed.read.remote("ds", gen, items))
    assert {o.split("/")[0] for o in index.owners("ds", gen).values()} == {doomed_node}
    ray_cluster.remove_node(extra)
    survivor = Reader.options(resources={"node0": 0.01}).remote(redis_url, namespace)
    ray.get(survivor.install.remote(spec, raw_bytes))
    s3.reset_counts()
    statuses, values = ray.get(survivor.read.remote("ds", gen, items), timeout=120)
    assert values == [f"v{i}".encode() * 8 for i in range(10)]
    assert s3.total_gets == 10  # the lost node's entries were re-fetched once
    live = ray.get(survivor.node.remote())
    assert {o.split("/")[0] for o in index.owners("ds", gen).values()} == {live}


@pytest.fixture
def private_redis(tmp_path):
    """A Redis of our own that the test may kill and restart on the same port."""
    port, password = free_port(), "pw-" + uuid.uuid4().hex

    def start():
        return start_redis_server(tmp_path, port=port, password=password)

    proc, url = start()
    handle = {"proc": proc, "url": url, "start": start}
    yield handle
    handle["proc"].terminate()


def test_redis_restart_reads_continue_and_index_recovers(
    ray_cluster, s3, s3fs_client, bucket, private_redis, namespace
):
    s3fs_client.pipe({f"{bucket}/d/{i:02d}": bytes([i]) * 32 for i in range(12)})
    ds = DistributedCachedDataset(
        f"s3://{bucket}/d/",
        storage_options=s3.storage_options(),
        redis_url=private_redis["url"],
        namespace=namespace,
        shuffle=False,
        # Reads the generation before every batch: the mode that leans on
        # Redis hardest (the default reads it once per epoch).
        consistency="batch",
    )
    expected = [bytes([i]) * 32 for i in range(12)]
    assert [bytes(ds[i].numpy()) for i in range(12)] == expected
    s3.reset_counts()
    private_redis["proc"].terminate()
    private_redis["proc"].wait(timeout=10)
    # Redis is down: cached reads keep working, never blocking on the index.
    started = time.monotonic()
    assert [bytes(ds[i].numpy()) for i in range(12)] == expected
    assert time.monotonic() - started < 30
    assert ds.stats()["index_errors"] > 0 and s3.total_gets == 0
    private_redis["proc"], _ = private_redis["start"]()  # empty: no persistence
    assert [bytes(ds[i].numpy()) for i in range(12)] == expected
    index = RedisIndex.from_url(private_redis["url"], namespace)
    deadline = time.monotonic() + 20
    while (
        cached_samples(index, ds.name, ds.generation) < 12
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    # stores re-recorded their entries
    assert cached_samples(index, ds.name, ds.generation) == 12
    generation = index.invalidate(ds.name)  # taken into account right away
    assert [bytes(ds[i].numpy()) for i in range(12)] == expected
    assert ds.generation == generation and s3.total_gets == 12


def test_after_redis_restarts_empty_new_jobs_read_the_source_as_it_is(
    ray_cluster, s3, s3fs_client, bucket, private_redis, namespace
):
    """Redis without persistence comes back empty and numbers generations from
    1 again, while the stores still hold later ones (or the same number for
    another preprocess): what they hold under the old numbers is never served."""
    import numpy as np

    s3fs_client.pipe({f"{bucket}/r/{i:02d}": bytes([i]) * 16 for i in range(6)})

    def job(preprocess=raw_bytes) -> list[bytes]:  # a new run of a script
        ds = DistributedCachedDataset(
            f"s3://{bucket}/r/", preprocess=preprocess,
            storage_options=s3.storage_options(), redis_url=private_redis["url"],
            namespace=namespace, shuffle=False,
        )  # fmt: skip
        try:
            return [bytes(ds[i].numpy()) for i in range(len(ds))]
        finally:
            ds.close()

    def restart_empty() -> None:
        private_redis["proc"].terminate()
        private_redis["proc"].wait(timeout=10)
        private_redis["proc"], _ = private_redis["start"]()  # no persistence

    expected = [bytes([i]) * 16 for i in range(6)]
    assert job() == expected
    index = RedisIndex.from_url(private_redis["url"], namespace)
    (name,) = index.datasets()
    index.invalidate(name)
    index.invalidate(name)  # the stores now hold generation 3
    assert job() == expected
    s3fs_client.pipe({f"{bucket}/r/02": b"new" * 5})
    expected[2] = b"new" * 5
    restart_empty()
    assert job() == expected  # generation 1 again, below the stores' 3
    assert RedisIndex.from_url(private_redis["url"], namespace).invalidate(name) == 2
    assert job() == expected
    # Once more, and a new preprocess gets the stores' own number (1 after
    # 2): the same generation for another fingerprint is not the same data.
    restart_empty()
    assert job() == expected
    restart_empty()
    doubled = [bytes(np.frombuffer(b, np.uint8) * 2) for b in expected]
    assert job(lambda b: np.frombuffer(b, np.uint8) * 2) == doubled
    events = RedisIndex.from_url(private_redis["url"], namespace).events(50)
    assert any(e["kind"] == "index_restarted" for e in events)


def test_tenants_on_one_redis_cannot_see_or_invalidate_each_other(redis_url):
    a = RedisIndex.from_url(redis_url, f"tenant-a-{uuid.uuid4().hex[:6]}")
    b = RedisIndex.from_url(redis_url, f"tenant-b-{uuid.uuid4().hex[:6]}")
    a.register("shared-name", "s3://a/", "fp", 1, 1)
    b.register("shared-name", "s3://b/", "fp", 1, 1)
    assert a.invalidate("shared-name") == 2
    assert b.generation("shared-name") == 1
    assert a.dataset("shared-name").source == "s3://a/"
    assert all(
        k.startswith(f"shardcache:{b.ns}:")
        for k in b.client.scan_iter(f"shardcache:{b.ns}:*")
    )


def test_tenant_acl_user_is_confined_to_its_namespace_by_redis(redis, redis_url):
    # Beyond key prefixes: a Redis ACL user per tenant, so a tenant's
    # credentials cannot touch another tenant's keys at all.
    ns_a, ns_b = (f"acl-{t}-{uuid.uuid4().hex[:6]}" for t in "ab")
    password = uuid.uuid4().hex
    redis.acl_setuser(
        f"user-{ns_a}",
        enabled=True,
        passwords=[f"+{password}"],
        keys=[f"shardcache:{ns_a}:*"],
        channels=[f"shardcache:{ns_a}:*"],
        commands=["+@all", "-@admin", "-@dangerous"],
        reset_keys=True,
        reset_channels=True,
    )
    try:
        hostport = urlsplit(redis_url).netloc.rsplit("@", 1)[-1]
        url_a = f"redis://user-{ns_a}:{password}@{hostport}/0"
        a = RedisIndex.from_url(url_a, ns_a)
        assert a.register("d", "s3://a/", "fp", 1, 1) == 1
        assert a.invalidate("d") == 2 and a.datasets() == ["d"]
        RedisIndex.from_url(redis_url, ns_b).register("d", "s3://b/", "fp", 1, 1)
        intruder = RedisIndex.from_url(url_a, ns_b)
        with pytest.raises(IndexUnavailable, match="may not use this namespace") as err:
            intruder.invalidate("d")
        assert password not in str(err.value)
        assert RedisIndex.from_url(redis_url, ns_b).generation("d") == 1
    finally:
        redis.acl_deluser(f"user-{ns_a}")


def test_store_killed_for_good_mid_epoch_ranks_keep_reading(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, monkeypatch
):
    # The rank holds nothing (every batch asks its store) and prefetches: the
    # kill lands with references of the dead store already in flight.
    monkeypatch.setenv("SHARDCACHE_HOLD_BYTES", "0")
    s3fs_client.pipe({f"{bucket}/d/{i:02d}": bytes([i]) * 64 for i in range(40)})
    ds = DistributedCachedDataset(
        f"s3://{bucket}/d/",
        storage_options=s3.storage_options(),
        redis_url=redis_url,
        namespace=namespace,
        prefetch_batches=4,
        chunk_samples=4,  # 10 chunks, so the kill lands between store calls
    )
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, collate_fn=list)
    node = ray.get_runtime_context().get_node_id()
    index = ClusterIndex.from_url(redis_url, namespace)

    def epoch(n, kill_after=None):
        ds.set_epoch(n)
        seen = {}
        for b, batch in enumerate(loader):
            order = ds.sampler.order()[b * 4 : (b + 1) * 4]
            seen.update(
                {int(i): bytes(t.numpy()) for i, t in zip(order, batch, strict=True)}
            )
            if b == kill_after:
                store = store_for_node(namespace, node)
                dead = ray.get(store.ping.remote())
                ray.kill(store, no_restart=True)  # no restart budget left
                _wait_until_dead(store)  # the prefetched references die with it
        assert seen == {i: bytes([i]) * 64 for i in range(40)}
        return dead if kill_after is not None else None

    epoch(0)
    s3.reset_counts()
    dead = epoch(1, kill_after=2)
    # The index no longer points at the dead store: what it held is either
    # forgotten or re-fetched by its successor.
    assert dead not in set(index.owners(ds.name, ds.generation).values())
    epoch(2)
    # Every lost entry was read again from the source, exactly once.
    assert sorted(s3.gets.values()) == [1] * 40
    owners = set(index.owners(ds.name, ds.generation).values())
    assert len(owners) == 1 and dead not in owners
    assert cached_samples(index, ds.name, ds.generation) == 40
    ds.close()


def _wait_until_dead(actor, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed store is still answering")

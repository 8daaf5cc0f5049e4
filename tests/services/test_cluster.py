"""Store actors on a real 2-node Ray cluster: pull-once, restarts, reuse by a second job."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
import ray.cloudpickle

from shardcache.decoders import raw_bytes
from shardcache_server.cluster import ensure_stores, store_for_node
from shardcache_server.settings import ServiceSettings

from helpers import Reader, register_dataset

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.slow


def _dataset(s3, s3fs_client, bucket, redis_url, namespace, count, chunk_samples=1):
    s3fs_client.pipe(
        {f"{bucket}/d/{i:03d}.bin": f"object-{i}".encode() * 10 for i in range(count)}
    )
    return register_dataset(
        s3, f"s3://{bucket}/d/", redis_url, namespace, chunk_samples=chunk_samples
    )


def _readers(redis_url, namespace, spec):
    readers = [
        Reader.options(resources={f"node{i}": 0.01}).remote(redis_url, namespace)
        for i in (0, 1)
    ]
    ray.get([r.install.remote(spec, raw_bytes) for r in readers])
    return readers


@pytest.mark.parametrize("chunk_samples", [1, 10])
def test_pull_once_64_concurrent_readers_on_2_nodes_make_exactly_100_gets(
    ray_cluster, node_ids, s3, s3fs_client, bucket, redis_url, namespace, chunk_samples
):
    index, spec, items = _dataset(
        s3, s3fs_client, bucket, redis_url, namespace, 100, chunk_samples
    )
    readers = _readers(redis_url, namespace, spec)
    s3.reset_counts()
    calls = [
        readers[i % 2].read.remote("ds", 1, items, spec["manifest"]) for i in range(64)
    ]
    outputs = ray.get(calls, timeout=300)
    assert s3.total_gets == 100  # counted at the S3 server
    assert all(count == 1 for count in s3.gets.values())
    objects = [f"object-{i}".encode() * 10 for i in range(100)]
    expected = [
        b"".join(objects[c : c + chunk_samples]) for c in range(0, 100, chunk_samples)
    ]
    assert all(values == expected for _, values in outputs)
    owners = index.owners("ds", 1)
    assert len(owners) == 100 // chunk_samples  # one claim per chunk
    assert {o.split("/")[0] for o in owners.values()} <= set(node_ids)


def test_changed_member_asked_from_another_node_is_rebuilt_at_the_owner(
    ray_cluster, node_ids, s3, s3fs_client, bucket, redis_url, namespace
):
    # One chunk of 10 objects, built and owned by node 0's store.
    index, spec, items = _dataset(s3, s3fs_client, bucket, redis_url, namespace, 10, 10)
    readers = _readers(redis_url, namespace, spec)
    s3.reset_counts()
    ray.get(readers[0].read.remote("ds", 1, items, spec["manifest"]))
    assert s3.total_gets == 10
    s3fs_client.pipe({f"{bucket}/d/004.bin": b"changed!" * 10})
    new_items, digest = ray.get(readers[1].refresh.remote(spec, "job/1"))
    assert new_items[0][1] != items[0][1]
    # A rank on node 1 asks first: it is sent to the owner, which still holds
    # the old chunk, and only the changed object is read again.
    statuses, values = ray.get(readers[1].read.remote("ds", 1, new_items, digest))
    assert statuses == ["fetched"]
    assert s3.total_gets == 11
    objects = [f"object-{i}".encode() * 10 for i in range(10)]
    objects[4] = b"changed!" * 10
    assert values == [b"".join(objects)]
    assert index.owners("ds", 1)["c0"].split("/")[0] == node_ids[0]


def test_second_job_in_new_process_reuses_cache_with_zero_reads(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    index, spec, items = _dataset(s3, s3fs_client, bucket, redis_url, namespace, 20)
    readers = _readers(redis_url, namespace, spec)
    ray.get(readers[0].read.remote("ds", 1, items))
    s3.reset_counts()
    script = textwrap.dedent(f"""
        import ray
        from shardcache.transport.direct import CacheClient
        from shardcache.config import ClientConfig
        from shardcache.decoders import raw_bytes
        ray.init(address={ray_cluster.address!r}, log_to_driver=False)
        client = CacheClient(ClientConfig(redis_url={redis_url!r}, namespace={namespace!r}))
        client.install({spec!r}, raw_bytes)
        results = client.get_refs("ds", 1, {items!r})
        print(sorted(set(str(s) for s, _ in results)))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        "['hit']" in out.stdout
        or "['hit', 'remote-hit']" in out.stdout
        or "['remote-hit']" in out.stdout
    )
    assert s3.total_gets == 0


def test_store_killed_and_restarted_still_serves_by_refetching(
    ray_cluster, node_ids, s3, s3fs_client, bucket, redis_url, namespace
):
    index, spec, items = _dataset(s3, s3fs_client, bucket, redis_url, namespace, 10)
    readers = _readers(redis_url, namespace, spec)
    ray.get(readers[1].read.remote("ds", 1, items))
    store = store_for_node(namespace, node_ids[1])
    before = ray.get(store.ping.remote())
    ray.kill(store, no_restart=False)  # Ray restarts it (max_restarts)
    # ray.kill is asynchronous: read only once the old incarnation is gone.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if ray.get(store.ping.remote(), timeout=5) != before:
                break
        except ray.exceptions.RayError:
            break  # dead or restarting: the kill has landed
        time.sleep(0.05)
    s3.reset_counts()
    statuses, values = ray.get(readers[1].read.remote("ds", 1, items), timeout=120)
    assert values == [f"object-{i}".encode() * 10 for i in range(10)]
    assert statuses.count("fetched") == 10 and s3.total_gets == 10
    after = ray.get(store_for_node(namespace, node_ids[1]).ping.remote())
    assert after != before  # a new incarnation took over the claims
    time.sleep(0.5)
    assert {o for o in index.owners("ds", 1).values()} == {after}


def test_ensure_stores_pins_one_detached_store_per_node(
    ray_cluster, node_ids, redis_url, namespace
):
    handles = ensure_stores(ServiceSettings(redis_url=redis_url, namespace=namespace))
    assert sorted(handles) == sorted(node_ids)
    infos = ray.get([h.info.remote() for h in handles.values()])
    assert sorted(i["node_id"] for i in infos) == sorted(node_ids)
    again = ensure_stores(ServiceSettings(redis_url=redis_url, namespace=namespace))
    assert {n: h._actor_id for n, h in again.items()} == {
        n: h._actor_id for n, h in handles.items()
    }


def test_stores_started_with_an_unreachable_redis_are_replaced_by_a_later_script(
    ray_cluster, node_ids, s3, s3fs_client, bucket, redis_url, namespace
):
    from shardcache import DistributedCachedDataset
    from shardcache.errors import IndexUnavailable

    # An earlier script with a wrong redis_url (nothing listens on port 1):
    # a clear error naming it, the password redacted.
    wrong = "redis://:s3cretPW@127.0.0.1:1/0"
    with pytest.raises(IndexUnavailable, match=r"127\.0\.0\.1:1") as err:
        ensure_stores(ServiceSettings(redis_url=wrong, namespace=namespace))
    assert "s3cretPW" not in str(err.value)
    # The next script, with the right one, reads: the stores the wrong URL
    # started are replaced, not reused without an index.
    s3fs_client.pipe({f"{bucket}/d/{i}.bin": bytes([i]) * 8 for i in range(6)})

    def dataset(url: str) -> DistributedCachedDataset:
        return DistributedCachedDataset(
            f"s3://{bucket}/d/",
            storage_options=s3.storage_options(),
            redis_url=url,
            namespace=namespace,
            rank=0,
            world_size=1,
        )

    ds = dataset(redis_url)
    assert sorted(int(ds[i][0]) for i in range(6)) == list(range(6))
    infos = ray.get([store_for_node(namespace, n).info.remote() for n in node_ids])
    assert len(infos) == 2
    # The same wrong URL again, with the stores running on the right one: no
    # store is replaced (they reach their Redis), the wrong one is named.
    with pytest.raises(IndexUnavailable, match=r"127\.0\.0\.1:1"):
        dataset(wrong)
    ds.close()


_ = (np, ThreadPoolExecutor)

"""A dataset larger than the store's memory budget, with a disk tier: warm
epochs read the rows they need from the node's chunk files (mapped by the
rank), with no source GET, every sample right, and the reads counted as
``disk``; a file deleted after the store named it is asked for again."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
import ray
from torch.utils.data import DataLoader

from shardcache import DistributedCachedDataset
from shardcache.transport.base import Status
from shardcache_server.cluster import ensure_stores, store_for_node
from shardcache_server.settings import ServiceSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SAMPLES = 48
PER_CHUNK = 4  # 12 chunks of ~64 KiB
SAMPLE_BYTES = 16 * 2**10
BUDGET = 4 * PER_CHUNK * SAMPLE_BYTES + 2**10  # 4 of 12 chunks: data is 3x memory


def _epoch(ds, loader, epoch):
    ds.set_epoch(epoch)
    got = {}
    for b, batch in enumerate(loader):
        order = ds.sampler.order()[b * 8 : (b + 1) * 8]
        got.update(
            {int(i): bytes(t.numpy()) for i, t in zip(order, batch, strict=True)}
        )
    return got


def _data_and_stores(monkeypatch, s3fs_client, bucket, redis_url, namespace, disk_dir):
    """The objects in the emulator and the node's store, ``disk_dir`` its
    disk tier (``None``: none); returns the payload by sample."""
    # The rank keeps nothing between batches: every batch asks the store.
    monkeypatch.setenv("SHARDCACHE_HOLD_BYTES", "0")
    payload = {i: np.random.default_rng(i).bytes(SAMPLE_BYTES) for i in range(SAMPLES)}
    s3fs_client.pipe({f"{bucket}/d/{i:02d}": v for i, v in payload.items()})
    disk = {"disk_dir": str(disk_dir)} if disk_dir is not None else {}
    ensure_stores(
        ServiceSettings(
            redis_url=redis_url, namespace=namespace, cache_bytes=BUDGET, **disk
        )
    )
    return payload


def _open(s3, bucket, redis_url, namespace, **extra):
    ds = DistributedCachedDataset(
        f"s3://{bucket}/d/",
        storage_options=s3.storage_options(),
        redis_url=redis_url,
        namespace=namespace,
        chunk_samples=PER_CHUNK,
        **extra,
    )
    return ds, DataLoader(ds, batch_size=8, sampler=ds.sampler, collate_fn=list)


@pytest.fixture
def larger_than_memory(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, monkeypatch, tmp_path
):
    payload = _data_and_stores(
        monkeypatch, s3fs_client, bucket, redis_url, namespace, tmp_path / "disk"
    )
    ds, loader = _open(s3, bucket, redis_url, namespace)
    assert _epoch(ds, loader, 0) == payload
    assert s3.total_gets == SAMPLES
    store = store_for_node(namespace, ray.get_runtime_context().get_node_id())
    assert ray.get(store.flush_disk.remote())["disk_chunks"] == SAMPLES // PER_CHUNK
    s3.reset_counts()
    yield ds, loader, payload, store
    ds.close()


def test_warm_epoch_larger_than_memory_reads_rows_from_the_disk_tier(
    larger_than_memory, s3
):
    ds, loader, payload, store = larger_than_memory
    before = ray.get(store.info.remote())
    cold = ds.stats()
    assert cold["served"]["source"] == SAMPLES
    assert _epoch(ds, loader, 1) == payload  # every sample, the same bytes
    assert s3.total_gets == 0
    after = ray.get(store.info.remote())
    # Not reloaded into the object store: what memory holds did not change.
    assert after["entries"] == before["entries"] <= 4
    assert after["used_bytes"] <= after["budget_bytes"]
    stats = ds.stats()  # counts since the job started: epoch 1 is the difference
    served = {o: stats["served"][o] - cold["served"][o] for o in cold["served"]}
    # hold_bytes=0: the rank keeps no chunk from memory, so even the chunks
    # memory holds come as their files (every chunk is on the disk tier).
    assert served["disk"] == SAMPLES
    assert served["local"] == 0 and served["source"] == 0
    assert stats["cluster"]["samples_by_origin"]["disk"] == served["disk"]
    assert stats["misses"] == cold["misses"]


def test_a_warm_epoch_maps_each_disk_tier_file_once_with_nothing_held(
    larger_than_memory,
):
    # hold_bytes=0 keeps no chunk from memory between batches; a mapped file
    # costs the rank no memory of its own, so it stays mapped for the epoch
    # and each chunk is asked for once, not in every batch that touches it.
    ds, loader, payload, _ = larger_than_memory
    client = ds._session.reader.client
    asked = client.get_refs
    named: Counter[str] = Counter()

    def counting(*args, **kwargs):
        results = asked(*args, **kwargs)
        named.update(r[1] for r in results if r[0] == Status.DISK)
        return results

    client.get_refs = counting
    try:
        assert _epoch(ds, loader, 1) == payload
    finally:
        client.get_refs = asked
    assert len(named) == SAMPLES // PER_CHUNK
    assert set(named.values()) == {1}, named  # each file named once this epoch


def _resolve_all(ds, fault):
    """Every chunk resolved through the rank's own transport, with ``fault``
    wrapped around its store call: ``fault(get_refs, *args, **kwargs)``."""
    reader = ds._session.reader
    client = reader.client
    asked = client.get_refs
    client.get_refs = lambda *args, **kwargs: fault(asked, *args, **kwargs)
    chunks = list(range(SAMPLES // PER_CHUNK))
    items = reader.manifest.chunk_items(chunks, reader.versions)
    try:
        return client.resolve(ds._session.spec.name, reader.generation, items)
    finally:
        client.get_refs = asked


def _assert_rows(results, payload):
    for c, (_, columns) in enumerate(results):
        for row in range(PER_CHUNK):
            got = bytes(np.asarray(columns["_"][row]))
            assert got == payload[c * PER_CHUNK + row]


def test_a_chunk_file_deleted_after_the_store_named_it_is_asked_for_again(
    larger_than_memory, s3
):
    ds, _, payload, store = larger_than_memory
    deleted = []

    def delete_after_reply(get_refs, *args, **kwargs):
        # The fault: the disk budget deletes the file between the store's
        # answer and the rank's open (a window too narrow to hit for real).
        results = get_refs(*args, **kwargs)
        for status, path in results:
            if status == Status.DISK:
                os.unlink(path)
                deleted.append(path)
        return results

    results = _resolve_all(ds, delete_after_reply)
    in_memory = ray.get(store.info.remote())["entries"]
    assert len(deleted) == SAMPLES // PER_CHUNK - in_memory > 0
    assert all(status != Status.DISK for status, _ in results)
    _assert_rows(results, payload)
    # Rebuilt from the source (their files were gone), once each.
    assert s3.total_gets == len(deleted) * PER_CHUNK


def test_a_process_that_cannot_see_the_stores_disk_stops_asking_for_files(
    larger_than_memory, s3
):
    ds, _, payload, _ = larger_than_memory
    calls = []

    def elsewhere(get_refs, *args, files=False, **kwargs):
        # The fault: the store's disk is another container's filesystem,
        # so the path it names does not exist here.
        calls.append(files)
        return [
            (status, f"/nonexistent-{id(calls)}/{path}")
            if status == Status.DISK
            else (status, path)
            for status, path in get_refs(*args, files=files, **kwargs)
        ]

    for _ in range(2):
        _assert_rows(_resolve_all(ds, elsewhere), payload)
    assert calls == [True, False, False]  # asked again once, then never files
    assert s3.total_gets == 0  # the store reloaded them from its disk


def test_a_full_shuffle_over_the_disk_tier_is_told_nothing(
    larger_than_memory, s3, caplog
):
    # Its files stay mapped for the epoch: no rebuild, nothing to advise.
    ds, loader, payload, _ = larger_than_memory
    with caplog.at_level("WARNING", logger="shardcache.block_advice"):
        for epoch in (1, 2):
            assert _epoch(ds, loader, epoch) == payload
        ds.set_epoch(3)
    assert ds.stats()["suggested_shuffle_block"] == 0
    assert not [m for m in caplog.messages if "shuffle_block" in m]
    assert s3.total_gets == 0


def test_without_a_disk_tier_warm_rebuilds_are_told_the_block_and_the_tier(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, monkeypatch, caplog
):
    payload = _data_and_stores(
        monkeypatch, s3fs_client, bucket, redis_url, namespace, disk_dir=None
    )
    ds, loader = _open(s3, bucket, redis_url, namespace)
    with caplog.at_level("WARNING", logger="shardcache.block_advice"):
        assert _epoch(ds, loader, 0) == payload
        ds.set_epoch(1)  # after the cold epoch: its builds say nothing
        cold = ds.stats()
        assert cold["suggested_shuffle_block"] == 0
        assert _epoch(ds, loader, 1) == payload
        ds.set_epoch(2)
    # The warm epoch rebuilt what memory could not hold from the source,
    # chunks more than once (a full shuffle asks for each in many batches).
    rebuilt = ds.stats()["served"]["source"] - cold["served"]["source"]
    assert SAMPLES > rebuilt > SAMPLES // 2 and s3.total_gets > SAMPLES + rebuilt
    assert ds.stats()["suggested_shuffle_block"] > 0
    block = ds.stats()["suggested_shuffle_block"]
    (said,) = [m for m in caplog.messages if "shuffle_block" in m]
    assert f"{rebuilt} of {SAMPLES} samples from the source again" in said
    assert "SHARDCACHE_DISK_DIR" in said and f"shuffle_block={block}" in said
    ds.close()
    # The advice taken: the same data in blocks, every sample once per
    # epoch, each chunk rebuilt about once a warm epoch, not several times.
    blocked, blocked_loader = _open(
        s3, bucket, redis_url, namespace, shuffle_block=block
    )
    for epoch in (0, 1):
        s3.reset_counts()
        assert _epoch(blocked, blocked_loader, epoch) == payload
        assert s3.total_gets <= SAMPLES  # each chunk built at most once
    blocked.close()


@pytest.mark.parametrize("change", ["invalidate", "refresh"])
def test_source_reads_after_an_invalidate_or_refresh_are_not_told_as_evictions(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, caplog, change
):
    # The data fits in memory: the epoch after a change reads from the
    # source because of the change, and nothing was evicted. The listing
    # and generation compared were those at the epoch boundary, which
    # already showed a change made before set_epoch.
    payload = {i: bytes([i]) * 64 for i in range(SAMPLES)}
    s3fs_client.pipe({f"{bucket}/d/{i:02d}": v for i, v in payload.items()})
    ds, loader = _open(s3, bucket, redis_url, namespace, revalidate=0.001)
    with caplog.at_level("WARNING", logger="shardcache.block_advice"):
        for epoch in (0, 1):
            assert _epoch(ds, loader, epoch) == payload
        if change == "invalidate":
            ds.invalidate()
        else:
            payload = {i: bytes([i + 1]) * 64 for i in range(SAMPLES)}
            s3fs_client.pipe({f"{bucket}/d/{i:02d}": v for i, v in payload.items()})
            assert len(ds.refresh()) == SAMPLES
        before = ds.stats()["served"]["source"]
        assert _epoch(ds, loader, 2) == payload
        assert ds.stats()["served"]["source"] - before == SAMPLES  # read again
        ds.set_epoch(3)
    assert ds.stats()["suggested_shuffle_block"] == 0
    assert not [m for m in caplog.messages if "shuffle_block" in m]
    ds.close()

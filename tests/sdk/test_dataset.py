"""DistributedCachedDataset in one process on the 2-node cluster, plus bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from shardcache import DistributedCachedDataset
from shardcache.errors import (
    CollateError,
    ConfigError,
    EmptyDatasetError,
    PreprocessError,
    SampleIndexError,
    SourceNotFound,
    TransformError,
)

pytestmark = pytest.mark.slow


def _objects(s3fs_client, bucket, count=24, prefix="d"):
    payload = {
        f"{bucket}/{prefix}/{i:03d}.bin": bytes([i]) * (50 + i) for i in range(count)
    }
    s3fs_client.pipe(payload)
    return payload


def _ds(s3, bucket, redis_url, namespace, prefix="d", **kw):
    kw.setdefault("storage_options", s3.storage_options())
    return DistributedCachedDataset(
        f"s3://{bucket}/{prefix}/", redis_url=redis_url, namespace=namespace, **kw
    )


def test_dataset_bytes_equal_direct_read_and_later_epochs_make_no_gets(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    payload = _objects(s3fs_client, bucket)
    ds = _ds(s3, bucket, redis_url, namespace)
    assert len(ds) == 24 and len(ds.sampler) == 24
    loader = DataLoader(ds, batch_size=5, sampler=ds.sampler, collate_fn=list)
    s3.reset_counts()
    for epoch in range(3):
        ds.set_epoch(epoch)
        seen = [t for batch in loader for t in batch]
        assert sorted(bytes(t.numpy()) for t in seen) == sorted(payload.values())
        if epoch == 0:
            assert s3.total_gets == 24
    assert s3.total_gets == 24  # epochs 2 and 3: zero remote reads
    stats = ds.stats()
    assert stats["remote_reads"] == 24 and stats["hits"] > 0
    assert stats["wait_p99_ms"] >= stats["wait_p50_ms"] > 0
    ds.close()


def test_dataset_over_a_list_of_prefixes_reads_every_object_once(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    train = _objects(s3fs_client, bucket, count=10, prefix="train")
    val = _objects(s3fs_client, bucket, count=6, prefix="val")
    ds = DistributedCachedDataset(
        [f"s3://{bucket}/train/", f"s3://{bucket}/val/"],
        storage_options=s3.storage_options(),
        redis_url=redis_url,
        namespace=namespace,
    )
    assert len(ds) == 16
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, collate_fn=list)
    s3.reset_counts()
    for epoch in range(2):
        ds.set_epoch(epoch)
        seen = sorted(bytes(t.numpy()) for batch in loader for t in batch)
        assert seen == sorted([*train.values(), *val.values()])
    assert s3.total_gets == 16  # each object once, over both epochs


def test_dataset_invalidate_refetches_and_serves_new_content(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _objects(s3fs_client, bucket, count=6)
    ds = _ds(s3, bucket, redis_url, namespace, shuffle=False)
    first = [bytes(ds[i].numpy()) for i in range(6)]
    s3fs_client.pipe({f"{bucket}/d/002.bin": b"new" * 19})  # same size, new ETag
    s3.reset_counts()
    changed = ds.refresh()
    assert changed == [f"s3://{bucket}/d/002.bin"]
    assert bytes(ds[2].numpy()) == b"new" * 19
    assert s3.total_gets == 1  # exactly the changed object
    gen = ds.invalidate()
    assert gen == 2
    assert [bytes(ds[i].numpy()) for i in (0, 1)] == first[:2]
    assert s3.total_gets == 1 + 6  # the new generation re-builds the (one) chunk


def _wait_for_store_generation(namespace, name, generation, timeout_s=10.0):
    import time

    import ray

    from shardcache_server.cluster import store_for_node

    store = store_for_node(namespace, ray.get_runtime_context().get_node_id())
    deadline = time.monotonic() + timeout_s
    while ray.get(store.info.remote())["generations"].get(name) != generation:
        assert time.monotonic() < deadline, "the store never saw the invalidation"
        time.sleep(0.05)


@pytest.mark.parametrize("consistency", ["epoch", "batch"])
def test_dataset_invalidation_mid_epoch_takes_effect_per_consistency_mode(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, monkeypatch, consistency
):
    from shardcache.index import RedisIndex

    payload = _objects(s3fs_client, bucket)
    # Hold nothing on the rank, so every batch really asks the store.
    monkeypatch.setenv("SHARDCACHE_HOLD_BYTES", "0")
    # One object per chunk: the counts below are per object.
    ds = _ds(s3, bucket, redis_url, namespace, consistency=consistency, chunk_samples=1)
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, collate_fn=list)
    ds.set_epoch(0)
    assert len([t for b in loader for t in b]) == 24
    s3.reset_counts()
    ds.set_epoch(1)
    seen, generations = [], []
    for i, batch in enumerate(loader):
        seen += [bytes(t.numpy()) for t in batch]
        generations.append(ds.generation)
        if i == 1:  # another process (the CLI, a second job) invalidates mid-epoch
            new = RedisIndex.from_url(redis_url, namespace).invalidate(ds.name)
            _wait_for_store_generation(namespace, ds.name, new)
    assert sorted(seen) == sorted(payload.values())
    if consistency == "epoch":
        # The epoch finishes on its snapshot, from the stores' retired values.
        assert generations == [1] * 6 and s3.total_gets == 0
    else:
        # From the next batch on: the new generation, re-fetched.
        assert generations == [1, 1, 2, 2, 2, 2] and s3.total_gets == 16
    ds.set_epoch(2)
    again = [bytes(t.numpy()) for b in loader for t in b]
    assert sorted(again) == sorted(payload.values()) and ds.generation == 2
    assert s3.total_gets == 24  # every object once under generation 2
    ds.close()


def test_dataset_preprocess_change_starts_new_generation(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _objects(s3fs_client, bucket, count=3)
    a = _ds(
        s3,
        bucket,
        redis_url,
        namespace,
        preprocess=lambda b: np.frombuffer(b, np.uint8).copy(),
    )
    assert a.generation == 1 and a[0].shape[0] == 50
    b = _ds(
        s3,
        bucket,
        redis_url,
        namespace,
        preprocess=lambda b: np.frombuffer(b, np.uint8)[:5].copy(),
    )
    assert b.generation == 2 and b[0].shape[0] == 5


def test_dataset_resume_from_state_dict_continues_with_unseen(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _objects(s3fs_client, bucket)
    ds = _ds(s3, bucket, redis_url, namespace, seed=5)
    ds.set_epoch(1)
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, collate_fn=list)
    it = iter(loader)
    seen = [bytes(t.numpy()) for _ in range(2) for t in next(it)]
    state = ds.state_dict()
    assert state["consumed"] == 8 and state["epoch"] == 1
    fresh = _ds(s3, bucket, redis_url, namespace, seed=5)
    fresh.load_state_dict(state)
    rest = [
        bytes(t.numpy())
        for batch in DataLoader(
            fresh, batch_size=4, sampler=fresh.sampler, collate_fn=list
        )
        for t in batch
    ]
    full = [bytes(ds[i].numpy()) for i in ds.sampler.order(1)]
    assert seen + rest == full


def test_a_damaged_or_foreign_state_is_named_and_changes_nothing(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _objects(s3fs_client, bucket, count=12)
    _objects(s3fs_client, bucket, count=12, prefix="other")
    ds = _ds(s3, bucket, redis_url, namespace, seed=5)
    it = iter(DataLoader(ds, batch_size=4, sampler=ds.sampler, collate_fn=list))
    next(it)
    state = ds.state_dict()
    other = _ds(s3, bucket, redis_url, namespace, prefix="other", seed=5)
    # Same size, seed and world: only the name tells the states apart, and no
    # on_change= makes another dataset's positions this one's.
    for on_change in ("error", "new_listing"):
        with pytest.raises(ConfigError, match="saved by dataset .*, not by this one"):
            other.load_state_dict(state, on_change=on_change)
    fresh = _ds(s3, bucket, redis_url, namespace, seed=5)
    damaged = {
        "a count past the epoch": {**state, "consumed": 10**9},
        "a negative count": {**state, "consumed": -5},
        "a text epoch": {**state, "epoch": "zero"},
        "another version": {**state, "version": 7},
        "no state at all": {},
        "a string": "state.pt",
        "None": None,
    }
    for case, bad in damaged.items():
        with pytest.raises(ConfigError) as err:
            fresh.load_state_dict(bad)
        assert "state_dict" in str(err.value), case
    # Nothing of a refused state was applied: the whole epoch is still to come.
    assert len(list(fresh.sampler)) == len(fresh.sampler) == 12
    fresh.load_state_dict(state)
    assert len(list(fresh.sampler)) == 12 - 4


def test_dataset_random_transform_sees_fresh_randomness_each_epoch(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _objects(s3fs_client, bucket, count=4)
    ds = _ds(
        s3,
        bucket,
        redis_url,
        namespace,
        shuffle=False,
        transform=lambda t: t.float() + torch.rand(1),
    )
    epochs = [[float(ds[i][0]) for i in range(4)] for _ in range(2)]
    assert epochs[0] != epochs[1]
    assert float(ds[0][0]) != float(ds[0][0])


def test_dataset_num_workers_attach_lazily(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    payload = _objects(s3fs_client, bucket, count=8)
    ds = _ds(s3, bucket, redis_url, namespace)
    loader = DataLoader(
        ds,
        batch_size=4,
        sampler=ds.sampler,
        collate_fn=list,
        num_workers=2,
        multiprocessing_context="spawn",
    )
    got = sorted(bytes(t.numpy()) for batch in loader for t in batch)
    assert got == sorted(payload.values())


def test_dataset_forked_dataloader_worker_is_told_to_use_spawn(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _objects(s3fs_client, bucket, count=4)
    ds = _ds(s3, bucket, redis_url, namespace)
    loader = DataLoader(
        ds,
        batch_size=4,
        sampler=ds.sampler,
        collate_fn=list,
        num_workers=1,
        multiprocessing_context="fork",
    )
    # A forked worker would inherit Ray's connection and hang on its first call.
    with pytest.raises(ConfigError, match="multiprocessing_context='spawn'"):
        next(iter(loader))


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 0}, "world_size"),
        ({"shuffle": "maybe"}, "shuffle"),
        ({"name": "bad:name"}, "name"),
        ({"preprocess": "decode"}, "callable"),
    ],
)
def test_dataset_bad_arguments_are_config_errors(
    s3, s3fs_client, bucket, redis_url, kw, match
):
    _objects(s3fs_client, bucket, count=2)
    with pytest.raises(ConfigError, match=match):
        _ds(s3, bucket, redis_url, "t", **kw)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"urls": []}, "urls is an empty list"),
        ({"urls": ["/data/a.bin", 5]}, r"urls\[1\] is an int"),
        ({"urls": None}, "urls must be a URL string"),
        ({"urls": 5}, "urls must be a URL string"),
        ({"rank": "0", "world_size": 2}, "rank must be an integer"),
        ({"rank": 3, "world_size": 2}, "rank"),
        ({"shuffle": 1}, "shuffle must be True, False"),
        ({"shuffle": "yes"}, "shuffle must be True, False"),
        ({"drop_last": "no"}, "drop_last must be True or False"),
        ({"seed": "a"}, "seed must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"seed": 2**70}, "seed must be an integer"),
        ({"shuffle_block": -1}, "shuffle_block"),
        ({"chunk_samples": True}, "chunk_samples"),
        ({"storage_options": "x"}, "storage_options must be a dict"),
        ({"format_options": ["x"]}, "format_options must be a dict"),
        ({"format_options": {"columns": ["x"]}}, "read one object per sample"),
        ({"version": 3}, "version must be a string"),
        ({"prefetch_batches": -1}, "^prefetch_batches: Input should be greater"),
        ({"redis_url": "http://:s3cretPW@10.0.0.1:1/0"}, "^redis_url: redis_url must"),
    ],
)
def test_bad_arguments_are_named_before_anything_starts(kw, match):
    # Nothing listens at this Redis: an argument reaching it would be
    # IndexUnavailable, so a ConfigError here was raised before any I/O.
    kw = {"urls": "/data/train/", "redis_url": "redis://127.0.0.1:1/0", **kw}
    with pytest.raises(ConfigError, match=match) as err:
        DistributedCachedDataset(**kw)
    assert "s3cretPW" not in str(err.value) and "pydantic" not in str(err.value)


def test_sample_indices_out_of_range_or_not_integers_are_named(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    payload = _objects(s3fs_client, bucket, count=5)
    ds = _ds(s3, bucket, redis_url, namespace, shuffle=False)
    last = bytes(ds[4].numpy())
    assert bytes(ds[-1].numpy()) == last  # counted from the end, as a list
    for bad in (5, -6, 10**6):
        with pytest.raises(SampleIndexError, match=f"{bad} is out of range.* 5 "):
            ds[bad]
    with pytest.raises(SampleIndexError, match="is a float"):
        ds[1.0]
    with pytest.raises(SampleIndexError, match="5 is out of range"):
        ds.__getitems__([0, 5])
    with pytest.raises(SampleIndexError, match="-1 is out of range"):
        ds.collated([-1])
    with pytest.raises(SampleIndexError, match="must be integers"):
        ds.__getitems__([0.0, 1.0])
    assert isinstance(SampleIndexError("x"), IndexError)
    # Python's iteration protocol stops at the first IndexError: every sample once.
    assert sorted(bytes(t.numpy()) for t in ds) == sorted(payload.values())


def test_samples_of_different_shapes_collated_by_a_dataloader_are_a_collate_error(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    s3fs_client.pipe(
        {f"{bucket}/d/{i:03d}.bin": b"x" * (4 if i == 3 else 8) for i in range(6)}
    )
    ds = _ds(s3, bucket, redis_url, namespace, shuffle=False)
    loader = DataLoader(ds, batch_size=6, sampler=ds.sampler)
    with pytest.raises(CollateError, match=r"shapes \[8\].*\[4\].*collate_fn=list"):
        next(iter(loader))
    # As a list, the batch is what was cached; and other tensors collate as
    # torch does (its own error, not ours).
    as_list = next(
        iter(DataLoader(ds, batch_size=6, sampler=ds.sampler, collate_fn=list))
    )
    assert [len(t) for t in as_list] == [8, 8, 8, 4, 8, 8]
    with pytest.raises(RuntimeError) as err:
        torch.utils.data.default_collate([torch.zeros(2), torch.zeros(3)])
    assert not isinstance(err.value, CollateError)


def test_dataset_empty_or_missing_source(s3, s3fs_client, bucket, redis_url, tmp_path):
    with pytest.raises(EmptyDatasetError):
        DistributedCachedDataset(str(tmp_path), redis_url=redis_url)
    with pytest.raises(SourceNotFound):
        DistributedCachedDataset(
            "s3://missing-bucket-q/x/",
            storage_options=s3.storage_options(),
            redis_url=redis_url,
        )


def test_dataset_preprocess_and_transform_errors_name_the_object(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _objects(s3fs_client, bucket, count=3)

    def explode(data: bytes):
        raise RuntimeError("bad header")

    ds = _ds(s3, bucket, redis_url, namespace, preprocess=explode, shuffle=False)
    with pytest.raises(PreprocessError, match=r"bad header.*|.*000\.bin"):
        ds[0]
    ok = _ds(
        s3,
        bucket,
        redis_url,
        namespace,
        shuffle=False,
        name="other",
        transform=lambda t: t.reshape(7, 7, 7),
    )
    with pytest.raises(TransformError, match="000.bin"):
        ok[0]


def test_dataset_static_cache_at_half_the_dataset_keeps_hit_rate_at_half(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, monkeypatch
):
    # The stores take their budget from the settings of the process that starts them.
    # 20 one-object chunks of 1,000 B (+11 B of chunk metadata: failed flags,
    # errors, checksum); room for 10.
    monkeypatch.setenv("SHARDCACHE_CACHE_BYTES", str(10 * 1011))
    monkeypatch.setenv("SHARDCACHE_EVICTION", "static")
    s3fs_client.pipe({f"{bucket}/d/{i:03d}.bin": bytes([i]) * 1000 for i in range(20)})
    ds = _ds(s3, bucket, redis_url, namespace, shuffle=False, chunk_samples=1)
    s3.reset_counts()
    for epoch in range(3):
        ds.set_epoch(epoch)
        before = ds.stats()
        got = [bytes(ds[i].numpy()) for i in ds.sampler]
        assert got == [bytes([i]) * 1000 for i in range(20)]
        after = ds.stats()
        if epoch:
            # Samples the store could not cache are read through every time:
            # the rank never pins more than the store's budget.
            assert after["hits"] - before["hits"] == 10
            assert after["remote_reads"] - before["remote_reads"] == 10
    assert s3.total_gets == 40

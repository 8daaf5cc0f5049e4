"""shardcache.ray_data: a Ray Dataset over the cache, on the 2-node loopback cluster."""

from __future__ import annotations

import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from shardcache.errors import ConfigError

COUNT = 24  # objects
CHUNK = 4  # samples per chunk: 6 chunks, so both nodes get a share


def _objects(s3fs_client, bucket, count=COUNT, fill=0):
    payload = {
        f"{bucket}/d/{i:03d}.bin": bytes([(i + fill) % 256]) * 32 for i in range(count)
    }
    s3fs_client.pipe(payload)
    return payload


def _read(s3, bucket, redis_url, namespace, **kw):
    from shardcache import ray_data

    kw.setdefault("job", f"j{uuid.uuid4().hex[:8]}")
    return ray_data.read(
        f"s3://{bucket}/d/",
        storage_options=s3.storage_options(),
        redis_url=redis_url,
        namespace=namespace,
        chunk_samples=CHUNK,
        name="rd",
        num_cpus=0.25,
        **kw,
    )


def _samples(batches) -> list[bytes]:
    return [bytes(np.asarray(row)) for b in batches for row in b["data"]]


def test_ray_data_read_rejects_rank_splitting_arguments():
    from shardcache import ray_data

    with pytest.raises(ConfigError, match="does not take shuffle, world_size"):
        ray_data.read("s3://b/d/", shuffle=True, world_size=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_data_read_epochs_and_pipelines_read_each_object_once(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    import ray

    from shardcache.usage import UsageReader

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    payload = _objects(s3fs_client, bucket)
    s3.reset_counts()
    ds = _read(s3, bucket, redis_url, namespace, job="first")
    assert ds.count() == COUNT
    for _epoch in range(2):  # each execution is an epoch
        got = _samples(ds.iter_batches(batch_size=5, batch_format="numpy"))
        assert sorted(got) == sorted(payload.values())
    # Pipelines on top: map_batches, random_shuffle, streaming_split.
    doubled = ds.map_batches(lambda b: {"n": b["data"][:, 0].astype(np.int64) * 2})
    assert sorted(doubled.random_shuffle().to_pandas()["n"]) == [
        2 * i for i in range(COUNT)
    ]
    halves = ds.streaming_split(2, equal=True)
    with ThreadPoolExecutor(2) as pool:  # the splits of one epoch run together
        parts = list(pool.map(lambda h: _samples(h.iter_batches(batch_size=4)), halves))
    assert sorted(parts[0] + parts[1]) == sorted(payload.values())
    assert s3.total_gets == COUNT  # each object once, over every execution
    usage = UsageReader(ray_data_redis(redis_url), namespace).job_totals("rd", "first")
    assert usage.source_reads == COUNT
    assert usage.samples >= 5 * COUNT  # count + 2 epochs + map + split, at least

    # A second job: a new listing, no GETs; a rewritten object is read again.
    s3fs_client.pipe({f"{bucket}/d/003.bin": b"n" * 32})
    s3.reset_counts()
    again = _read(s3, bucket, redis_url, namespace, job="second")
    got = _samples(again.iter_batches(batch_size=8))
    assert sorted(got) == sorted({**payload, f"{bucket}/d/003.bin": b"n" * 32}.values())
    assert s3.total_gets == 1


def ray_data_redis(url: str):
    import redis as redis_py

    return redis_py.Redis.from_url(url, decode_responses=True)

"""Collated batches through ``ds.loader()``, the published listing, and their bad input."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray
import ray.cloudpickle
import torch
from torch.utils.data import DataLoader

from shardcache import DistributedCachedDataset
from shardcache.errors import CollateError, ConfigError

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # as_pair, label


def _blobs(s3fs_client, bucket, count=40, size=32, prefix="b"):
    payload = {
        f"{bucket}/{prefix}/{i:03d}.bin": bytes([i]) * size for i in range(count)
    }
    s3fs_client.pipe(payload)
    return payload


def _ds(s3, bucket, redis_url, namespace, prefix="b", **kw):
    kw.setdefault("storage_options", s3.storage_options())
    kw.setdefault("chunk_samples", 8)
    return DistributedCachedDataset(
        f"s3://{bucket}/{prefix}/", redis_url=redis_url, namespace=namespace, **kw
    )


def as_pair(data: bytes) -> dict[str, np.ndarray]:
    return {
        "x": np.frombuffer(data, np.uint8).astype(np.float32).reshape(4, 8),
        "first": np.array(data[0], dtype=np.int64),
    }


def label(url: str) -> int:
    return int(url.rsplit("/", 1)[-1].split(".")[0]) % 3


def test_loader_batches_equal_stacking_the_samples(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _blobs(s3fs_client, bucket)
    ds = _ds(s3, bucket, redis_url, namespace, seed=5)
    reference = DataLoader(ds, batch_size=6, sampler=ds.sampler)
    for epoch in range(2):  # cold, then warm
        ds.set_epoch(epoch)
        expected = list(reference)  # DataLoader's default collate of the samples
        ds.set_epoch(epoch)
        got = list(ds.loader(6))
        assert len(got) == len(expected) == 7
        for a, b in zip(got, expected, strict=True):
            assert a.shape == b.shape and a.dtype == torch.uint8
            assert torch.equal(a, b) and a.is_contiguous()
        # The DataLoader's batch is the dataset's gather handed back whole
        # (no second copy): each one still equals its samples stacked.
        order = list(ds.sampler)
        for k, b in enumerate(expected):
            samples = [ds[i] for i in order[6 * k : 6 * k + 6]]
            assert torch.equal(b, torch.stack(samples))
    stats = ds.stats()  # the first pass read every object; the rest were held
    assert stats["misses"] == 40 and stats["hits"] == 3 * 40 + 2 * 40  # + ds[i]
    ds.close()


def test_loader_dict_samples_and_targets_collate_per_field(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _blobs(s3fs_client, bucket, count=12)
    ds = _ds(s3, bucket, redis_url, namespace, preprocess=as_pair, target=label)
    ds.set_epoch(0)
    batches = list(ds.loader(5, drop_last=True))
    assert len(batches) == 2
    x, y = batches[0]
    assert set(x) == {"x", "first"} and x["x"].shape == (5, 4, 8)
    assert x["first"].shape == (5,) and y.shape == (5,)
    assert torch.equal(y, x["first"] % 3)  # label(url) of object i is i % 3
    assert torch.equal(x["x"][:, 0, 0].long(), x["first"])
    sample, target = ds[7]
    assert int(sample["first"]) == 7 and int(target) == 1
    ds.close()


def test_loader_ragged_samples_are_collate_error_but_index_works(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    s3fs_client.pipe({f"{bucket}/r/{i}.bin": b"z" * (i + 1) for i in range(4)})
    ds = _ds(s3, bucket, redis_url, namespace, prefix="r", shuffle=False)
    assert [len(ds[i]) for i in range(4)] == [1, 2, 3, 4]
    ds.set_epoch(0)
    with pytest.raises(CollateError, match=r"shapes \[1\] and \[2\]") as err:
        next(iter(ds.loader(4)))
    # ... and which samples, by object (a README trial could not tell).
    assert f"Sample 0 (s3://{bucket}/r/0.bin) has shape [1], sample 1" in str(err.value)
    assert f"(s3://{bucket}/r/1.bin) [2]." in str(err.value)
    ds.close()


def test_loader_pinning_or_a_device_without_cuda_is_config_error(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _blobs(s3fs_client, bucket, count=4)
    ds = _ds(s3, bucket, redis_url, namespace)
    with pytest.raises(ConfigError, match="need CUDA"):
        ds.loader(2, pin_memory=True)
    with pytest.raises(ConfigError, match="CUDA device"):
        ds.loader(2, device="cpu")
    with pytest.raises(ConfigError, match="batch_size"):
        ds.loader(0)
    ds.close()


@pytest.mark.gpu
def test_loader_copies_to_the_gpu_one_batch_ahead(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _blobs(s3fs_client, bucket)
    ds = _ds(s3, bucket, redis_url, namespace)
    ds.set_epoch(0)
    host = [b.clone() for b in ds.loader(8)]
    ds.set_epoch(0)
    gpu = list(ds.loader(8, device="cuda:0"))
    assert all(g.is_cuda for g in gpu)
    assert all(torch.equal(g.cpu(), h) for g, h in zip(gpu, host, strict=True))
    ds.close()


@ray.remote(num_cpus=0)
def _construct(url, storage_options, redis_url, namespace, rank):
    ds = DistributedCachedDataset(
        url,
        storage_options=storage_options,
        redis_url=redis_url,
        namespace=namespace,
        rank=rank,
        world_size=4,
        chunk_samples=8,
        # Four ranks of one job: plain Ray tasks have no launcher to agree
        # on a job id through (Ray Train and torchrun do), so it is named.
        job="one-job",
    )
    return ds.digest, len(ds.sampler)


def test_listing_is_published_once_for_four_ranks_on_two_nodes(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    _blobs(s3fs_client, bucket, count=40)
    s3.reset_counts()
    calls = [
        _construct.options(resources={f"node{r % 2}": 0.01}).remote(
            f"s3://{bucket}/b/", s3.storage_options(), redis_url, namespace, r
        )
        for r in range(4)
    ]
    results = ray.get(calls, timeout=120)
    assert len({digest for digest, _ in results}) == 1
    assert [n for _, n in results] == [10] * 4
    assert s3.lists == 1  # ListObjectsV2 requests counted at the server
    assert s3.total_gets == 0

"""Packed sources through DistributedCachedDataset: 2 gloo ranks on 2 Ray nodes,
3 epochs. The stores read each byte once per cluster (counted at the S3
server, or by the Dataset itself for ``from_dataset``); ranks never open a
source file."""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
import pytest
import ray
import ray.cloudpickle
from packed_files import parquet_bytes, tar_bytes

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow

EPOCHS = 3


class CountingDataset:
    """A user's map-style Dataset that records every __getitem__ call in a
    shared file (appends are atomic), so calls are counted across processes."""

    def __init__(self, log_path: str, count: int):
        self.log_path, self.count = log_path, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        with open(self.log_path, "a") as log:
            log.write(f"{i}\n")
        return np.full(4, i, dtype=np.int32), i


class HandleDataset:
    """Holds an open file: it cannot be pickled, as with an h5py.File in __init__."""

    def __init__(self, path: str):
        self.handle = open(path, "rb")  # noqa: SIM115

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int):
        return np.zeros(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(sample):
    if isinstance(sample, tuple):  # from_dataset: (array, label)
        return int(sample[1]), int(sample[0][0])
    if "cls" in sample:  # tar: {"bin", "cls"}
        return int(bytes(sample["cls"].numpy())), int(sample["bin"][0])
    return int(sample["id"]), float(sample["x"])  # parquet row


def read_rank(rank, world, port, redis_url, namespace, make, refresh_after=None):
    import torch.distributed as dist
    from torch.utils.data import BatchSampler

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        ds = make(redis_url=redis_url, namespace=namespace, seed=5)
        epochs = []
        for epoch in range(EPOCHS):
            if refresh_after is not None and epoch == refresh_after:
                dist.barrier()  # the test rewrote a shard before this epoch
                changed = ds.refresh()
            ds.set_epoch(epoch)
            seen = []
            for batch in BatchSampler(ds.sampler, 4, drop_last=False):
                seen += [_summary(s) for s in ds.__getitems__(batch)]
            dist.barrier()
            epochs.append(seen)
        collated = ds.collated(list(range(min(4, len(ds)))))
        result = {
            "epochs": epochs,
            "collated": [type(collated).__name__],
            "changed": changed if refresh_after is not None else [],
            "stats": ds.stats(),
        }
        ds.close()
        return result
    finally:
        dist.destroy_process_group()


@ray.remote(num_cpus=0)
class RankActor:
    def run(self, *args, **kwargs):
        return read_rank(*args, **kwargs)


def _run(redis_url, namespace, make, **kwargs):
    port = _free_port()
    actors = [RankActor.options(resources={f"node{r}": 0.01}).remote() for r in (0, 1)]
    return ray.get(
        [
            a.run.remote(r, 2, port, redis_url, namespace, make, **kwargs)
            for r, a in enumerate(actors)
        ],
        timeout=300,
    )


def _check_each_sample_once_per_epoch(results, expected):
    for epoch in range(EPOCHS):
        got = sorted(s for res in results for s in res["epochs"][epoch])
        assert got == expected


def test_tar_shards_on_s3_read_once_per_cluster_and_rewrite_rereads_one_shard(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    shards = {
        f"{bucket}/wds/train-{k}.tar": tar_bytes(12, start=12 * k) for k in range(3)
    }
    s3fs_client.pipe(shards)
    options = s3.storage_options()
    url = f"s3://{bucket}/wds/train-*.tar"  # the extension names the format

    def make(**kw):
        from shardcache import DistributedCachedDataset

        return DistributedCachedDataset(
            url, storage_options=options, chunk_samples=6, **kw
        )

    s3.reset_counts()
    results = _run(redis_url, namespace, make)
    _check_each_sample_once_per_epoch(results, [(i, i) for i in range(36)])
    # Each shard: read once by the listing (a tar has no index), then each of
    # its two units once by one build. Over 3 epochs and 2 ranks, no more.
    assert dict(s3.gets) == {f"/{k}": 3 for k in shards}
    assert s3.total_get_bytes <= 2 * sum(len(v) for v in shards.values())
    # Epochs 2 and 3 are hits, then each rank's final collated batch of 4.
    assert sum(r["stats"]["hits"] for r in results) == 2 * 36 + 2 * 4

    # Rewrite one shard (same samples, new payload byte): only its units are read.
    changed = f"{bucket}/wds/train-1.tar"
    s3fs_client.pipe({changed: tar_bytes(12, start=12, payload=99)})
    s3.reset_counts()
    results = _run(redis_url, namespace, make, refresh_after=1)
    assert results[0]["changed"] == [f"s3://{changed}"]
    assert set(s3.gets) == {f"/{changed}"}  # the listing re-read only this shard
    assert s3.gets[f"/{changed}"] == 3  # its index, then its two units


def test_parquet_on_s3_rows_read_once_with_footer_read_once(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    s3fs_client.pipe(
        {
            f"{bucket}/pq/a.parquet": parquet_bytes(30, row_group=10),
            f"{bucket}/pq/b.parquet": parquet_bytes(30, row_group=10, start=30),
        }
    )
    options = s3.storage_options()

    def make(**kw):
        from shardcache import DistributedCachedDataset

        return DistributedCachedDataset(
            f"s3://{bucket}/pq/",
            format="parquet",
            format_options={"columns": ["id", "x"]},
            storage_options=options,
            **kw,
        )

    s3.reset_counts()
    results = _run(redis_url, namespace, make)
    _check_each_sample_once_per_epoch(results, [(i, 2.0 * i) for i in range(60)])
    # Per file: the footer once (listing), one ranged read per row group.
    assert dict(s3.gets) == {f"/{bucket}/pq/a.parquet": 4, f"/{bucket}/pq/b.parquet": 4}
    assert results[0]["collated"] == ["dict"]


def test_from_dataset_calls_getitem_once_per_index_per_cluster(
    ray_cluster, redis_url, namespace, tmp_path
):
    log = tmp_path / "calls.log"
    log.touch()
    source = CountingDataset(str(log), 40)

    def make(**kw):
        from shardcache import DistributedCachedDataset

        return DistributedCachedDataset.from_dataset(
            source, name="counting", chunk_samples=5, **kw
        )

    results = _run(redis_url, namespace, make)
    _check_each_sample_once_per_epoch(results, [(i, i) for i in range(40)])
    calls = [int(x) for x in log.read_text().split()]
    assert sorted(calls) == list(
        range(40)
    )  # each index exactly once, 3 epochs x 2 ranks
    assert results[0]["collated"] == ["tuple"]


def test_from_dataset_that_cannot_pickle_says_what_to_change(tmp_path):
    from shardcache import ConfigError, DistributedCachedDataset

    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(
        ConfigError, match="cannot be pickled.*lazily inside __getitem__"
    ):
        DistributedCachedDataset.from_dataset(
            HandleDataset(str(tmp_path / "f")), name="h"
        )
    os.remove(tmp_path / "f")

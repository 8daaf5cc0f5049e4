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
from packed_files import hdf5_bytes, parquet_bytes, tar_bytes, write_npy

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


class RaisingDataset:
    """A user's Dataset whose __getitem__ raises for some indices."""

    def __init__(self, count: int, bad: tuple[int, ...]):
        self.count, self.bad = count, bad

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        if i in self.bad:
            raise ValueError(f"boom at {i}")
        return np.full(2, i, dtype=np.int32)


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
    if not isinstance(sample, dict):  # .npy: a row of 3 int32
        return int(sample[0]) // 3, int(sample[2])
    if "y" in sample:  # HDF5: {"x": row whose first value is its index, "y"}
        return int(sample["y"]), int(sample["x"][0])
    if "cls" in sample:  # tar: {"bin", "cls"}
        return int(bytes(sample["cls"].numpy())), int(sample["bin"][0])
    return int(sample["id"]), float(sample["x"])  # parquet row


def _read(ds, refresh_after):
    import torch.distributed as dist
    from torch.utils.data import BatchSampler

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
    return {
        "epochs": epochs,
        "collated": [type(collated).__name__],
        "changed": changed if refresh_after is not None else [],
        "stats": ds.stats(),
    }


def read_rank(rank, world, port, redis_url, namespace, make, refresh_after=None):
    """One rank reading the dataset ``make`` builds (or each of a list of
    them, one after the other: one process group for all) for EPOCHS."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results = []
        for one in make if isinstance(make, list) else [make]:
            ds = one(redis_url=redis_url, namespace=namespace, seed=5)
            results.append(_read(ds, refresh_after))
            ds.close()
        return results if isinstance(make, list) else results[0]
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


def _parquet_bytes_needed(data, columns=("id", "x")):
    """The footer (with its length and magic) and the chosen columns' chunks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    total = int.from_bytes(data[-8:-4], "little") + 8
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        total += sum(
            group.column(c).total_compressed_size
            for c in range(group.num_columns)
            if group.column(c).path_in_schema in columns
        )
    return total


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
    # Each shard is read once, by the listing (a tar has no index), which
    # keeps each unit's bytes for its build, on whichever node builds it.
    # Over 3 epochs and 2 ranks on 2 nodes, no more: every byte once.
    assert dict(s3.gets) == {f"/{k}": 1 for k in shards}
    assert s3.total_get_bytes == sum(len(v) for v in shards.values())
    # Epochs 2 and 3 are hits, then each rank's final collated batch of 4.
    assert sum(r["stats"]["hits"] for r in results) == 2 * 36 + 2 * 4

    # Rewrite one shard (same samples, new payload byte): only its units are read.
    changed = f"{bucket}/wds/train-1.tar"
    s3fs_client.pipe({changed: tar_bytes(12, start=12, payload=99)})
    s3.reset_counts()
    results = _run(redis_url, namespace, make, refresh_after=1)
    # A new job revalidates the listing when it starts, so it reads the
    # rewritten shard from its first epoch; its refresh() finds nothing new.
    assert results[0]["changed"] == []
    # The listing re-read only this shard, once; its units were built from it.
    assert dict(s3.gets) == {f"/{changed}": 1}
    assert s3.total_get_bytes == len(shards[changed])


def test_hdf5_on_s3_reads_each_byte_once_per_cluster_at_512_samples(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    # One chunk per row: the layout that read 7.45x the file through h5py's
    # reads over a block cache; gzip chunks decode through HDF5's pipeline.
    files = {
        f"{bucket}/h 5/rows ü.h5": hdf5_bytes(1024, "rows"),
        f"{bucket}/h 5/gzip %41.h5": hdf5_bytes(1024, "gzip"),
    }
    s3fs_client.pipe(files)
    options = s3.storage_options()

    def make(**kw):
        from shardcache import DistributedCachedDataset

        return DistributedCachedDataset(
            f"s3://{bucket}/h 5/*.h5", storage_options=options, chunk_samples=512, **kw
        )

    s3.reset_counts()
    results = _run(redis_url, namespace, make)
    # Files in name order (gzip first); x[:, 0] and y are each row's index.
    _check_each_sample_once_per_epoch(
        results, sorted([(i, i) for i in range(1024)] * 2)
    )
    # The listing's metadata reads and each unit's chunks, over 3 epochs
    # and 2 ranks on 2 nodes: each byte once (metadata a build never needs
    # is the rest).
    size = sum(len(v) for v in files.values())
    assert s3.total_get_bytes <= 1.05 * size


def _read_once(ranges, size):
    """Whether sorted ``(offset, length)`` reads cover ``[0, size)`` exactly once."""
    at = 0
    for offset, length in ranges:
        if offset != at:
            return False
        at += length
    return at == size


def test_local_tar_and_npy_read_each_byte_once_through_a_counting_filesystem(
    ray_cluster, redis_url, namespace, tmp_path
):
    import counting_fs
    from counting_fs import LogPath, reads

    # Every process that unpickles these options (ranks, the stores they
    # start, their listing and build tasks, on both nodes) reads plain paths
    # through the counting filesystem (sent by value: workers cannot import
    # the tests directory).
    ray.cloudpickle.register_pickle_by_value(counting_fs)
    data = tmp_path / "data"
    data.mkdir()
    for k in range(2):
        (data / f"s-{k}.tar").write_bytes(tar_bytes(12, start=12 * k))
    write_npy(data / "rows.npy", 30)
    log = tmp_path / "reads.log"
    log.touch()
    options = {"log_path": LogPath(log)}

    def make(url, name, chunk_samples):
        def build(**kw):
            from shardcache import DistributedCachedDataset

            return DistributedCachedDataset(
                url,
                storage_options=options,
                chunk_samples=chunk_samples,
                name=name,
                **kw,
            )

        return build

    # Both datasets in one run of the 2 ranks, one after the other.
    makes = [make(f"{data}/*.tar", "tar", 6), make(f"{data}/rows.npy", "npy", 8)]
    tar, npy = zip(*_run(redis_url, namespace, makes), strict=True)
    _check_each_sample_once_per_epoch(tar, [(i, i) for i in range(24)])
    _check_each_sample_once_per_epoch(npy, [(i, 3 * i + 2) for i in range(30)])
    opens, ranges = reads(str(log))
    files = [*(str(data / f"s-{k}.tar") for k in range(2)), str(data / "rows.npy")]
    assert sorted(ranges) == sorted(files)  # the ranks read through the stores
    for path in files:
        assert _read_once(ranges[path], os.path.getsize(path)), ranges[path]
    # A shard is opened once, by the listing; the .npy for its header's two
    # reads, then once per unit (4 units of 8 rows).
    assert opens == {files[0]: 1, files[1]: 1, files[2]: 2 + 4}


def test_a_tar_sample_missing_a_member_is_named_alone(
    ray_cluster, redis_url, namespace, tmp_path
):
    # The build fails that sample alone, as the project's own error naming the
    # member set, not the chunk as a BackendError carrying a Ray traceback.
    from shardcache import DistributedCachedDataset
    from shardcache.errors import PreprocessError

    (tmp_path / "s-0.tar").write_bytes(tar_bytes(10, missing="000005.cls"))
    ds = DistributedCachedDataset(
        f"{tmp_path}/s-0.tar", redis_url=redis_url, namespace=namespace,
        rank=0, world_size=1, chunk_samples=10,
    )  # fmt: skip
    with pytest.raises(PreprocessError, match=r"000005.*\['bin'\].*'cls'") as err:
        ds[5]
    assert "ray::" not in str(err.value) and "on_error='skip'" in str(err.value)
    assert [bytes(ds[i]["cls"].numpy()).decode() for i in (4, 6)] == ["4", "6"]
    ds.close()


def test_parquet_on_s3_rows_read_once_with_footer_read_once(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    files = {
        f"{bucket}/pq/a.parquet": parquet_bytes(30, row_group=10),
        f"{bucket}/pq/b.parquet": parquet_bytes(30, row_group=10, start=30),
    }
    s3fs_client.pipe(files)
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
    # Per file: the footer's length and the footer (listing), then one ranged
    # read per row group of the chosen columns: each of those bytes once.
    assert dict(s3.gets) == {f"/{bucket}/pq/a.parquet": 5, f"/{bucket}/pq/b.parquet": 5}
    assert s3.total_get_bytes == sum(_parquet_bytes_needed(v) for v in files.values())
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


def test_from_dataset_an_item_that_raises_fails_alone_and_is_named(
    ray_cluster, redis_url, namespace
):
    from shardcache import DistributedCachedDataset, PreprocessError

    def make(name: str, on_error: str) -> DistributedCachedDataset:
        return DistributedCachedDataset.from_dataset(
            RaisingDataset(10, bad=(2, 7)), name=name, chunk_samples=10,
            on_error=on_error, shuffle=False, rank=0, world_size=1,
            redis_url=redis_url, namespace=namespace,
        )  # fmt: skip

    strict = make("raising", "raise")
    assert [int(strict[i][0]) for i in (0, 1, 3, 9)] == [0, 1, 3, 9]
    with pytest.raises(PreprocessError, match=r"sample 7 .*boom at 7"):
        strict[7]
    strict.close()
    skipping = make("raising-skip", "skip")
    skipping.set_epoch(0)
    got = [int(x[0]) for batch in skipping.loader(5) for x in batch]
    assert len(got) == 10 and set(got) == set(range(10)) - {2, 7}
    assert skipping.stats()["skipped"] == 2
    skipping.close()


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

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


def _source(s3, bucket, redis_url, namespace) -> dict:
    """The dataset arguments both front doors take here."""
    return {
        "urls": f"s3://{bucket}/d/",
        "storage_options": s3.storage_options(),
        "redis_url": redis_url,
        "namespace": namespace,
        "chunk_samples": CHUNK,
        "name": "rd",
    }


def _read(s3, bucket, redis_url, namespace, **kw):
    from shardcache import ray_data

    kw.setdefault("job", f"j{uuid.uuid4().hex[:8]}")
    source = _source(s3, bucket, redis_url, namespace)
    return ray_data.read(**source, num_cpus=0.25, **kw)


def _samples(batches) -> list[bytes]:
    return [bytes(np.asarray(row)) for b in batches for row in b["data"]]


def test_ray_data_read_rejects_rank_splitting_arguments():
    from shardcache import ray_data

    with pytest.raises(ConfigError, match="does not take shuffle, world_size"):
        ray_data.read("s3://b/d/", shuffle=True, world_size=2)


def _plan(on_error: str = "raise") -> object:
    from shardcache.config import ClientConfig
    from shardcache.ray_data import _ReadPlan

    return _ReadPlan(
        "ds", "job", "digest", ClientConfig(), None, (("c0", "v", 30),), (3,),
        on_error, "s3://b/d/", "fp", 3, 30,
    )  # fmt: skip


def test_ray_data_chunk_becomes_one_block_with_stacked_ragged_and_target_columns():
    from shardcache.chunks import Chunk
    from shardcache.ray_data import _to_block

    chunk = Chunk(
        {
            "x": np.arange(6, dtype=np.uint8).reshape(3, 2),
            "y/data": np.arange(6, dtype=np.int64),
            "y/offsets": np.array([0, 1, 3, 6]),
            "y/shapes": np.array([[1], [2], [3]]),
            "__failed__": np.zeros(3, dtype=bool),
            "__target__": np.array([7, 8, 9]),
        }
    )
    block = _to_block(chunk, None).to_pydict()
    assert [list(v) for v in block["x"]] == [[0, 1], [2, 3], [4, 5]]
    assert [list(v) for v in block["y"]] == [[0], [1, 2], [3, 4, 5]]
    assert block["target"] == [7, 8, 9]
    rows = _to_block(chunk, np.array([2])).to_pydict()
    assert [list(v) for v in rows["y"]] == [[3, 4, 5]] and rows["target"] == [9]


def test_ray_data_failed_row_raises_its_error_or_is_left_out_with_skip():
    import json

    from shardcache.chunks import Chunk
    from shardcache.errors import PreprocessError
    from shardcache.ray_data import _good_rows

    chunk = Chunk(
        {
            "_": np.zeros((3, 2), dtype=np.uint8),
            "__failed__": np.array([False, True, False]),
            "__errors__": np.frombuffer(
                json.dumps({"1": ["PreprocessError", "bad jpeg"]}).encode(), np.uint8
            ),
        }
    )
    with pytest.raises(PreprocessError, match="chunk 0 row 1 .*bad jpeg"):
        _good_rows(chunk, _plan(), 0)
    assert _good_rows(chunk, _plan("skip"), 0).tolist() == [0, 2]


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
    # The same through a DistributedCachedDataset.
    from shardcache import DistributedCachedDataset, ray_data

    sdk = DistributedCachedDataset(**_source(s3, bucket, redis_url, namespace))
    assert ray_data.from_cached(sdk, num_cpus=0.25).count() == COUNT
    assert s3.total_gets == 1


def ray_data_redis(url: str):
    import redis as redis_py

    return redis_py.Redis.from_url(url, decode_responses=True)


def _train_loop(config: dict) -> None:
    """A Ray Train rank: the sample ids it got in each epoch, to a file."""
    import json
    from pathlib import Path

    import ray.train

    shard = ray.train.get_dataset_shard("train")
    epochs = []
    for _epoch in range(config["epochs"]):
        seen: list[list[int]] = []
        for batch in shard.iter_torch_batches(batch_size=4):
            seen += batch["data"].tolist()
        epochs.append(seen)
    rank = ray.train.get_context().get_world_rank()
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(epochs))


def _fit(dataset, out, epochs: int) -> list[list[list[int]]]:
    """TorchTrainer, 2 workers, over ``dataset``; every epoch's samples, all ranks."""
    import json

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out.mkdir()
    result = TorchTrainer(
        _train_loop,
        train_loop_config={"epochs": epochs, "out": str(out)},
        datasets={"train": dataset},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(out / "runs")),
    ).fit()
    assert result.error is None
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return [ranks[0][e] + ranks[1][e] for e in range(epochs)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_data_torch_trainer_reads_each_object_once_over_epochs_and_jobs(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, tmp_path
):
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    count = 40
    payload = _objects(s3fs_client, bucket, count=count)
    s3.reset_counts()
    epochs = _fit(_read(s3, bucket, redis_url, namespace), tmp_path / "a", 3)
    for seen in epochs:  # every sample once per epoch, over both workers
        assert sorted(row[0] for row in seen) == list(range(count))
    assert s3.total_gets == count  # 3 epochs: each object read once

    # A second job after ten objects were rewritten: those ten are read and
    # served new, the other thirty come from the cache (no GET). One job
    # checks both: each TorchTrainer.fit costs ~60 s of Ray Train start-up.
    _objects(s3fs_client, bucket, count=10, fill=100)
    s3.reset_counts()
    epochs = _fit(_read(s3, bucket, redis_url, namespace), tmp_path / "b", 1)
    new = [(i + 100) if i < 10 else i for i in range(count)]
    assert sorted(row[0] for row in epochs[0]) == sorted(new)
    assert s3.total_gets == 10
    assert len(payload) == count

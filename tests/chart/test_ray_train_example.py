"""The chart's Ray Train example (helm/shardcache/examples/ray_train.py), run for real.

Its ``main()`` trains with a TorchTrainer of 2 ranks on the 2-node loopback Ray
cluster over objects in the local S3 emulator, as the example RayJob runs it on
the cache's RayCluster.
"""

from __future__ import annotations

import json
from types import ModuleType

import pytest

COUNT = 20  # objects
SIZE = 64  # bytes per object


def test_ray_train_example_parse_args_rejects_zero_workers(ray_train_example):
    example = ray_train_example
    with pytest.raises(SystemExit):
        example.parse_args(["s3://b/d/", "--workers", "0"])
    args = example.parse_args(["s3://b/d/", "--use-gpu", "--storage-options", "{}"])
    assert args.use_gpu and args.workers == 2 and args.storage_options == {}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_train_example_main_trains_two_ranks_over_the_cache(
    ray_cluster,
    s3,
    s3fs_client,
    bucket,
    redis_url,
    namespace,
    tmp_path,
    ray_train_example: ModuleType,
):
    example = ray_train_example
    s3fs_client.pipe(
        {f"{bucket}/d/{i:03d}.bin": bytes([i]) * SIZE for i in range(COUNT)}
    )
    s3.reset_counts()
    summaries = tmp_path / "summaries"
    summaries.mkdir()
    status = example.main(
        [
            f"s3://{bucket}/d/",
            "--workers=2",
            "--epochs=2",
            "--batch-size=4",
            "--cpus-per-worker=0.5",
            f"--storage-options={json.dumps(s3.storage_options())}",
            f"--redis-url={redis_url}",
            f"--namespace={namespace}",
            f"--storage-path={tmp_path / 'runs'}",
            f"--summary-dir={summaries}",
        ]
    )
    assert status == 0
    ranks = [json.loads((summaries / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 for r in ranks)
    for epoch in (0, 1):
        per_rank = [r["epochs"][epoch] for r in ranks]
        assert [p["samples"] for p in per_rank] == [COUNT // 2, COUNT // 2]
        assert sum(p["bytes"] for p in per_rank) == COUNT * SIZE
    assert s3.total_gets == COUNT  # 2 epochs, 2 ranks: each object read once
    for r in ranks:  # epoch 0 misses, epoch 1 hits
        assert r["stats"]["hits"] + r["stats"]["misses"] == COUNT
        assert r["stats"]["hits"] >= COUNT // 2

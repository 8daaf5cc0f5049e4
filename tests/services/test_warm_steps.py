"""Warm the first K steps (CLI and ds.warm) on the real cluster, Redis and S3 emulator:
afterwards each rank's first K steps make no GET and no cold build; the rest does."""

from __future__ import annotations

import sys

import pytest
import ray
import ray.cloudpickle
from typer.testing import CliRunner

from shardcache import DistributedCachedDataset
from shardcache_server.cli import app

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow

OBJECTS, CHUNK, STEPS, BATCH = 80, 4, 2, 2  # 20 chunks, 10 per rank at 2 ranks


def _data(s3fs_client, bucket):
    # Object i holds byte i, so a sample's first element names it.
    s3fs_client.pipe(
        {f"{bucket}/k/{i:03d}.bin": bytes([i]) * 16 for i in range(OBJECTS)}
    )
    return f"s3://{bucket}/k/"


@ray.remote(num_cpus=0)
class Rank:
    """A rank that reads its epoch in two parts, prefetch off (so a step reads
    exactly its own chunks)."""

    def __init__(self, cfg, rank, world):
        self.ds = DistributedCachedDataset(
            cfg["url"],
            storage_options=cfg["storage_options"],
            redis_url=cfg["redis_url"],
            namespace=cfg["namespace"],
            rank=rank,
            world_size=world,
            seed=cfg["seed"],
            chunk_samples=CHUNK,
            prefetch_batches=0,
        )
        self.ds.set_epoch(cfg["epoch"])
        self.batches = iter(self.ds.loader(BATCH))

    def steps(self, k):
        ids = [int(i) for _ in range(k) for i in next(self.batches)[:, 0]]
        stats = self.ds.stats()
        return {
            "ids": ids,
            "served": stats["served"],
            "misses": stats["misses"],
            "node": ray.get_runtime_context().get_node_id(),
        }

    def rest(self):
        return [int(i) for b in self.batches for i in b[:, 0]]


@pytest.mark.timeout(300)  # two Ray actor processes on 2 shared cores
def test_cli_warm_steps_makes_every_ranks_first_steps_local_and_no_more(
    ray_cluster, node_ids, s3, s3fs_client, bucket, redis_url, namespace
):
    url = _data(s3fs_client, bucket)
    cfg = {
        "url": url,
        "storage_options": s3.storage_options(),
        "redis_url": redis_url,
        "namespace": namespace,
        "seed": 5,
        "epoch": 1,
    }
    s3.reset_counts()
    res = CliRunner().invoke(
        app,
        [
            "warm",
            url,
            "--chunk-samples",
            str(CHUNK),
            "--world-size",
            "2",
            "--steps",
            str(STEPS),
            "--batch-size",
            str(BATCH),
            "--seed",
            "5",
            "--epoch",
            "1",
            "--endpoint-url",
            s3.endpoint_url,
            "-o",
            "key=testing",
            "-o",
            "secret=testing",
            "--redis-url",
            redis_url,
            "--namespace",
            namespace,
        ],
    )
    assert res.exit_code == 0, res.output
    assert f"first {STEPS} steps of 2 ranks" in res.output
    warmed = s3.total_gets
    # Each rank's first 4 samples live in at most 4 of its 10 chunks.
    assert 0 < warmed <= 2 * STEPS * BATCH * CHUNK
    # Default placement: sorted alive nodes, contiguous blocks of ranks.
    label = {n: f"node{i}" for i, n in enumerate(node_ids)}
    order = sorted(node_ids)
    ranks = [
        Rank.options(resources={label[order[r]]: 0.01}).remote(cfg, r, 2)
        for r in range(2)
    ]
    s3.reset_counts()
    first = ray.get([r.steps.remote(STEPS) for r in ranks], timeout=120)
    assert s3.total_gets == 0  # no remote read in the first K steps
    for r, out in enumerate(first):
        assert out["node"] == order[r]
        assert len(out["ids"]) == STEPS * BATCH
        assert out["misses"] == 0  # no cold build
        # Every sample came from the rank's own node store, none from a peer.
        assert out["served"]["local"] == STEPS * BATCH
        assert out["served"]["peer"] == out["served"]["source"] == 0
    rest = ray.get([r.rest.remote() for r in ranks], timeout=120)
    # The rest streams in behind: each object not warmed is read once now.
    assert s3.total_gets == OBJECTS - warmed
    seen = [i for out in first for i in out["ids"]] + [i for ids in rest for i in ids]
    assert sorted(seen) == list(range(OBJECTS))


def test_dataset_warm_steps_holds_this_ranks_next_batches(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    url = _data(s3fs_client, bucket)
    ds = DistributedCachedDataset(
        url,
        storage_options=s3.storage_options(),
        redis_url=redis_url,
        namespace=namespace,
        chunk_samples=CHUNK,
        prefetch_batches=0,
        seed=2,
    )
    ds.set_epoch(3)
    s3.reset_counts()
    summary = ds.warm(steps=STEPS, batch_size=3, progress=False)
    assert summary["samples"] == STEPS * 3
    assert s3.total_gets == summary["chunks"] * CHUNK < OBJECTS
    s3.reset_counts()
    batches = iter(ds.loader(3))
    for _ in range(STEPS):
        next(batches)
    stats = ds.stats()
    assert s3.total_gets == 0 and stats["misses"] == 0
    assert stats["served"]["local"] == STEPS * 3
    rest = sum(len(b) for b in batches)
    assert rest == OBJECTS - STEPS * 3 and s3.total_gets > 0
    ds.close()

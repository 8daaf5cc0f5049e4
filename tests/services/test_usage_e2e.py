"""Issue 17 end to end: torchrun-style gloo ranks through DistributedCachedDataset,
then the dashboard, /metrics and `shardcache stats` on the same Redis.

Skipped until the rank reports what it delivers through
``shardcache.usage.UsageReporter`` (exposed as
``DistributedCachedDataset.usage_reporter``); the views themselves are tested
against the same reporter driven directly in test_dashboard.py.
"""

from __future__ import annotations

import socket
import time

import pytest
from starlette.testclient import TestClient

from shardcache import DistributedCachedDataset
from shardcache_server.dashboard import create_app

WIRED = hasattr(DistributedCachedDataset, "usage_reporter")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not WIRED, reason="waiting for the rank wiring of UsageReporter"
    ),
]

OBJECTS = 1000
EPOCHS = 3
BUCKET_S = 10  # shardcache.index.SERIES_BUCKET_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _next_bucket() -> None:
    """Sleep to the next 10 s bucket so each phase lands in buckets of its own."""
    time.sleep(BUCKET_S - time.time() % BUCKET_S + 0.2)


def _rank(rank, world, port, address, cfg, out):
    import ray
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        ds = DistributedCachedDataset(
            cfg["url"],
            storage_options=cfg["storage_options"],
            redis_url=cfg["redis_url"],
            namespace=cfg["namespace"],
            name="images",
            job="e2e",
            seed=5,
        )
        loader = DataLoader(ds, batch_size=50, sampler=ds.sampler, collate_fn=list)
        for epoch in range(cfg["epochs"]):
            if epoch in cfg["invalidate_before"]:
                dist.barrier()
                if rank == 0:
                    _next_bucket()
                    ds.invalidate()
                dist.barrier()
            elif cfg["bucket_per_epoch"]:  # the invalidate above began a bucket
                dist.barrier()
                if rank == 0:
                    _next_bucket()
                dist.barrier()
            ds.set_epoch(epoch)
            for _batch in loader:
                dist.all_reduce(torch.ones(1))
        ds.close()  # flushes this rank's counts
        dist.barrier()  # every rank has flushed: the cluster totals are complete
        out.put(ds.stats())
    finally:
        dist.destroy_process_group()


def _run_job(ray_cluster, s3, redis_url, namespace, bucket, **cfg) -> list[dict]:
    import torch.multiprocessing as mp

    cfg = {
        "url": f"s3://{bucket}/d/",
        "storage_options": s3.storage_options(),
        "redis_url": redis_url,
        "namespace": namespace,
        "epochs": EPOCHS,
        "invalidate_before": (),
        "bucket_per_epoch": False,
        **cfg,
    }
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, 2, port, ray_cluster.address, cfg, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    stats = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return sorted(stats, key=lambda s: s["rank"])


@pytest.fixture
def images(s3fs_client, bucket):
    s3fs_client.pipe(
        {f"{bucket}/d/{i:04d}.bin": i.to_bytes(4, "big") * 16 for i in range(OBJECTS)}
    )
    return bucket


@pytest.mark.timeout(900)
def test_two_rank_job_shows_the_same_hit_rate_everywhere(
    ray_cluster, s3, images, redis_url, namespace, tmp_path
):
    from prometheus_client.parser import text_string_to_metric_families
    from typer.testing import CliRunner

    from shardcache_server.cli import app

    stats = _run_job(ray_cluster, s3, redis_url, namespace, images)
    # The ranks' own counters: epochs 2 and 3 all hits.
    assert sum(s["hits"] for s in stats) == 2 * OBJECTS
    assert sum(s["misses"] for s in stats) == OBJECTS
    client = TestClient(create_app(redis_url, namespace))
    (ds,) = client.get("/api/overview").json()["datasets"]
    assert ds["hit_rate"] == pytest.approx(2 / 3, abs=0.01)
    assert ds["gets_saved"] == 2 * OBJECTS
    assert ds["samples"] == sum(s["hits"] + s["misses"] for s in stats)
    assert stats[-1]["cluster"]["hit_rate"] == pytest.approx(ds["hit_rate"])
    text = client.get("/metrics").text
    values = {
        (s.name, s.labels.get("dataset")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert values[("shardcache_hit_rate", "images")] == pytest.approx(2 / 3, abs=0.01)
    assert values[("shardcache_gets_saved_total", "images")] == 2 * OBJECTS
    res = CliRunner().invoke(
        app, ["stats", "images", "--redis-url", redis_url, "--namespace", namespace]
    )
    assert res.exit_code == 0 and "66.7%" in res.output.split("Store traffic")[0]
    ranks = client.get("/api/ranks/images").json()["ranks"]
    assert {r["rank"] for r in ranks} == {"0", "1"}
    assert all(r["blocked_s"] > 0 and len(r["blocked_s_by_epoch"]) == 3 for r in ranks)


@pytest.mark.timeout(900)
def test_rereading_after_invalidate_shows_the_dip(
    ray_cluster, s3, images, redis_url, namespace
):
    _run_job(
        ray_cluster,
        s3,
        redis_url,
        namespace,
        images,
        epochs=4,
        invalidate_before=(2,),
        bucket_per_epoch=True,
    )
    client = TestClient(create_app(redis_url, namespace))
    points = client.get("/api/series/images?job=e2e").json()["points"]
    rates = [round(p["hit_rate"], 2) for p in points]
    assert rates == [0.0, 1.0, 0.0, 1.0]

"""A bounded soak: 8 rank processes on 2 nodes, several epochs, invalidations
mid-epoch and in between."""

from __future__ import annotations

import socket
import time

import pytest
import ray

from shardcache.index import RedisIndex
from shardcache_server.cluster import alive_nodes, store_for_node
from shardcache_server.verify import check_agreement

from helpers import SoakRank

pytestmark = pytest.mark.slow
EPOCHS, OBJECTS, RANKS = 4, 96, 8


def test_soak_index_and_stores_agree_after_invalidations(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    s3fs_client.pipe({f"{bucket}/d/{i:03d}": bytes([i]) * 64 for i in range(OBJECTS)})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = {
        "url": f"s3://{bucket}/d/",
        "storage_options": s3.storage_options(),
        "redis_url": redis_url,
        "namespace": namespace,
        "epochs": EPOCHS,
        "invalidate_during": [1],  # mid-epoch, from outside the job
        "invalidate_before": [3],  # between epochs, by rank 0
        "hold_nothing": list(range(0, RANKS, 2)),
    }
    s3.reset_counts()
    ranks = [
        SoakRank.options(resources={f"node{r % 2}": 0.01}).remote()
        for r in range(RANKS)
    ]
    results = ray.get(
        [a.run.remote(r, RANKS, port, cfg) for r, a in enumerate(ranks)], timeout=600
    )
    for a in ranks:
        ray.kill(a)
    assert all(r["bad"] == 0 for r in results)  # every sample equals its source bytes
    assert sum(r["read"] for r in results) == OBJECTS * EPOCHS
    # Each epoch on one generation, on every rank: the one invalidated mid-epoch
    # 1 finishes on its snapshot (served from the stores' retired values).
    assert all(r["generations"] == [[1], [1], [2], [3]] for r in results)
    assert s3.total_gets == OBJECTS * 3  # one read per object per generation
    index = RedisIndex.from_url(redis_url, namespace)
    handles = {n: store_for_node(namespace, n) for n in alive_nodes()}
    handles = {n: h for n, h in handles.items() if h is not None}
    deadline = time.monotonic() + 20
    problems = check_agreement(index, handles, "soak")
    while problems and time.monotonic() < deadline:  # index writes are asynchronous
        time.sleep(0.2)
        problems = check_agreement(index, handles, "soak")
    assert problems == []
    infos = ray.get([h.info.remote() for h in handles.values()])
    held = sum(i["bytes_by_dataset"].get("soak", 0) for i in infos)
    # every sample once, plus each chunk's row flags (1 B a sample) and errors
    assert OBJECTS * 64 < held <= OBJECTS * 66
    # Memory is back within budget, counting the retired generations that
    # ranks mid-epoch could still have been reading.
    assert all(i["used_bytes"] + i["retired_bytes"] <= i["budget_bytes"] for i in infos)
    from typer.testing import CliRunner

    from shardcache_server.cli import app

    res = CliRunner().invoke(
        app, ["verify", "soak", "--redis-url", redis_url, "--namespace", namespace]
    )
    assert res.exit_code == 0 and "0 mismatch(es) across 2 store(s)" in res.output, (
        res.output
    )

"""Crashes with SIGKILL and what the next run finds: a store killed with its
chunks on the disk tier reloads them (zero GETs), and a rank killed mid-epoch
leaves nothing that a restarted job has to clean by hand."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray
from torch.utils.data import DataLoader

from shardcache import DistributedCachedDataset
from shardcache_server.cluster import ensure_stores, store_for_node
from shardcache_server.settings import ServiceSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
JOB = Path(__file__).with_name("crash_job.py")
WAIT_S = 120  # generous bound for anything the tests poll for


def _epoch(ds, loader, epoch):
    ds.set_epoch(epoch)
    got = {}
    for b, batch in enumerate(loader):
        order = ds.sampler.order()[b * 4 : (b + 1) * 4]
        got.update(
            {int(i): bytes(t.numpy()) for i, t in zip(order, batch, strict=True)}
        )
    return got


def _poll(check, what):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_store_killed_with_sigkill_reloads_its_disk_tier_with_zero_gets(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, monkeypatch, tmp_path
):
    # The rank keeps nothing between batches: every batch asks the store, so
    # after the restart every chunk comes from the new store process.
    monkeypatch.setenv("SHARDCACHE_HOLD_BYTES", "0")
    monkeypatch.setenv("SHARDCACHE_DISK_DIR", str(tmp_path / "disk"))
    payload = {i: bytes([i]) * 64 for i in range(40)}
    s3fs_client.pipe({f"{bucket}/d/{i:02d}": v for i, v in payload.items()})
    settings = ServiceSettings(
        redis_url=redis_url, namespace=namespace, disk_dir=str(tmp_path / "disk")
    )
    ensure_stores(settings)
    ds = DistributedCachedDataset(
        f"s3://{bucket}/d/",
        storage_options=s3.storage_options(),
        redis_url=redis_url,
        namespace=namespace,
        chunk_samples=4,
    )
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, collate_fn=list)
    assert _epoch(ds, loader, 0) == payload
    assert s3.total_gets == 40
    store = store_for_node(namespace, ray.get_runtime_context().get_node_id())
    written = ray.get(store.flush_disk.remote())
    assert written["disk_chunks"] == 10
    before = ray.get(store.info.remote())
    os.kill(
        before["pid"], signal.SIGKILL
    )  # the store's process, as the OOM killer would

    def restarted():
        try:
            return (
                ray.get(store.ping.remote(), timeout=5)
                != before["node_id"] + "/" + (before["incarnation"])
            )
        except ray.exceptions.RayError:
            return False  # dead or restarting

    _poll(restarted, "Ray to restart the store")
    s3.reset_counts()
    assert _epoch(ds, loader, 1) == payload  # the same bytes
    assert s3.total_gets == 0  # all from the disk tier, none from the source
    after = ray.get(store.info.remote())
    assert after["pid"] != before["pid"] and after["entries"] == 10
    ds.close()


def test_rank_killed_mid_epoch_job_restarts_with_nothing_cleaned_by_hand(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    s3fs_client.pipe({f"{bucket}/crash/{i:02d}": bytes([i]) * 64 for i in range(48)})
    env = {
        **os.environ,
        "SHARDCACHE_NAMESPACE": namespace,
        "RAY_ADDRESS": ray_cluster.address,  # never another cluster on this host
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    options = json.dumps(s3.storage_options())
    args = [ray_cluster.address, redis_url, options, bucket]
    crashed = subprocess.Popen(
        [sys.executable, str(JOB), "crash", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = crashed.stdout.readline() if crashed.stdout else ""
        assert line.startswith("MID"), crashed.stderr.read() if crashed.stderr else ""
        _, job, *workers = line.split()
        assert workers  # the DataLoader workers (and the resource tracker)
        crashed.send_signal(signal.SIGKILL)  # mid-epoch, DataLoader workers busy
        crashed.wait(timeout=WAIT_S)
    finally:
        if crashed.poll() is None:
            crashed.kill()
    gets_before = s3.total_gets
    # Nobody cleans anything. The orphaned DataLoader workers (and the
    # spawn context's resource tracker) notice the dead parent and exit...
    _poll(
        lambda: not any(psutil.pid_exists(int(p)) for p in workers), "workers to exit"
    )

    # ...and Ray marks the dead driver's job finished, which releases every
    # object it had pinned (its borrowed chunk references).
    def job_dead():
        return any(j["JobID"] == job and j["IsDead"] for j in ray._private.state.jobs())

    _poll(job_dead, "Ray to mark the killed job dead")
    restarted = subprocess.run(
        [sys.executable, str(JOB), "full", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S * 2,
    )
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    result = json.loads(restarted.stdout.strip().splitlines()[-1])
    assert result == {"wrong": 0, "read": 96}
    # The killed run had cached every chunk: the restarted job reads none.
    assert s3.total_gets == gets_before == 48


def test_a_build_actor_killed_for_good_is_replaced_by_name(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    # Ray restarts a build actor whose process dies (max_restarts=-1), but
    # not one killed with no_restart: its slot must not fail every build
    # after it until the store restarts.
    from shardcache.errors import ShardCacheError
    from shardcache_server.builder import build_worker_name
    from shardcache_server.store import ray_namespace

    s3fs_client.pipe({f"{bucket}/k/{i:02d}": bytes([i]) * 32 for i in range(8)})
    ensure_stores(
        ServiceSettings(redis_url=redis_url, namespace=namespace, build_workers=1)
    )
    kw = dict(storage_options=s3.storage_options(), redis_url=redis_url,
              namespace=namespace, chunk_samples=4, shuffle=False)  # fmt: skip
    ds = DistributedCachedDataset(f"s3://{bucket}/k/", **kw)
    assert bytes(ds[0].numpy()) == bytes([0]) * 32  # the store and its builder up
    node = ray.get_runtime_context().get_node_id()
    name, ns = build_worker_name(node, 0), ray_namespace(namespace)
    ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)
    failed = 0
    for _ in range(2):
        try:
            assert bytes(ds[7].numpy()) == bytes([7]) * 32
            break
        except ShardCacheError:
            failed += 1
    else:
        raise AssertionError("every build after the kill failed")
    # The build that met the dead actor is tried again on its replacement (a
    # build has no side effects): the rank never sees the death.
    assert failed == 0
    assert ray.get(ray.get_actor(name, namespace=ns).ready.remote(), timeout=60) >= 0

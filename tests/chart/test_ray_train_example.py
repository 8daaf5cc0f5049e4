"""The chart's Ray Train example (helm/shardcache/examples/ray_train.py), run for real.

Its ``main()`` trains with a TorchTrainer of 2 ranks on the 2-node loopback Ray
cluster over objects in the local S3 emulator, as the example RayJob runs it on
the cache's RayCluster.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

CHART = Path(__file__).resolve().parents[2] / "helm" / "shardcache"
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
@pytest.mark.parametrize("path", ["sdk", "ray-data"])
def test_ray_train_example_main_trains_two_ranks_over_the_cache(
    path,
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
            *(["--ray-data"] if path == "ray-data" else []),
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
    if path == "ray-data":
        return  # Ray Data splits the blocks; the cache's numbers are the job's
    for r in ranks:  # epoch 0 misses, epoch 1 hits
        assert r["stats"]["hits"] + r["stats"]["misses"] == COUNT
        assert r["stats"]["hits"] >= COUNT // 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _render_rayjob(values: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The chart's example RayJob and the script its ConfigMap carries."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="rel", namespace="cache")
    docs = [d for text in out.values() if text.strip() for d in _yaml_docs(text)]
    (job,) = [d for d in docs if d.get("kind") == "RayJob"]
    (config,) = [
        d
        for d in docs
        if d["metadata"]["name"].endswith("-ray-train-example")
        and d.get("kind") == "ConfigMap"
    ]
    return job, config["data"]["ray_train.py"]


def _yaml_docs(text: str) -> list[dict[str, Any]]:
    import yaml

    try:
        return [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    except yaml.YAMLError:  # NOTES.txt
        return []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_rendered_rayjob_runs_through_the_ray_jobs_api(
    s3, s3fs_client, bucket, redis_url, tmp_path
):
    """The RayJob's entrypoint and runtimeEnvYAML, unchanged, through a real Jobs API.

    A Ray head with its dashboard (the Jobs API) on loopback stands in for the
    chart's RayCluster; what the pods' env would carry (Redis URL, namespace, S3
    credentials) goes in the runtime env, and working_dir gets the ConfigMap's
    script, as the submitter pod's subPath mount holds it.
    """
    import ray._private.utils as ray_utils
    import yaml
    from ray.cluster_utils import Cluster
    from ray.job_submission import JobStatus, JobSubmissionClient

    s3fs_client.pipe(
        {f"{bucket}/d/{i:03d}.bin": bytes([i]) * SIZE for i in range(COUNT)}
    )
    job, script = _render_rayjob(
        {
            "kuberay": {"enabled": True},
            "ray": {"head": {"jobSubmission": True}},
            "examples": {
                "rayJob": {
                    "enabled": True,
                    "url": f"s3://{bucket}/d/",
                    "workers": 2,
                    "epochs": 2,
                    "batchSize": 4,
                    "cpusPerWorker": 0.5,
                }
            },
            "s3": {"endpointUrl": s3.endpoint_url},
        }
    )
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    working_dir = tmp_path / "working_dir"
    working_dir.mkdir()
    (working_dir / "ray_train.py").write_text(script)
    runtime_env["working_dir"] = str(working_dir)
    runtime_env["env_vars"] = {
        "SHARDCACHE_REDIS_URL": redis_url,
        "SHARDCACHE_NAMESPACE": f"t{uuid.uuid4().hex[:10]}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # `python` is Ray's Python in the image; here, this venv's.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    s3.reset_counts()
    # Starting a cluster repoints address="auto" at it; other tests' clusters
    # get their address back when this one is gone.
    previous_address = ray_utils.read_ray_address()
    dashboard_port = _free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": 100 * 2**20,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard_port,
            # Not the default 52365, which another cluster here may hold.
            "dashboard_agent_listen_port": _free_port(),
        },
    )
    try:
        address = f"http://127.0.0.1:{dashboard_port}"
        deadline = time.monotonic() + 120
        while True:  # the dashboard, then its job agent, come up after the node
            try:
                client = JobSubmissionClient(address)
                job_id = client.submit_job(
                    entrypoint=job["spec"]["entrypoint"], runtime_env=runtime_env
                )
                break
            except (ConnectionError, RuntimeError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        deadline = time.monotonic() + 300
        while (status := client.get_job_status(job_id)) not in {
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.STOPPED,
        }:
            assert time.monotonic() < deadline, client.get_job_logs(job_id)[-3000:]
            time.sleep(2)
        logs = client.get_job_logs(job_id)
        assert status == JobStatus.SUCCEEDED, logs[-3000:]
    finally:
        cluster.shutdown()
        if previous_address:
            ray_utils.write_ray_address(previous_address)
    # Rank 0's lines, behind Ray's "(RayTrainWorker pid=...)" prefix; the job
    # log can hold a worker's line twice.
    lines = [
        json.loads(line[line.index('{"epoch"') :])
        for line in logs.splitlines()
        if '{"epoch"' in line
    ]
    epochs = {e["epoch"]: e for e in lines}
    assert sorted(epochs) == [0, 1], logs[-3000:]
    for e in epochs.values():
        assert e["samples"] == COUNT and e["bytes"] == COUNT * SIZE  # all ranks
    assert s3.total_gets == COUNT  # each object read once, through the cache

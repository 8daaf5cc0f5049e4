"""A cache budget larger than the Ray object store: values spill to local disk
and come back, nothing is re-fetched, and the raylet survives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
JOB = Path(__file__).with_name("spill_job.py")


def test_store_spills_to_local_disk_when_object_store_is_full(
    s3, s3fs_client, bucket, redis_url, tmp_path
):
    count = 40  # 40 x 4 MiB = 160 MiB of values into a 100 MiB object store
    s3fs_client.pipe({f"{bucket}/big/{i:03d}": bytes([i]) * 1024 for i in range(count)})
    env = {
        **os.environ,
        "SHARDCACHE_NAMESPACE": f"t{uuid.uuid4().hex[:10]}",
        "SHARDCACHE_CACHE_BYTES": str(400 * 2**20),  # the budget exceeds the store
        "SHARDCACHE_HOLD_BYTES": "0",  # the rank pins nothing between batches
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    spill = tmp_path / "spill"
    out = subprocess.run(
        [sys.executable, str(JOB), redis_url, s3.endpoint_url, bucket, str(spill)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout.strip().splitlines()[-1])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["wrong"] == 0
    assert result["nodes_alive"]
    assert result["remote_reads"] == count  # epoch 2 restored spilled values
    assert result["hits"] == count
    assert result["spilled_bytes_on_disk"] >= 60 * 2**20
    assert s3.total_gets == count

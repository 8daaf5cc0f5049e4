"""HDF5 and LMDB on a shared file system: the stores open the files, ranks and
their DataLoader workers never do. The ranks run in a mount namespace where
the data directory is an empty tmpfs, so a rank that tried would fail."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from packed_files import write_hdf5, write_lmdb

pytestmark = pytest.mark.slow
RANK = Path(__file__).with_name("packed_rank.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(400)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_ranks_that_cannot_see_the_files_read_hdf5_and_lmdb_through_the_cache(
    ray_cluster, redis_url, namespace, tmp_path
):
    if os.geteuid() != 0:
        pytest.skip("mount namespaces need root")
    data = tmp_path / "data"
    data.mkdir()
    write_hdf5(data / "train.h5", 40)
    write_lmdb(data / "train.lmdb", 24)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    port = _free_port()
    hide = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
    procs = [
        subprocess.Popen(
            [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                hide,
                str(data),
                sys.executable,
                str(RANK),
                str(r),
                "2",
                str(port),
                ray_cluster.address,
                redis_url,
                namespace,
                str(data),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for r in range(2)
    ]
    results = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank hung: {p.communicate()[1][-3000:]}") from None
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert all(r["sees_data"] == [] for r in results)  # the files were not there
    rows = np.arange(160, dtype=np.float32).reshape(40, 4).tolist()
    for epoch in range(2):
        h5 = sorted(s for r in results for s in r["train.h5"][epoch])
        assert h5 == [[i, rows[i]] for i in range(40)]
        values = sorted(s for r in results for s in r["train.lmdb"][epoch])
        assert values == sorted(f"value-{i}" for i in range(24))

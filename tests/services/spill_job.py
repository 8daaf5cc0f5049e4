"""Run by test_spill.py in its own process: a 1-node Ray cluster whose object
store (100 MiB) is smaller than the cache budget and the dataset (160 MiB), with
spilling to a given directory. Prints one JSON line of what it saw."""

from __future__ import annotations

import json
import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only

import numpy as np  # noqa: E402

VALUE_BYTES = 4 * 2**20  # each 1 KiB object preprocesses to 4 MiB
OBJECT_STORE_BYTES = 100 * 2**20


def expand(data: bytes) -> np.ndarray:
    """Deterministic and large: the first byte repeated over 4 MiB."""
    return np.full(VALUE_BYTES, data[0], dtype=np.uint8)


def main(redis_url: str, endpoint: str, bucket: str, spill_dir: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from shardcache import DistributedCachedDataset

    spilling = {"type": "filesystem", "params": {"directory_path": spill_dir}}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": OBJECT_STORE_BYTES,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "_system_config": {"object_spilling_config": json.dumps(spilling)},
        },
    )
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    try:
        ds = DistributedCachedDataset(
            f"s3://{bucket}/big/",
            expand,
            storage_options={"client_kwargs": {"endpoint_url": endpoint}},
            redis_url=redis_url,
            namespace=os.environ["SHARDCACHE_NAMESPACE"],
            shuffle=False,
            # chunks are cut by source bytes; this preprocess expands 1 KiB to
            # 4 MiB, so one object per chunk keeps each Ray object at 4 MiB
            chunk_samples=1,
        )
        wrong = 0
        for epoch in range(2):
            ds.set_epoch(epoch)
            for start in range(0, len(ds), 4):
                batch = ds.__getitems__(list(range(start, min(start + 4, len(ds)))))
                for i, t in enumerate(batch, start):
                    wrong += int(t.numel() != VALUE_BYTES or int(t[-1]) != i)
                del batch
        stats = ds.stats()
        spilled = sum(
            os.path.getsize(os.path.join(root, f))
            for root, _, files in os.walk(spill_dir)
            for f in files
        )
        alive = all(n["Alive"] for n in ray.nodes())
        ds.close()
        print(
            json.dumps(
                {
                    "wrong": wrong,
                    "remote_reads": stats["remote_reads"],
                    "hits": stats["hits"],
                    "spilled_bytes_on_disk": spilled,
                    "nodes_alive": alive,
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])

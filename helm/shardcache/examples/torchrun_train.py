"""torchrun ranks that are not Ray nodes: the script the chart's example PyTorchJob runs.

Each pod of a Kubeflow ``PyTorchJob`` (or any torchrun launch) runs
``--nproc-per-node`` ranks; each rank reads its shard of ``URL`` through the
node-local endpoint of the cache worker on its Kubernetes node: samples are
read-only views of the chunk files that worker wrote once per node in shared
memory. No Ray runs in these pods and they need no route to Redis.

Nothing here names the cache: the chart's pod snippet sets
``SHARDCACHE_ENDPOINT`` (the mounted socket), ``SHARDCACHE_NODE_NAME``
(downward API) and ``SHARDCACHE_NAMESPACE``; torchrun sets RANK and
WORLD_SIZE. ``--allow-remote`` reads from a cache worker on another node
(Arrow Flight, ``SHARDCACHE_REMOTE_URL``) when this node has none.

Usage::

    torchrun --nproc-per-node 2 torchrun_train.py s3://bucket/train/ --epochs 2
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of the example (``--help`` lists it)."""
    parser = argparse.ArgumentParser(
        description="torchrun ranks over a shardcache node-local endpoint."
    )
    parser.add_argument("url", help="dataset URL, e.g. s3://bucket/train/")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument(
        "--storage-options",
        type=json.loads,
        default={},
        help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://minio:9000"}\'',
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="stream from another node's cache worker when this node has none",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Train (here: read) ``--epochs`` epochs; rank 0 prints one JSON line each."""
    import torch
    import torch.distributed as dist

    from shardcache import DistributedCachedDataset

    args = parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ds = DistributedCachedDataset(
        args.url,
        storage_options=args.storage_options,
        allow_remote=args.allow_remote or None,
    )
    summaries = []
    for epoch in range(args.epochs):
        ds.set_epoch(epoch)
        started, samples, nbytes = time.perf_counter(), 0, 0
        for batch in ds.loader(args.batch_size):
            samples += len(batch)
            nbytes += batch.numel() * batch.element_size()
            ...  # forward, backward, step
        elapsed = time.perf_counter() - started
        summary = {
            "epoch": epoch,
            "rank": ds.rank,
            "samples": samples,
            "bytes": nbytes,
            "samples_per_s": samples / elapsed if elapsed else 0.0,
        }
        summaries.append(summary)
        if ds.rank == 0:
            print(json.dumps(summary), flush=True)
    ds.close()
    dist.destroy_process_group()
    return summaries


if __name__ == "__main__":
    main()

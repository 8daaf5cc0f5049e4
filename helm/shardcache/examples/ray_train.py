"""Ray Train on the cache's Ray cluster: the script the chart's example RayJob runs.

Submitted through the Ray Jobs API (a KubeRay ``RayJob``, or ``ray job submit``),
this file runs as the job's driver on the Ray head. ``TorchTrainer`` starts one
Ray actor per rank on the cache worker nodes, and each rank reads its shard of
``URL`` through ``DistributedCachedDataset`` from the store on its own node, as
zero-copy views of that node's object store.

Nothing here names the cache: the chart sets ``SHARDCACHE_REDIS_URL``,
``SHARDCACHE_NAMESPACE`` and the Ray token on every Ray pod, Ray workers inherit
that environment, and ``DistributedCachedDataset`` takes its rank and world size
from the process group that Ray Train sets up. ``--redis-url`` and
``--namespace`` exist for a cluster without that environment (a laptop, a test).

Usage::

    python ray_train.py s3://bucket/train/ --workers 2 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of the example (``--help`` lists it)."""
    parser = argparse.ArgumentParser(
        description="Ray Train TorchTrainer over a shardcache DistributedCachedDataset."
    )
    parser.add_argument("url", help="dataset URL, e.g. s3://bucket/train/")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train ranks")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per rank")
    parser.add_argument(
        "--cpus-per-worker", type=float, default=1.0, help="Ray CPUs per rank"
    )
    parser.add_argument(
        "--storage-options",
        type=json.loads,
        default={},
        help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://minio:9000"}\'',
    )
    parser.add_argument(
        "--redis-url", default=None, help="defaults to SHARDCACHE_REDIS_URL"
    )
    parser.add_argument(
        "--namespace", default=None, help="defaults to SHARDCACHE_NAMESPACE"
    )
    parser.add_argument(
        "--storage-path", default=None, help="Ray Train run directory (RunConfig)"
    )
    parser.add_argument(
        "--summary-dir",
        default=None,
        help="write rank<N>.json per rank here (a path every node can write)",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    return args


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """One Ray Train rank: epochs over this rank's shard, totals all-reduced."""
    import torch
    import torch.distributed as dist
    from ray.train.torch import get_device
    from torch.utils.data import DataLoader

    from shardcache import DistributedCachedDataset

    ds = DistributedCachedDataset(
        config["url"],
        storage_options=config["storage_options"],
        redis_url=config["redis_url"],
        namespace=config["namespace"],
    )
    # collate_fn=list keeps samples of different sizes as they are; with a
    # preprocess that returns tensors of one shape, use the default collate.
    loader = DataLoader(
        ds, batch_size=config["batch_size"], sampler=ds.sampler, collate_fn=list
    )
    device = get_device()  # nccl all-reduces CUDA tensors, gloo CPU ones
    epochs = []
    try:
        for epoch in range(config["epochs"]):
            ds.set_epoch(epoch)
            start = time.perf_counter()
            samples = nbytes = 0
            for batch in loader:
                # The model's forward and backward step goes here.
                samples += len(batch)
                nbytes += sum(t.nbytes for t in batch)  # ~0.1 us per sample
            seconds = time.perf_counter() - start
            totals = torch.tensor([samples, nbytes], dtype=torch.float64, device=device)
            dist.all_reduce(totals)
            epochs.append({"epoch": epoch, "samples": samples, "bytes": nbytes})
            if ds.rank == 0:
                line = {
                    "epoch": epoch,
                    "samples": int(totals[0]),
                    "bytes": int(totals[1]),
                    "rank0_samples_per_s": round(samples / max(seconds, 1e-9), 1),
                }
                print(json.dumps(line), flush=True)
        if config["summary_dir"]:
            summary = {
                "rank": ds.rank,
                "world_size": ds.world_size,
                "epochs": epochs,
                "stats": ds.stats(),
            }
            path = Path(config["summary_dir"], f"rank{ds.rank}.json")
            path.write_text(json.dumps(summary, default=str))
    finally:
        ds.close()


def build_trainer(args: argparse.Namespace) -> Any:
    """The ``TorchTrainer`` for ``args`` (from :func:`parse_args`)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {
        "url": args.url,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "storage_options": args.storage_options,
        "redis_url": args.redis_url,
        "namespace": args.namespace,
        "summary_dir": args.summary_dir,
    }
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=args.workers,
            use_gpu=args.use_gpu,
            resources_per_worker={"CPU": args.cpus_per_worker},
        ),
        run_config=RunConfig(
            name="shardcache-ray-train", storage_path=args.storage_path
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """Run the example; returns the exit status (0 when training succeeded).

    In a Ray job, ``TorchTrainer.fit`` joins the cluster through the
    ``RAY_ADDRESS`` that the job supervisor sets, beside the head's raylet.
    """
    args = parse_args(argv)
    result = build_trainer(args).fit()
    return 0 if result.error is None else 1


if __name__ == "__main__":
    raise SystemExit(main())

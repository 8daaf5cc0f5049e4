"""Ray Train on the cache's Ray cluster: the script the chart's example RayJob runs.

Submitted through the Ray Jobs API (a KubeRay ``RayJob``, or ``ray job submit``),
this file runs as the job's driver on the Ray head. ``TorchTrainer`` starts one
Ray actor per rank on the cache worker nodes, and each rank reads its shard of
``URL`` through ``DistributedCachedDataset`` from the store on its own node, as
zero-copy views of that node's object store.

With ``--ray-data`` the ranks read a Ray Dataset instead: the driver builds
``shardcache.ray_data.read(URL)`` (one block per cached chunk, read on the node
that holds it), ``TorchTrainer(datasets={"train": ...})`` splits it, and each
rank iterates ``ray.train.get_dataset_shard("train")``. Pick it when the input
pipeline is Ray Data's (``map_batches`` after the cache, ``random_shuffle``);
the default path gives exact per-rank shards and elastic resume.

Nothing here names the cache: the chart sets ``SHARDCACHE_REDIS_URL``,
``SHARDCACHE_NAMESPACE`` and the Ray token on every Ray pod, Ray workers inherit
that environment, and ``DistributedCachedDataset`` takes its rank and world size
from the process group that Ray Train sets up. ``--redis-url`` and
``--namespace`` exist for a cluster without that environment (a laptop, a test).

Usage::

    python ray_train.py s3://bucket/train/ --workers 2 --epochs 2
    python ray_train.py s3://bucket/train/ --workers 2 --epochs 2 --ray-data
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
        "--ray-data",
        action="store_true",
        help="read a Ray Dataset over the cache (shardcache.ray_data) instead of "
        "DistributedCachedDataset",
    )
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
    from torch.utils.data import DataLoader

    from shardcache import DistributedCachedDataset

    if config["ray_data"]:
        _train_epochs(config, _ray_data_batches(config), None)
        return
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

    def batches(epoch: int) -> Any:
        ds.set_epoch(epoch)
        return loader

    try:
        _train_epochs(config, batches, ds)
    finally:
        ds.close()


def _ray_data_batches(config: dict[str, Any]) -> Any:
    """This rank's split of the Ray Dataset, one pass per call (one epoch)."""
    import ray.train

    shard = ray.train.get_dataset_shard("train")

    def batches(epoch: int) -> Any:
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"]):
            yield batch["data"]  # (B, ...) tensor, or a list when sizes differ

    return batches


def _train_epochs(config: dict[str, Any], batches: Any, ds: Any) -> None:
    """The epochs of one rank over ``batches(epoch)``; rank 0 prints the totals.
    ``ds``: the DistributedCachedDataset whose stats the summary carries, or None."""
    import ray.train
    import torch
    import torch.distributed as dist
    from ray.train.torch import get_device

    rank = ray.train.get_context().get_world_rank()
    device = get_device()  # nccl all-reduces CUDA tensors, gloo CPU ones
    epochs = []
    for epoch in range(config["epochs"]):
        start = time.perf_counter()
        samples = nbytes = 0
        for batch in batches(epoch):
            # The model's forward and backward step goes here.
            samples += len(batch)
            nbytes += sum(t.nbytes for t in batch)  # ~0.1 us per sample
        seconds = time.perf_counter() - start
        totals = torch.tensor([samples, nbytes], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        epochs.append({"epoch": epoch, "samples": samples, "bytes": nbytes})
        if rank == 0:
            line = {
                "epoch": epoch,
                "samples": int(totals[0]),
                "bytes": int(totals[1]),
                "rank0_samples_per_s": round(samples / max(seconds, 1e-9), 1),
            }
            print(json.dumps(line), flush=True)
    if config["summary_dir"]:
        summary = {
            "rank": rank,
            "world_size": ray.train.get_context().get_world_size(),
            "epochs": epochs,
            "stats": ds.stats() if ds is not None else None,
        }
        Path(config["summary_dir"], f"rank{rank}.json").write_text(
            json.dumps(summary, default=str)
        )


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
        "ray_data": args.ray_data,
    }
    datasets = None
    if args.ray_data:
        from shardcache import ray_data

        # Built on the driver: one listing for the job; Ray Train splits it
        # over the ranks, keeping each block on the node that read it.
        datasets = {
            "train": ray_data.read(
                args.url,
                storage_options=args.storage_options,
                redis_url=args.redis_url,
                namespace=args.namespace,
            )
        }
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        datasets=datasets,
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

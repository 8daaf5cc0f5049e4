"""Ray Train ingest over Ray Data: plain, materialize(), and through the cache.

``TorchTrainer`` with 2 workers on a 2-node loopback cluster runs 3 epochs over
the benchmark's JPEG set in the S3 emulator, three ways:

* ``plain``: ``read_binary_files`` + ``map_batches(decode)``; Ray Data reads
  and decodes every object again in every epoch.
* ``materialize``: the same, ``materialize()``d on the driver before
  ``fit()``: decoded once, held in this job's object store, gone with it.
* ``shardcache``: ``shardcache.ray_data.read(url, preprocess=decode)``.
  Then a second job (a new ``read()``, one epoch): what the next run pays.

Per epoch: samples/s (all samples over the epoch's wall time, first batch of
either worker to last batch of either) and source GETs (counted by the
emulator). One JSON line per system, then a Markdown table.

Usage::

    .venv/bin/python bench/ray_data.py --images 4000 --epochs 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# Ray sockets on loopback (as the tests and bench/endpoint.py): must precede
# `import ray`, or nodes advertise an interface address this run cannot reach.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

IMAGE_PX = 224  # decoded and resized to (3, 224, 224) uint8, as in bench/run.py
SYSTEMS = ("plain", "materialize", "shardcache", "shardcache-2nd-job")


def decode(batch: dict[str, Any]) -> dict[str, Any]:
    """``map_batches`` form of the JPEG decode + resize (bytes column -> data)."""
    import numpy as np

    return {"data": np.stack([decode_one(b) for b in batch["bytes"]])}


def decode_one(data: bytes) -> Any:
    """One JPEG -> CHW uint8 (the same work as bench/ranks.py's decode_resize)."""
    import io

    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        small = img.convert("RGB").resize((IMAGE_PX, IMAGE_PX))
    return np.ascontiguousarray(np.asarray(small, dtype=np.uint8).transpose(2, 0, 1))


def _gets(endpoint: str) -> int:
    """Object GETs counted by the emulator so far (its control API)."""
    with urllib.request.urlopen(f"{endpoint}/_emulator/stats", timeout=10) as resp:
        return int(sum(json.load(resp)["gets"].values()))


def train_loop(config: dict[str, Any]) -> None:
    """One worker: epochs over its split; per epoch its first/last batch times,
    and (rank 0, after a barrier) the GETs so far."""
    import ray.train
    import torch.distributed as dist

    shard = ray.train.get_dataset_shard("train")
    rank = ray.train.get_context().get_world_rank()
    epochs = []
    for _ in range(config["epochs"]):
        dist.barrier()
        start, samples = time.time(), 0
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"]):
            samples += len(batch["data"])  # the training step goes here
        end = time.time()
        dist.barrier()
        gets = _gets(config["endpoint"]) if rank == 0 else 0
        epochs.append({"start": start, "end": end, "samples": samples, "gets": gets})
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(epochs))


def run(system: str, args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """One job of ``system``; per-epoch samples/s and GETs."""
    import ray.data
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = Path(tempfile.mkdtemp(prefix=f"{system}-", dir=ctx["tmp"]))
    emulator = ctx["emulator"]
    emulator.reset_counts()
    prepare_s = 0.0
    epochs = 1 if system == "shardcache-2nd-job" else args.epochs
    if system.startswith("shardcache"):
        from shardcache import ray_data

        ds = ray_data.read(
            ctx["url"],
            preprocess=decode_one,
            storage_options=emulator.storage_options(),
            redis_url=ctx["redis_url"],
            name="bench-ray-data-images",
            num_cpus=1,
        )
    else:
        import pyarrow.fs

        fs = pyarrow.fs.S3FileSystem(
            access_key="testing",
            secret_key="testing",
            endpoint_override=emulator.endpoint_url.split("://", 1)[1],
            scheme="http",
            region="us-east-1",
        )
        ds = ray.data.read_binary_files(
            ctx["url"].removeprefix("s3://"), filesystem=fs
        ).map_batches(decode, batch_size=16)
        if system == "materialize":
            started = time.perf_counter()
            ds = ds.materialize()
            prepare_s = time.perf_counter() - started
    gets_before = emulator.total_gets
    result = TorchTrainer(
        train_loop,
        train_loop_config={
            "epochs": epochs,
            "batch_size": args.batch_size,
            "endpoint": emulator.endpoint_url,
            "out": str(out),
        },
        datasets={"train": ds},
        scaling_config=ScalingConfig(
            num_workers=args.workers, resources_per_worker={"CPU": 0.5}
        ),
        run_config=RunConfig(storage_path=str(out / "runs")),
    ).fit()
    if result.error is not None:
        raise RuntimeError(f"{system}: training failed: {result.error}")
    ranks = [
        json.loads((out / f"rank{r}.json").read_text()) for r in range(args.workers)
    ]
    rows, previous = [], gets_before
    for e in range(epochs):
        per = [r[e] for r in ranks]
        seconds = max(p["end"] for p in per) - min(p["start"] for p in per)
        samples = sum(p["samples"] for p in per)
        gets = ranks[0][e]["gets"]
        rows.append(
            {
                "epoch": e,
                "samples": samples,
                "samples_per_s": round(samples / max(seconds, 1e-9), 1),
                "gets": gets - previous,
            }
        )
        previous = gets
    return {
        "system": system,
        "prepare_s": round(prepare_s, 2),
        "prepare_gets": gets_before,
        "epochs": rows,
    }


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| system | prepare s (GETs) | "
        + " | ".join(f"epoch {e} samples/s (GETs)" for e in range(3))
        + " |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        cells = [f"{e['samples_per_s']:.1f} ({e['gets']})" for e in r["epochs"]] + [
            "-"
        ] * (3 - len(r["epochs"]))
        lines.append(
            f"| {r['system']} | {r['prepare_s']} ({r['prepare_gets']}) | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--image-px", type=int, default=470, help="JPEG side in pixels")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16, help="per worker")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--profile", default="s3-standard", help="emulator latency")
    ap.add_argument("--object-store-mb", type=int, default=2048, help="per node")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args()

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import s3fs

    from shardcache.embedded import start_loopback_cluster, start_redis_server
    from shardcache_server.datagen import upload_images
    from shardcache_server.emulator import LATENCY_PROFILES, S3Emulator

    tmp = tempfile.mkdtemp(prefix="shardcache-bench-ray-data-")
    redis_proc, redis_url = start_redis_server(Path(tmp), password="bench")
    emulator = S3Emulator().start()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **emulator.storage_options())
    fs.mkdir("bench")
    print(f"s3: {args.images} JPEGs of {args.image_px} px ...", file=sys.stderr)
    upload_images(fs, "bench/images", args.images, size=args.image_px, fmt="JPEG")
    emulator.set_faults(LATENCY_PROFILES[args.profile])
    cpus_per_node = max(2, (os.cpu_count() or 2) // 2)
    cluster = start_loopback_cluster(2, args.object_store_mb * 2**20, cpus_per_node)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    ctx = {
        "tmp": tmp,
        "emulator": emulator,
        "redis_url": redis_url,
        "url": "s3://bench/images/",
    }
    results = []
    try:
        for system in args.systems.split(","):
            result = run(system, args, ctx)
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        ray.shutdown()
        cluster.shutdown()
        emulator.stop()
        redis_proc.terminate()
    print(_table(results))


if __name__ == "__main__":
    main()

"""Side-by-side benchmark: shardcache vs what users would pick instead, in one run.

    scripts/bench.sh                      # full run, writes bench/results/<date>.json + BENCHMARKS.md
    scripts/bench.sh --quick              # a small smoke run

Storage is moto's S3 behind the emulator's seeded latency model; GETs are
counted at the server. Ranks are gloo processes; each "training step" is a
fixed sleep plus an all-reduce, so ranks run in lockstep and stragglers show.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SYSTEMS = ("plain", "manager_dict", "simplecache", "shardcache")


def decode_resize(data: bytes) -> np.ndarray:
    """Decode + resize + normalise: real CPU per image (the 100 KB set)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        small = img.convert("RGB").resize((64, 64))
    return np.array(small, dtype=np.uint8)


def blob(data: bytes) -> np.ndarray:
    """The 4 KB set: per-sample overhead dominates."""
    return np.frombuffer(data, dtype=np.uint8).copy()


PREPROCESS = {"images": decode_resize, "blobs": blob}


def _pss_uss_mb(pids: list[int]) -> tuple[float, float]:
    import psutil

    pss = uss = 0.0
    for pid in pids:
        try:
            full = psutil.Process(pid).memory_full_info()
            pss, uss = pss + getattr(full, "pss", 0) / 2**20, uss + full.uss / 2**20
        except (psutil.Error, OSError):
            continue
    return pss, uss


def rank_main(
    system: str, rank: int, world: int, port: int, cfg: dict[str, Any], out: Any
) -> None:
    import psutil
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    pre = PREPROCESS[cfg["dataset"]]
    urls, opts = cfg["urls"], cfg["storage_options"]
    workers = cfg["workers"]
    collate = list
    if system == "shardcache":
        import ray

        from shardcache import DistributedCachedDataset

        ray.init(address=cfg["ray_address"], log_to_driver=False, logging_level="ERROR")
        ds = DistributedCachedDataset(
            cfg["prefix"],
            preprocess=pre,
            storage_options=opts,
            redis_url=cfg["redis_url"],
            name=f"bench-{cfg['dataset']}",
            namespace=cfg["namespace"],
            shuffle=True,
            seed=0,
        )
        loader = DataLoader(
            ds, batch_size=cfg["batch_size"], sampler=ds.sampler, collate_fn=collate
        )
        set_epoch = ds.set_epoch
    else:
        from systems import ManagerDictDataset, PlainS3Dataset, SimpleCacheDataset

        if system == "plain":
            ds = PlainS3Dataset(urls, opts, pre)
        elif system == "simplecache":
            ds = SimpleCacheDataset(
                urls, opts, pre, cache_dir=f"{cfg['tmp']}/simplecache-node{rank}"
            )
        else:
            import multiprocessing as mp

            ds = ManagerDictDataset(urls, opts, pre, mp.Manager().dict())
        sampler = DistributedSampler(
            ds, num_replicas=world, rank=rank, shuffle=True, seed=0
        )
        loader = DataLoader(
            ds,
            batch_size=cfg["batch_size"],
            sampler=sampler,
            collate_fn=collate,
            num_workers=workers,
            persistent_workers=workers > 0,
            multiprocessing_context="fork" if workers else None,
        )
        set_epoch = sampler.set_epoch
    me = psutil.Process()
    for epoch in range(cfg["epochs"]):
        set_epoch(epoch)
        dist.barrier()
        waits, n, delivered = [], 0, 0
        started = last = time.perf_counter()
        first = None
        for batch in loader:
            now = time.perf_counter()
            waits.append(now - last)
            first = first if first is not None else now - started
            n += len(batch)
            delivered += sum(int(t.numel() * t.element_size()) for t in batch)
            time.sleep(cfg["step_ms"] / 1000)
            dist.all_reduce(torch.ones(1))
            last = time.perf_counter()
        elapsed = time.perf_counter() - started
        pids = [me.pid] + [c.pid for c in me.children(recursive=True)]
        pss, uss = _pss_uss_mb(pids)
        w = np.asarray(waits) * 1000
        out.put(
            {
                "system": system,
                "rank": rank,
                "epoch": epoch,
                "samples": n,
                "seconds": elapsed,
                "samples_per_s": n / elapsed,
                "first_batch_s": first,
                "wait_p50_ms": float(np.percentile(w, 50)),
                "wait_p99_ms": float(np.percentile(w, 99)),
                "wait_mean_ms": float(w.mean()),
                # Loader-only delivery: tensor bytes over the time the loop waited.
                "delivered_bytes": delivered,
                "delivery_gbps": delivered / max(float(w.sum()) / 1000, 1e-9) / 1e9,
                "pss_mb": pss,
                "uss_mb": uss,
            }
        )
        dist.barrier()
    dist.destroy_process_group()


def memcpy_gbps(nbytes_per_sample: int, samples: int) -> float:
    src = np.random.default_rng(0).integers(
        0, 255, nbytes_per_sample * samples, dtype=np.uint8
    )
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best / 1e9


def run_system(system: str, cfg: dict[str, Any], emulator: Any) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    emulator.reset_counts()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=rank_main, args=(system, r, cfg["world"], port, cfg, out))
        for r in range(cfg["world"])
    ]
    for p in procs:
        p.start()
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + 1800
    while len(rows) < cfg["world"] * cfg["epochs"]:
        try:
            rows.append(out.get(timeout=5))
        except queue.Empty as exc:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"{system}: a rank failed (exit codes {failed}); see stderr above"
                ) from exc
    for p in procs:
        p.join(timeout=120)
    gets = emulator.total_gets
    for r in rows:
        r["gets_per_object"] = gets / len(cfg["urls"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--blobs", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument(
        "--profile",
        default="s3-standard",
        choices=["none", "s3-standard", "slow", "express"],
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args()
    if args.quick:
        args.images, args.blobs, args.reps = 200, 600, 1

    import ray
    import s3fs

    from shardcache.embedded import start_redis_server
    from shardcache_server.datagen import upload_blobs, upload_images
    from shardcache_server.emulator import LATENCY_PROFILES, S3Emulator

    systems = args.systems.split(",")
    tmp = tempfile.mkdtemp(prefix="shardcache-bench-")
    redis_proc, redis_url = start_redis_server(Path(tmp), password="bench")
    emulator = S3Emulator().start()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **emulator.storage_options())
    fs.mkdir("bench")
    print(
        f"generating {args.images} JPEGs (~100 KB) and {args.blobs} 4 KB blobs ...",
        flush=True,
    )
    upload_images(fs, "bench/images", args.images, size=320, fmt="JPEG")
    upload_blobs(fs, "bench/blobs", args.blobs, 4096)
    sizes = {"images": fs.du("bench/images") / args.images, "blobs": 4096}
    emulator.set_faults(LATENCY_PROFILES[args.profile])
    ray.init(
        address="local",  # always a private cluster, never a running one
        num_cpus=2,
        object_store_memory=1024 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    results: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for dataset, _count in (("images", args.images), ("blobs", args.blobs)):
                prefix = f"s3://bench/{dataset}/"
                urls = sorted(f"s3://{p}" for p in fs.find(prefix))
                for system in systems:  # interleaved: every system once per repetition
                    cfg = {
                        "dataset": dataset,
                        "prefix": prefix,
                        "urls": urls,
                        "storage_options": emulator.storage_options(),
                        "redis_url": redis_url,
                        "namespace": f"bench{rep}",
                        "ray_address": ray.get_runtime_context().gcs_address,
                        "epochs": args.epochs,
                        "world": 2,
                        "batch_size": 32 if dataset == "images" else 128,
                        "workers": 2,
                        "step_ms": 2.0,
                        "tmp": tmp,
                    }
                    print(
                        f"rep {rep} {dataset:6s} {system:12s} ...", end=" ", flush=True
                    )
                    t = time.perf_counter()
                    rows = run_system(system, cfg, emulator)
                    for r in rows:
                        r.update({"rep": rep, "dataset": dataset})
                    results += rows
                    print(f"{time.perf_counter() - t:.0f}s", flush=True)
    finally:
        ray.shutdown()
        emulator.stop()
        redis_proc.terminate()
    memcpy = {d: memcpy_gbps(int(sizes[d]), 1000) for d in sizes}
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["scripts/bench.sh", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "profile": args.profile,
        "object_bytes": sizes,
        "memcpy_gbps": memcpy,
        "rows": results,
    }
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    path = HERE / "results" / f"{stamp}.json"
    path.write_text(json.dumps(report, indent=1))
    from report import write_report

    write_report(
        report, HERE.parent / "BENCHMARKS.md", HERE / "results" / f"{stamp}.png"
    )
    print(f"wrote {path} and BENCHMARKS.md")


if __name__ == "__main__":
    main()

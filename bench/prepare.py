"""What a run prepares before any system: the datasets on each source and the references.

The same datasets go to the emulated S3 (``prepare_s3``, which also measures
the storage alone) and to local disk (``prepare_local``), as per-object files
and, for the packed systems, as WebDataset tar shards; ``memcpy_gbps`` is the
reference every delivery rate is compared with.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
from scenarios import DATASETS, PACKED

TAR_SAMPLES_PER_SHARD = {"images": 250, "blobs": 1000}
MEMCPY_BYTES = 256 * 2**20  # source of the memcpy reference: well past the caches


def memcpy_gbps(batch_bytes: int) -> float:
    """Batch-sized copies into freshly allocated tensors on one thread, out of
    a source larger than the caches: what collating the same bytes costs at
    memory bandwidth. Best of 3 passes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks collate on one thread
    try:
        n = max(4, MEMCPY_BYTES // batch_bytes)
        src = torch.randint(0, 255, (n, batch_bytes), dtype=torch.uint8)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for i in range(n):
                torch.empty(batch_bytes, dtype=torch.uint8).copy_(src[i])
            best = min(best, time.perf_counter() - started)
        return n * batch_bytes / best / 1e9
    finally:
        torch.set_num_threads(threads)


def calibrate_storage(emulator: Any, fs: Any, url: str) -> dict[str, float]:
    """moto's own service time with no latency model: sequential GET time,
    GET/s with 16 concurrent clients, and storage-side CPU per GET."""
    from concurrent.futures import ThreadPoolExecutor

    from shardcache_server.emulator import FaultPlan

    emulator.set_faults(FaultPlan())
    fs.cat_file(url)  # warm the connection
    times = []
    for _ in range(100):
        started = time.perf_counter()
        fs.cat_file(url)
        times.append(time.perf_counter() - started)
    emulator.reset_counts()
    started = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: fs.cat_file(url), range(400)))
    elapsed = time.perf_counter() - started
    return {
        "sequential_get_ms_p50": float(np.median(times) * 1000),
        "concurrent16_gets_per_s": 400 / elapsed,
        "storage_cpu_ms_per_get": emulator.cpu_s / max(emulator.total_gets, 1) * 1000,
    }


def prepare_s3(
    args: argparse.Namespace, systems: list[str]
) -> tuple[Any, Any, dict[str, float], dict[str, float]]:
    """Start the emulated S3 and upload both datasets to it, then calibrate it
    and set its latency model; returns (emulator, fs, calibration, object sizes)."""
    import s3fs

    from shardcache_server.datagen import upload_blobs, upload_images
    from shardcache_server.emulator import LATENCY_PROFILES, S3Emulator

    emulator = S3Emulator().start()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **emulator.storage_options())
    fs.mkdir("bench")
    print(f"s3: {args.images} JPEGs and {args.blobs} 4 KB blobs ...", flush=True)
    upload_images(fs, "bench/images", args.images, size=args.image_px, fmt="JPEG")
    upload_blobs(fs, "bench/blobs", args.blobs, 4096)
    if any(s in PACKED for s in systems):
        fs.pipe(tar_shards("bench", args))
    sizes = {"images": fs.du("bench/images") / args.images, "blobs": 4096}
    calibration = calibrate_storage(emulator, fs, f"s3://{fs.find('bench/images')[0]}")
    print(f"storage calibration: {calibration}", flush=True)
    emulator.set_faults(
        dataclasses.replace(
            LATENCY_PROFILES[args.profile],
            bandwidth_bytes_per_s=args.bandwidth_mb_s * 1e6,
        )
    )
    return emulator, fs, calibration, sizes


def prepare_local(root: Path, args: argparse.Namespace) -> dict[str, float]:
    """The same datasets as files under ``root``; returns the object sizes."""
    print(f"local: the same datasets under {root} ...", flush=True)
    _write_local(root, args)
    images = list((root / "images").iterdir())
    return {
        "images": sum(p.stat().st_size for p in images) / len(images),
        "blobs": 4096,
    }


def _write_local(root: Path, args: argparse.Namespace) -> None:
    """The same datasets as files on local disk, read once so the page cache is warm."""
    import fsspec

    from shardcache_server.datagen import upload_blobs, upload_images

    fs = fsspec.filesystem("file", auto_mkdir=True)
    for d in DATASETS:
        (root / d).mkdir(parents=True, exist_ok=True)
    upload_images(fs, str(root / "images"), args.images, size=args.image_px, fmt="JPEG")
    upload_blobs(fs, str(root / "blobs"), args.blobs, 4096)
    if any(s in PACKED for s in args.systems.split(",")):
        for d in DATASETS:
            (root / f"tar-{d}").mkdir(exist_ok=True)
        fs.pipe(tar_shards(str(root), args))
    for path in root.rglob("*"):
        if path.is_file():
            path.read_bytes()


def tar_shards(root: str, args: argparse.Namespace) -> dict[str, bytes]:
    """Both datasets as WebDataset tar shards under ``root/tar-<dataset>/``: the
    very bytes of the per-object files (the same generators, the same seeds),
    one sample per member (``img-000123.jpg``, ``blob-000123.bin``)."""
    from shardcache_server.datagen import make_image

    rng = np.random.default_rng(0)  # upload_blobs' sequence
    named = {
        "images": [
            (f"img-{i:06d}.jpg", make_image(i, args.image_px, "JPEG"))
            for i in range(args.images)
        ],
        "blobs": [
            (f"blob-{i:06d}.bin", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
            for i in range(args.blobs)
        ],
    }
    shards: dict[str, bytes] = {}
    for dataset, members in named.items():
        per_shard = TAR_SAMPLES_PER_SHARD[dataset]
        for s, start in enumerate(range(0, len(members), per_shard)):
            path = f"{root}/tar-{dataset}/shard-{s:04d}.tar"
            shards[path] = _tar(members[start : start + per_shard])
    return shards


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()

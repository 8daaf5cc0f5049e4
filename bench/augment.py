"""Cached augmented variants against augmenting on the rank and in DataLoader workers.

A CPU-heavy augmentation (random resized crop back to 224x224 with bilinear
interpolation, horizontal flip, color jitter: brightness, contrast,
saturation; numpy, since torchvision cannot be installed against this
machine's CPU torch) on 224x224x3 uint8 images stored as ``.npy`` files,
three ways, each timed over warm epochs in one process (rank 0 of 1):

(a) ``DistributedCachedDataset(augment=..., variants=K)``: the stores build
    K variants per sample once; warm epochs read them with ``ds.loader(B)``.
(b) the same dataset without variants and the augmentation as
    ``transform=`` (run on the rank, per sample, every epoch).
(c) a plain map-style Dataset over the files, ``np.load`` + augmentation in
    ``DataLoader(num_workers=2)`` workers, as most pipelines do it.

Figures: warm samples/s; CPU-seconds per sample, summed over this process
and every process it started (Ray's workers and stores, Redis, DataLoader
workers): what the augmentation costs the node, not only the rank; for (a)
also the one-time build (K views of every sample) and the store's bytes per
variant. The machine is shared: the load average is printed with the
figures, and wall-clock rates move with it; CPU-seconds move much less.

    PYTHONPATH=sdk:services:bench .venv/bin/python bench/augment.py \\
        --samples 512 --variants 4 --batch 32 --epochs 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

SIDE = 224  # images are SIDE x SIDE x 3 uint8, as ImageNet training crops


def augment(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """RandomResizedCrop(224, scale=(0.25, 1), ratio=(3/4, 4/3)) + horizontal
    flip + ColorJitter(0.4, 0.4, 0.4), in numpy (float32): ~6 full-image
    passes, a few ms per image."""
    h, w, _ = image.shape
    area = h * w * rng.uniform(0.25, 1.0)
    ratio = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    ch = int(min(h, max(1, round(np.sqrt(area / ratio)))))
    cw = int(min(w, max(1, round(np.sqrt(area * ratio)))))
    top = int(rng.integers(0, h - ch + 1))
    left = int(rng.integers(0, w - cw + 1))
    crop = image[top : top + ch, left : left + cw].astype(np.float32)
    # Bilinear resize back to h x w (half-pixel centres, as torchvision).
    ys = np.clip((np.arange(h) + 0.5) * ch / h - 0.5, 0, ch - 1)
    xs = np.clip((np.arange(w) + 0.5) * cw / w - 0.5, 0, cw - 1)
    y0, x0 = ys.astype(np.int64), xs.astype(np.int64)
    y1, x1 = np.minimum(y0 + 1, ch - 1), np.minimum(x0 + 1, cw - 1)
    wy = (ys - y0).astype(np.float32)[:, None, None]
    wx = (xs - x0).astype(np.float32)[None, :, None]
    top_row = crop[y0][:, x0] * (1 - wx) + crop[y0][:, x1] * wx
    bottom_row = crop[y1][:, x0] * (1 - wx) + crop[y1][:, x1] * wx
    out = top_row * (1 - wy) + bottom_row * wy
    if rng.random() < 0.5:
        out = out[:, ::-1]
    out = out * np.float32(rng.uniform(0.6, 1.4))  # brightness
    mean = out.mean()
    out = (out - mean) * np.float32(rng.uniform(0.6, 1.4)) + mean  # contrast
    gray = (out @ np.array([0.299, 0.587, 0.114], np.float32))[..., None]
    out = (out - gray) * np.float32(rng.uniform(0.6, 1.4)) + gray  # saturation
    return np.clip(out, 0, 255).astype(np.uint8)


class RankAugment:
    """``transform=``: the same augmentation on the rank, fresh every epoch."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def __call__(self, x):
        import torch

        return torch.from_numpy(augment(x.numpy(), self.rng))


class FilesDataset:
    """(c): read a file and augment it in a DataLoader worker."""

    def __init__(self, paths: list[Path]):
        self.paths = paths
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        import torch

        rng = np.random.default_rng([self.epoch, i])
        return torch.from_numpy(augment(np.load(self.paths[i]), rng))


def tree_cpu_s() -> float:
    """CPU seconds of this process, its live descendants and reaped children."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total + reaped.ru_utime + reaped.ru_stime


def timed(epochs: int, run_epoch) -> dict[str, float]:
    """Samples/s and CPU-s per sample over ``epochs`` calls of ``run_epoch(e)``."""
    n, cpu, wall = 0, tree_cpu_s(), time.perf_counter()
    for e in range(epochs):
        n += run_epoch(e)
    wall, cpu = time.perf_counter() - wall, tree_cpu_s() - cpu
    return {
        "samples_per_s": round(n / wall, 1),
        "cpu_ms_per_sample": round(cpu / n * 1e3, 3),
        "samples": n,
    }


def _write_images(root: Path, count: int) -> list[Path]:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    paths = []
    for i in range(count):
        # Smooth gradients plus noise: crops and jitter change every pixel.
        base = np.linspace(0, 255, SIDE, dtype=np.float32)
        image = (base[:, None, None] + base[None, :, None]) / 2
        image = image + rng.normal(0, 20, (SIDE, SIDE, 3))
        paths.append(root / f"img-{i:05d}.npy")
        np.save(paths[-1], np.clip(image, 0, 255).astype(np.uint8))
    return paths


def _loop(ds, batch: int, first_epoch: int):
    def run(e: int) -> int:
        ds.set_epoch(first_epoch + e)
        return sum(len(x) for x in ds.loader(batch))

    return run


def _wait_for_variants(store, timeout_s: float = 600) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.get(store.info.remote())["variant_builds"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the background variant builds did not finish")
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--variants", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=4, help="warm epochs timed")
    args = ap.parse_args()

    import ray
    import torch

    from shardcache import DistributedCachedDataset
    from shardcache.embedded import start_redis_server
    from shardcache_server.cluster import store_for_node

    tmp = Path(tempfile.mkdtemp(prefix="shardcache-augment-"))
    paths = _write_images(tmp / "images", args.samples)
    rng = np.random.default_rng(1)
    one = np.load(paths[0])
    started = time.process_time()
    for _ in range(50):
        augment(one, rng)
    augment_ms = (time.process_time() - started) / 50 * 1e3
    redis_proc, redis_url = start_redis_server(tmp, password="bench")
    ray.init(
        num_cpus=2,
        object_store_memory=2 * 2**30,
        include_dashboard=False,
        log_to_driver=False,
    )
    ns, out = "augmentbench", {}
    common = dict(
        redis_url=redis_url, namespace=ns, rank=0, world_size=1, seed=0,
        chunk_samples=32,
    )  # fmt: skip
    try:
        # (a) cached variants: the build (epoch 0 on demand, the rest in the
        # background), then warm epochs that only read.
        ds = DistributedCachedDataset(
            f"{tmp / 'images'}/", augment=augment, variants=args.variants, **common
        )
        store = store_for_node(ns, ray.get_runtime_context().get_node_id())
        cpu, wall = tree_cpu_s(), time.perf_counter()
        _loop(ds, args.batch, 0)(0)
        _wait_for_variants(store)
        build = {
            "wall_s": round(time.perf_counter() - wall, 2),
            "cpu_s": round(tree_cpu_s() - cpu, 2),
        }
        out["a_variants_warm"] = timed(args.epochs, _loop(ds, args.batch, 1))
        fallbacks = ds.stats()["variants"]["base_fallback"]
        held = ray.get(store.snapshot.remote(ds.name))
        variant_bytes = sum(v["nbytes"] for k, v in held.items() if ".v" in k)
        base_bytes = sum(v["nbytes"] for k, v in held.items() if ".v" not in k)
        out["a_build_once"] = build
        out["a_base_fallback_samples"] = fallbacks
        out["a_store_mib"] = {
            "base": round(base_bytes / 2**20, 1),
            "per_variant": round(variant_bytes / args.variants / 2**20, 1),
            "per_variant_per_sample_kib": round(
                variant_bytes / args.variants / args.samples / 2**10, 1
            ),
        }
        # (b) the augmentation on the rank, as transform= (the base is cached).
        ds_rank = DistributedCachedDataset(
            f"{tmp / 'images'}/", transform=RankAugment(0), **common
        )
        _loop(ds_rank, args.batch, 0)(0)  # not timed: attaches, maps the listing
        out["b_transform_on_rank"] = timed(args.epochs, _loop(ds_rank, args.batch, 1))
        # (c) files + augmentation in DataLoader workers.
        files = FilesDataset(paths)

        def workers_epoch(e: int) -> int:
            files.epoch = e
            loader = torch.utils.data.DataLoader(
                files, batch_size=args.batch, shuffle=True, num_workers=2
            )
            return sum(len(x) for x in loader)

        workers_epoch(0)  # not timed: the files enter the page cache
        out["c_dataloader_workers"] = timed(args.epochs, workers_epoch)
    finally:
        ray.shutdown()
        redis_proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    out["augment_ms_per_image_in_process"] = round(augment_ms, 2)
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    out["command"] = (
        f"bench/augment.py --samples {args.samples} --variants {args.variants} "
        f"--batch {args.batch} --epochs {args.epochs}"
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

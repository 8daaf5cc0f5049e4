"""Epoch 1 on the README's path against the DataLoader a user runs today.

Issue 30's first figure: a user switching to the cache must not lose time in
epoch 1. Both sides read the same page-cached ``.npy`` files and deliver
collated batch tensors:

* **cache**: ``DistributedCachedDataset("file://<dir>/*.npy")`` (the default
  preprocess of ``.npy`` objects: their array) with
  ``DataLoader(ds, batch_size=B, sampler=ds.sampler)`` exactly as the README
  shows, on a cache that has never seen the files (a fresh embedded Redis +
  Ray head under its own ``SHARDCACHE_HOME``), in a process of its own. The
  head's start and the listing are reported apart from the epochs.
* **plain**: a map-style Dataset that ``np.load``s each file, with
  ``DataLoader(num_workers=2, persistent_workers=True, shuffle=True)``:
  epoch 1 and epoch 2 (the files were read once before, so both are
  page-cached, as the issue measured).

Both sides time the loop up to the collated tensor (the step is empty).
Prints one JSON line. Rough on a shared machine: the load average is in it.

    PYTHONPATH=sdk:services:bench .venv/bin/python bench/cold_readme.py \\
        --samples 4000 --sample-bytes 150528
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _shape(sample_bytes: int) -> tuple[int, ...]:
    # 150,528 bytes is a (3, 224, 224) uint8 image; anything else a flat row.
    return (3, 224, 224) if sample_bytes == 3 * 224 * 224 else (sample_bytes,)


def _write(folder: Path, n: int, sample_bytes: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shape = _shape(sample_bytes)
    for i in range(n):
        np.save(folder / f"{i:06d}.npy", np.full(shape, i % 251, np.uint8))
    for path in folder.iterdir():  # page-cache them, as the plain side finds them
        path.read_bytes()


class _Files:
    """The plain baseline: a map-style dataset of the same files."""

    def __init__(self, folder: Path):
        self.paths = sorted(folder.glob("*.npy"))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):  # noqa: ANN204 (a tensor)
        import torch

        return torch.from_numpy(np.load(self.paths[i]))


def _epochs(loader, epochs: int, set_epoch=None) -> list[dict[str, float]]:  # noqa: ANN001
    out = []
    for epoch in range(epochs):
        if set_epoch is not None:
            set_epoch(epoch)
        n, started = 0, time.perf_counter()
        first = None
        for x in loader:
            n += int(x.shape[0])
            if first is None:
                first = time.perf_counter() - started
        seconds = time.perf_counter() - started
        out.append({"samples": n, "s": seconds, "per_s": n / seconds, "first_s": first})
    return out


def plain(
    folder: Path, batch: int, epochs: int, workers: int
) -> list[dict[str, float]]:
    import torch

    loader = torch.utils.data.DataLoader(
        _Files(folder),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    return _epochs(loader, epochs)


def cache(
    folder: Path,
    batch: int,
    epochs: int,
    running: bool,
    chunk_bytes: int | None = None,
    shuffle_block: int | None = None,
) -> dict[str, object]:
    """The README's loop, in this process (run as a subprocess by main).

    ``running``: first read a small other dataset once, so the embedded head
    and the node's build workers are up (a cache that is already running,
    as after ``helm install``); otherwise this is the first script on the
    machine and pays for starting them.
    """
    import torch

    from shardcache import DistributedCachedDataset

    if running:
        other = folder.parent / "other"
        _write(other, 64, 1024)
        for _ in DistributedCachedDataset(f"file://{other}/*.npy").loader(64):
            pass
    started = time.perf_counter()

    extra: dict[str, int] = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    extra |= {"shuffle_block": shuffle_block} if shuffle_block else {}
    ds = DistributedCachedDataset(f"file://{folder}/*.npy", **extra)
    built = time.perf_counter() - started
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, sampler=ds.sampler)
    timed = _epochs(loader, epochs, ds.set_epoch)
    stats = ds.stats()
    keep = ("hits", "misses", "local", "source", "disk", "remote", "wait_p50_ms")
    return {
        "construct_s": built,
        "epochs": timed,
        "stats": {k: v for k, v in stats.items() if k in keep},
    }


def _run_cache(
    home: Path, folder: Path, args: argparse.Namespace, system: str
) -> dict[str, object]:
    """One cache run in a process of its own, with its own embedded head."""
    env = {**os.environ, "SHARDCACHE_HOME": str(home)}
    cmd = [sys.executable, __file__, "--cache-only", str(folder)]
    cmd += ["--batch", str(args.batch), "--epochs", str(args.epochs)]
    cmd += ["--running"] if system == "cache_running" else []
    cmd += ["--chunk-bytes", str(args.chunk_bytes)] if args.chunk_bytes else []
    cmd += ["--shuffle-block", str(args.shuffle_block)] if args.shuffle_block else []
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        stop = [sys.executable, "-m", "shardcache_server.cli", "local", "stop"]
        subprocess.run(stop, env=env, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--sample-bytes", type=int, default=3 * 224 * 224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--systems",
        default="plain,cache,cache_running",
        help="plain; cache: the first script on the machine (starts the "
        "embedded head); cache_running: the cache already running",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=0,
        help="the cache's chunk_bytes (0: default)",
    )
    parser.add_argument(
        "--shuffle-block",
        type=int,
        default=0,
        help="the cache's shuffle_block in samples (0: the default full shuffle)",
    )
    parser.add_argument("--cache-only", help=argparse.SUPPRESS)  # the subprocess
    parser.add_argument("--running", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cache_only:
        out = cache(
            Path(args.cache_only),
            args.batch,
            args.epochs,
            args.running,
            args.chunk_bytes,
            args.shuffle_block,
        )
        print(json.dumps(out))
        return
    work = Path(tempfile.mkdtemp(prefix="cold-readme-"))
    try:
        folder = work / "data"
        _write(folder, args.samples, args.sample_bytes)
        out: dict[str, object] = {
            "samples": args.samples,
            "sample_bytes": args.sample_bytes,
            "batch": args.batch,
            "shuffle_block": args.shuffle_block,
            "load_before": os.getloadavg()[0],
        }
        systems = args.systems.split(",")
        if "plain" in systems:
            out["plain"] = plain(folder, args.batch, args.epochs, args.workers)
        for system in ("cache", "cache_running"):
            if system in systems:
                out[system] = _run_cache(work / system, folder, args, system)
        if "plain" in out:
            best_plain = max(e["per_s"] for e in out["plain"])  # type: ignore[union-attr]
            for system in ("cache", "cache_running"):
                if system in out:
                    cold = out[system]["epochs"][0]["per_s"]  # type: ignore[index]
                    out[f"{system}_cold_vs_plain"] = round(cold / best_plain, 3)
        out["load_after"] = os.getloadavg()[0]
        print(json.dumps(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

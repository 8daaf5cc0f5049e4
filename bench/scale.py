"""How shardcache's fixed costs grow with the number of samples: one rank, one node.

    .venv/bin/python bench/scale.py --samples 20000 --sample-bytes 100

Writes ``--samples`` files of ``--sample-bytes`` random bytes under a
directory (``--dir``, reused when it already holds them), or with
``--format npy`` one ``(samples, sample_bytes)`` uint8 .npy file (a packed
source: listing reads its header, nothing per sample), then measures:
listing + publish (building the dataset: the source listing and its index
entry), cold and warm samples/s of one rank, and anonymous memory per sample
of the rank and of the store (RssAnon growth, payload excluded: values live
in Ray's object store, which is shared memory) plus Redis ``used_memory``
per sample. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
)
FILES_PER_DIR = 10_000  # a flat directory of millions of names is its own benchmark
WRITE_THREADS = 8


def write_samples(root: Path, samples: int, sample_bytes: int) -> float:
    """``samples`` files of random bytes, ``FILES_PER_DIR`` per directory; seconds."""
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, sample_bytes * min(samples, 4096), dtype=np.uint8)
    payload = payload.tobytes()

    def write(i: int) -> None:
        d = root / f"d{i // FILES_PER_DIR:05d}"
        off = (i % 4096) * sample_bytes
        (d / f"s{i:09d}.bin").write_bytes(payload[off : off + sample_bytes])

    for d in range((samples + FILES_PER_DIR - 1) // FILES_PER_DIR):
        (root / f"d{d:05d}").mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(WRITE_THREADS) as pool:
        list(pool.map(write, range(samples), chunksize=1024))
    return time.perf_counter() - started


def write_npy(path: Path, samples: int, sample_bytes: int) -> float:
    """One packed file: ``samples`` rows of ``sample_bytes`` random bytes; seconds."""
    started = time.perf_counter()
    rows = np.lib.format.open_memmap(
        path, mode="w+", dtype=np.uint8, shape=(samples, sample_bytes)
    )
    rng = np.random.default_rng(0)
    step = 1 << 20
    for lo in range(0, samples, step):
        hi = min(lo + step, samples)
        rows[lo:hi] = rng.integers(0, 256, (hi - lo, sample_bytes), dtype=np.uint8)
    rows.flush()
    del rows
    return time.perf_counter() - started


def raw(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()


def _epoch(ds: Any, batches: Any, epoch: int) -> tuple[int, float]:
    ds.set_epoch(epoch)
    started, n = time.perf_counter(), 0
    for batch in batches(epoch):
        x = batch if not isinstance(batch, dict) else next(iter(batch.values()))
        n += int(x.shape[0])
    return n, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--sample-bytes", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument(
        "--dir", default=None, help="where the files go (default: a temp dir)"
    )
    ap.add_argument("--object-store-mb", type=int, default=1024)
    ap.add_argument(
        "--format",
        default="objects",
        choices=["objects", "npy"],
        help="one file per sample, or one packed .npy file",
    )
    ap.add_argument(
        "--shardcache-path", default="auto", choices=["auto", "loader", "dataloader"]
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="also time the plain read a user runs today over the same files "
        "(a map-style Dataset, DataLoader with 2 workers; its better of 2 epochs "
        "after the cache; run before it too, until its epochs stop speeding up, so both read page-cached files)",
    )
    ap.add_argument("--plain-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steady", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="shardcache-scale-"))
    if args.plain_only:  # the child that times the plain read in a process of its own
        print(
            json.dumps(
                plain_read(
                    root / f"n{args.samples}-b{args.sample_bytes}",
                    args.batch_size,
                    steady=args.steady,
                )
            )
        )
        return

    import ray
    from memory import ClusterMeter, redis_used_memory, rss_anon, store_pids

    from shardcache import DistributedCachedDataset
    from shardcache.embedded import start_redis_server

    from ranks import shardcache_batches

    packed = args.format == "npy"
    files = root / f"n{args.samples}-b{args.sample_bytes}"
    if packed:
        files = files.with_suffix(".npy")
    marker = root / f"{files.name}.done"  # outside the dataset: it would be a sample
    write_s = 0.0
    if not marker.exists():
        write = write_npy if packed else write_samples
        write_s = write(files, args.samples, args.sample_bytes)
        marker.write_text("")
    before: dict[str, Any] = {}
    if args.plain and not packed:
        # First, so both read page-cached files: whichever reads first after
        # the files were written (or the page cache was reclaimed) pays the disk.
        # Until its epochs stop speeding up: after a reboot one epoch of 1 M
        # files from disk left the next at 60 % speed (inodes, dentries).
        before = _plain_in_child(args, root, steady=True)
    redis_proc, redis_url = start_redis_server(Path(tempfile.mkdtemp()), password="s")
    ray.init(
        address="local",  # always a private cluster, never a running one
        num_cpus=2,
        object_store_memory=args.object_store_mb * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    common = {"redis_url": redis_url, "namespace": "scale", "rank": 0, "world_size": 1}
    try:
        # A small dataset of the same kind starts the store first, so its
        # baseline is taken with the process up and the imports done.
        if packed:
            first = root / "warmup.npy"
            write_npy(first, 16, args.sample_bytes)
            warm = DistributedCachedDataset(str(first), name="warmup", **common)
        else:
            first = next(iter(sorted((files / "d00000").iterdir())))
            warm = DistributedCachedDataset([str(first)], raw, name="warmup", **common)
        batches, _ = shardcache_batches(warm, 1, args.shardcache_path)
        _epoch(warm, batches, 0)
        warm.close()
        me = os.getpid()
        stores = store_pids([me])
        rank0, store0 = rss_anon(me), sum(rss_anon(p) for p in stores)
        redis0 = redis_used_memory(redis_url)
        ray_side = ClusterMeter(me, exclude=[redis_proc.pid])
        ray_side.start()
        started = time.perf_counter()
        ds = (
            DistributedCachedDataset(
                str(files), name=f"scalenpy{args.samples}", shuffle=True, **common
            )
            if packed
            else DistributedCachedDataset(
                f"{files}/", raw, name=f"scale{args.samples}", shuffle=True, **common
            )
        )
        publish_s = time.perf_counter() - started
        store_listed = sum(rss_anon(p) for p in store_pids([me]))
        batches, path = shardcache_batches(ds, args.batch_size, args.shardcache_path)
        cold_n, cold_s = _epoch(ds, batches, 0)
        store_cold = sum(rss_anon(p) for p in store_pids([me]))
        warm_n, warm_s = _epoch(ds, batches, 1)
        stores = store_pids([me])
        out = {
            "samples": args.samples,
            "sample_bytes": args.sample_bytes,
            "format": args.format,
            "batch_size": args.batch_size,
            "path": path,
            "write_s": round(write_s, 3),
            "list_publish_s": round(publish_s, 3),
            "cold_samples_per_s": round(cold_n / cold_s, 1),
            "warm_samples_per_s": round(warm_n / warm_s, 1),
            "rank_anon_bytes_per_sample": round(
                (rss_anon(me) - rank0) / args.samples, 1
            ),
            "store_anon_bytes_per_sample": (
                round((sum(rss_anon(p) for p in stores) - store0) / args.samples, 1)
                if stores
                else None
            ),
            "store_processes": len(stores),
            # every process of the cluster (GCS, raylet, stores, listing and
            # build workers), not only the store actor
            "ray_side_anon_bytes_per_sample": round(ray_side.grown() / args.samples, 1),
            "ray_side_anon_growth_by_process": ray_side.by_process(),
            # where the store's growth happens: after listing, after the cold epoch
            "store_anon_after_listing_per_sample": round(
                (store_listed - store0) / args.samples, 1
            ),
            "store_anon_after_cold_per_sample": round(
                (store_cold - store0) / args.samples, 1
            ),
            "redis_bytes_per_sample": round(
                (redis_used_memory(redis_url) - redis0) / args.samples, 1
            ),
            "cpus": os.cpu_count(),
        }
        ds.close()
    finally:
        ray.shutdown()
        redis_proc.terminate()
    if args.plain and not packed:
        # After the cache is down, so the plain loader has the cores to itself.
        out |= _plain_in_child(args, root)
        out["plain_before_epochs_samples_per_s"] = before["plain_epochs_samples_per_s"]
        out["cold_vs_plain"] = round(
            out["cold_samples_per_s"] / out["plain_samples_per_s"], 3
        )
    print(json.dumps(out))


def _plain_in_child(
    args: argparse.Namespace, root: Path, steady: bool = False
) -> dict[str, Any]:
    """:func:`plain_read` in a fresh process, as a user runs it: its heap and
    workers never count in this process's memory per sample."""
    import subprocess

    cmd = [
        sys.executable, __file__, "--plain-only", "--dir", str(root),
        "--samples", str(args.samples), "--sample-bytes", str(args.sample_bytes),
        "--batch-size", str(args.batch_size), *(["--steady"] if steady else []),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


class _Files:
    """The baseline's map-style Dataset: one file read per sample."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        import torch

        with open(self.paths[i], "rb") as f:
            return torch.from_numpy(raw(f.read()))


def plain_read(files: Path, batch_size: int, steady: bool = False) -> dict[str, Any]:
    """Samples/s of ``DataLoader(num_workers=2, persistent_workers=True,
    shuffle=True)`` over the same files, timed up to the collated batch: its
    better epoch of two (the first starts the workers), or with ``steady``
    of as many as it takes (up to 5) until one is not 10 % faster than the
    one before. The file list is made before the clock starts, as the
    cache's listing is timed apart."""
    from torch.utils.data import DataLoader

    listed = time.perf_counter()
    paths = sorted(
        entry.path
        for d in sorted(os.scandir(files), key=lambda e: e.name)
        for entry in os.scandir(d.path)
    )
    list_s = time.perf_counter() - listed
    loader = DataLoader(
        _Files(paths),
        batch_size=batch_size,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
    )
    rates = []
    while len(rates) < 2 or (steady and len(rates) < 5 and rates[-1] > 1.1 * rates[-2]):
        started, n = time.perf_counter(), 0
        for batch in loader:
            n += int(batch.shape[0])
        rates.append(n / (time.perf_counter() - started))
    return {
        "plain_list_s": round(list_s, 3),
        "plain_samples_per_s": round(max(rates), 1),
        "plain_epochs_samples_per_s": [round(r, 1) for r in rates],
    }


if __name__ == "__main__":
    main()

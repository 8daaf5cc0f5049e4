"""A dataset larger than the cache's memory, read with the default full shuffle.

Issue 30's scenario, scaled to run in a few minutes: ``.npy`` samples of
(3,128,128) float32 (192 KiB) in local files, a store whose memory budget
(``SHARDCACHE_CACHE_BYTES``) is a third of the data, a disk tier
(``SHARDCACHE_DISK_DIR``), Ray's object store at 1.25x the budget, one rank
with the README's ``DataLoader(ds, batch_size=32, sampler=ds.sampler)`` and
``SHARDCACHE_HOLD_BYTES=0`` (the process keeps no chunks between batches).
After one cold epoch this times warm epochs: samples/s, source reads
(GETs) per epoch, p50/p99 of the time the loop waited for a batch, and
where the samples came from (``ds.stats()``). Beside it, in the same run:

* the old warm path (every chunk not in memory reloaded whole from its file
  into the object store: the store is asked without files), over the first
  ``--old-batches`` batches only, since it is slow;
* the same warm epoch through ``ds.loader(B)`` (one gather per batch);
* a plain ``DataLoader(num_workers=2, persistent_workers=True)`` over the
  same files with ``np.load`` (its second epoch: the files page-cached);
* with ``--mosaic``, Mosaic Streaming's local dataset over the same samples
  converted to MDS shards (``mosaic_local.py``, in ``.venv-mosaic``), its
  second epoch, 2 workers, its default shuffle.

By default the page cache is not limited: the plain loader reads
page-cached files, the hardest baseline. ``--memory-limit-mib N`` reads
the warm epochs in a memory cgroup of N MiB, page cache included, with
the page cache dropped first (``memory_limit.py``; root only): the rank
(Ray and the stores stay outside, bounded by their own budget), then the
plain loader with its workers, then Mosaic, each under the same limit.

    PYTHONPATH=sdk:services:bench .venv/bin/python bench/larger_than_memory.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from memory_limit import MemoryLimit

HERE = Path(__file__).resolve().parent
MOSAIC_PYTHON = HERE.parent / ".venv-mosaic" / "bin" / "python"  # launch.py's
SHAPE = (3, 128, 128)  # float32: 192 KiB per sample, as in the issue


def _write(folder: Path, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        np.save(folder / f"{i:05d}.npy", np.full(SHAPE, i, np.float32))


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data))


class _Files:
    """The plain baseline: a map-style dataset of the same ``.npy`` files."""

    def __init__(self, folder: Path):
        self.paths = sorted(folder.glob("*.npy"))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.load(self.paths[i])


def _timed(batches, limit: int | None = None, count=len) -> dict[str, float]:  # noqa: ANN001
    """Samples/s and the waits for each batch of one pass over ``batches``
    (``count``: the samples in one batch)."""
    waits, n = [], 0
    start = last = time.perf_counter()
    for b, batch in enumerate(batches):
        now = time.perf_counter()
        waits.append(now - last)
        n += count(batch)
        last = time.perf_counter()
        if limit is not None and b + 1 >= limit:
            break
    total = time.perf_counter() - start
    return {
        "samples": n,
        "samples_per_s": round(n / total, 1),
        "p50_wait_ms": round(1e3 * float(np.percentile(waits, 50)), 2),
        "p99_wait_ms": round(1e3 * float(np.percentile(waits, 99)), 2),
    }


def _old_reload_path(ds, loader, args) -> dict[str, float]:  # noqa: ANN001
    """The old path: the store reloads every chunk not in memory."""
    from shardcache.transport.direct import CacheClient

    files_on = CacheClient.get_refs

    def no_files(self, *args, files=False, **kwargs):
        return files_on(self, *args, **kwargs)

    CacheClient.get_refs = no_files  # type: ignore[method-assign]
    try:
        ds.set_epoch(2 + args.epochs)
        return _timed(loader, args.old_batches)
    finally:
        CacheClient.get_refs = files_on  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2, help="warm epochs timed")
    ap.add_argument("--old-batches", type=int, default=6)
    ap.add_argument(
        "--shuffle-block",
        type=int,
        default=0,
        help="the dataset's shuffle_block in samples (0: the default full shuffle)",
    )
    ap.add_argument(
        "--no-disk",
        action="store_true",
        help="no disk tier: chunks evicted from memory are built from the source again",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads of the rank (default_collate's torch.stack runs "
        "there; DataLoader workers use 1): 2 threads on a loaded 2-core machine "
        "made one 6 MiB stack take 350-690 ms instead of 0.3 ms",
    )
    ap.add_argument(
        "--memory-limit-mib",
        type=int,
        default=0,
        help="read the warm epochs in a memory cgroup of this size, page cache "
        "included: the rank (Ray and the stores stay outside, within their "
        "budget), then the plain loader and its workers (0: no limit)",
    )
    ap.add_argument(
        "--mosaic",
        action="store_true",
        help="also Mosaic Streaming's local dataset over the same samples "
        "(needs .venv-mosaic, made by scripts/bench.sh)",
    )
    args = ap.parse_args()
    print(json.dumps(_run(args), indent=1))


def _limited(args: argparse.Namespace, out: dict[str, object], tmp: Path) -> object:
    """Put this process (the reader) in a memory cgroup of the limit asked
    for, with the page cache dropped first; a no-op context without one."""
    if not args.memory_limit_mib:
        return contextlib.nullcontext()
    MemoryLimit.drop_page_cache()
    out.setdefault("resident_after_drop_mib", []).append(
        {
            d: MemoryLimit.resident_mib(str(tmp / d))
            for d in ("data", "disk", "mds")
            if (tmp / d).exists()
        }
    )
    group = MemoryLimit(args.memory_limit_mib)
    out["memory_limit_mib"] = args.memory_limit_mib
    return group


def _run(args: argparse.Namespace) -> dict[str, object]:
    budget = args.budget_mib * 2**20
    tmp = Path(tempfile.mkdtemp(prefix="shardcache-ltm-"))
    os.environ["SHARDCACHE_HOLD_BYTES"] = "0"
    os.environ["SHARDCACHE_CACHE_BYTES"] = str(budget)
    disk_dir = "" if args.no_disk else str(tmp / "disk")
    if disk_dir:
        os.environ["SHARDCACHE_DISK_DIR"] = disk_dir

    import ray
    import torch

    from shardcache import DistributedCachedDataset
    from shardcache.embedded import start_redis_server
    from shardcache_server.cluster import ensure_stores, store_for_node
    from shardcache_server.settings import ServiceSettings

    torch.set_num_threads(args.torch_threads)
    _write(tmp / "data", args.samples)
    data_bytes = args.samples * int(np.prod(SHAPE)) * 4
    redis_proc, redis_url = start_redis_server(tmp, password="bench")
    ray.init(
        address="local",  # a Ray of its own, even where another one runs
        num_cpus=2,
        object_store_memory=max(int(1.25 * budget), 80 * 2**20),  # Ray: >= 75 MiB
        include_dashboard=False,
        log_to_driver=False,
    )
    out: dict[str, object] = {
        "command": "bench/larger_than_memory.py "
        f"--samples {args.samples} --budget-mib {args.budget_mib} "
        f"--batch {args.batch} --epochs {args.epochs} "
        f"--old-batches {args.old_batches} --torch-threads {args.torch_threads}"
        f" --shuffle-block {args.shuffle_block}"
        + (" --no-disk" if args.no_disk else "")
        + (" --mosaic" if args.mosaic else "")
        + (
            f" --memory-limit-mib {args.memory_limit_mib}"
            if args.memory_limit_mib
            else ""
        ),
        "data_mib": round(data_bytes / 2**20, 1),
        "budget_mib": args.budget_mib,
    }
    try:
        ns = "ltmbench"
        ensure_stores(ServiceSettings(
            redis_url=redis_url, namespace=ns, cache_bytes=budget,
            disk_dir=disk_dir,
        ))  # fmt: skip
        ds = DistributedCachedDataset(
            f"{tmp / 'data'}/", preprocess=_npy, redis_url=redis_url,
            namespace=ns, rank=0, world_size=1, seed=0,
            shuffle_block=args.shuffle_block or None,
        )  # fmt: skip
        loader = torch.utils.data.DataLoader(
            ds, batch_size=args.batch, sampler=ds.sampler
        )
        ds.set_epoch(0)
        out["cold"] = _timed(loader)
        store = store_for_node(ns, ray.get_runtime_context().get_node_id())
        if disk_dir:
            disk = ray.get(store.flush_disk.remote())
            out["disk_chunks"] = disk["disk_chunks"]
        warm = []
        # Epoch 1 starts before the page cache is dropped: the files the cold
        # epoch mapped are let go first, or the drop could not free them.
        ds.set_epoch(1)
        gc.collect()
        with _limited(args, out, tmp) as group:
            for epoch in range(1, 1 + args.epochs):
                before = ds.stats()["served"]
                ds.set_epoch(epoch)
                figures = _timed(loader)
                after = ds.stats()["served"]
                figures["gets"] = after["source"] - before["source"]
                figures["by_origin"] = {
                    o: after[o] - before[o] for o in ("local", "disk", "peer", "source")
                }
                warm.append(figures)
            if group is not None:
                out["rank_peak_mib"] = group.peak_mib()
        out["warm"] = warm
        # The same warm epoch through ds.loader (one gather per batch, no
        # per-sample copy and no default_collate stack).
        before = ds.stats()["served"]
        ds.set_epoch(1 + args.epochs)
        out["warm_ds_loader"] = _timed(ds.loader(args.batch))
        out["warm_ds_loader"]["gets"] = (
            ds.stats()["served"]["source"] - before["source"]
        )
        info = ray.get(store.info.remote())
        out["store_used_mib"] = round(info["used_bytes"] / 2**20, 1)
        out["store_entries"] = info["entries"]

        if disk_dir:
            out["old_reload_path"] = _old_reload_path(ds, loader, args)
        ds.close()
    finally:
        ray.shutdown()
        redis_proc.terminate()

    with _limited(args, out, tmp) as group:  # the plain loader's workers too
        plain = torch.utils.data.DataLoader(
            _Files(tmp / "data"),
            batch_size=args.batch,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
        )
        _timed(plain)  # its first epoch
        out["plain_dataloader_2_workers"] = _timed(plain)
        del plain
        if group is not None:
            out["plain_peak_mib"] = group.peak_mib()
    if args.mosaic:
        out["mosaic_2_workers"] = _mosaic(args, out, tmp)
    shutil.rmtree(tmp, ignore_errors=True)  # the data, the disk tier, Redis
    return out


def _mosaic(args: argparse.Namespace, out: dict[str, object], tmp: Path) -> object:
    """Mosaic's read of the same samples: converted outside the limit, read
    (its process and workers) inside it."""
    if not MOSAIC_PYTHON.exists():
        return "not run: no .venv-mosaic (scripts/bench.sh makes it)"
    script = str(HERE / "mosaic_local.py")

    def run(*argv: str) -> dict[str, object]:
        done = subprocess.run(
            [str(MOSAIC_PYTHON), script, *argv],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            sys.stderr.write(done.stderr[-3000:])
            raise SystemExit(f"mosaic_local.py {argv[0]} failed")
        return json.loads(done.stdout.strip().splitlines()[-1])

    converted = run("convert", str(tmp / "data"), str(tmp / "mds"))
    with _limited(args, out, tmp) as group:
        figures = run("read", str(tmp / "mds"), str(args.batch))
        if group is not None:
            out["mosaic_peak_mib"] = group.peak_mib()
    return {**figures, **converted}


if __name__ == "__main__":
    main()

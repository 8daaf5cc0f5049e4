"""One DDP rank of a benchmarked system: build its loader, run the epochs, return rows.

Systems that use Ray run their ranks as Ray actors placed two per node (as
Ray Train does); the others run as plain spawned processes (as torchrun does).
Both share :func:`measure_epochs`, so every system is timed the same way.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

IMAGE_PX = 224  # the usual ImageNet crop: 150 KB of uint8 per sample


def decode_resize(data: bytes) -> np.ndarray:
    """Decode + resize: real CPU per image (the JPEG set)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        small = img.convert("RGB").resize((IMAGE_PX, IMAGE_PX))
    return np.array(small, dtype=np.uint8)


def blob(data: bytes) -> np.ndarray:
    """The 4 KB set: per-sample overhead dominates."""
    return np.frombuffer(data, dtype=np.uint8).copy()


PREPROCESS = {"images": decode_resize, "blobs": blob}


def server_gets(endpoint: str) -> int:
    """GETs counted so far at the storage side (the emulator's control API)."""
    with urllib.request.urlopen(f"{endpoint}/_emulator/stats", timeout=10) as resp:
        return int(sum(json.load(resp)["gets"].values()))


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


def _nbytes(batch: Any) -> tuple[int, int]:
    """(samples, tensor bytes) of a list-of-tensors or dict-of-columns batch."""
    if isinstance(batch, dict):
        col = next(iter(batch.values()))
        return len(col), sum(int(v.numel() * v.element_size()) for v in batch.values())
    return len(batch), sum(int(t.numel() * t.element_size()) for t in batch)


def measure_epochs(
    system: str,
    rank: int,
    cfg: dict[str, Any],
    batches: Callable[[int], Iterable[Any]],
    before_epoch: Callable[[int], None] = lambda epoch: None,
) -> list[dict[str, Any]]:
    """Time ``cfg['epochs']`` epochs of ``batches(epoch)`` in lockstep with the other ranks."""
    import psutil
    import torch
    import torch.distributed as dist

    me, rows = psutil.Process(), []
    for epoch in range(cfg["epochs"]):
        before_epoch(epoch)
        dist.barrier()
        waits, cpu, n, delivered = [], [], 0, 0
        started = last = time.perf_counter()
        last_cpu = time.thread_time()
        first = None
        for batch in batches(epoch):
            now = time.perf_counter()
            waits.append(now - last)
            # The loop thread's own CPU in that wait: what the loader costs
            # when nothing else competes for the core.
            cpu.append(time.thread_time() - last_cpu)
            first = first if first is not None else now - started
            count, nbytes = _nbytes(batch)
            n, delivered = n + count, delivered + nbytes
            del batch
            time.sleep(cfg["step_ms"] / 1000)  # the "training step"
            dist.all_reduce(torch.ones(1))  # lockstep: a straggler shows
            last = time.perf_counter()
            last_cpu = time.thread_time()
        elapsed = time.perf_counter() - started
        if not waits:
            raise RuntimeError(f"{system}: rank {rank} got no batch in epoch {epoch}")
        dist.barrier()
        pss, uss = _pss_uss_mb([me.pid] + [c.pid for c in me.children(recursive=True)])
        w, c = np.asarray(waits) * 1000, np.asarray(cpu) * 1000
        rows.append(
            {
                "system": system,
                "rank": rank,
                "node": rank // cfg["ranks_per_node"],
                "epoch": epoch,
                "samples": n,
                "seconds": elapsed,
                "samples_per_s": n / elapsed,
                "first_batch_s": first,
                "wait_p50_ms": float(np.percentile(w, 50)),
                "wait_p99_ms": float(np.percentile(w, 99)),
                "wait_mean_ms": float(w.mean()),
                "wait_cpu_p50_ms": float(np.percentile(c, 50)),
                "wait_cpu_p99_ms": float(np.percentile(c, 99)),
                # Every batch's wait, so the report can pool the warm epochs.
                "waits_ms": [round(float(x), 4) for x in w],
                # Loader-only delivery: tensor bytes over the time the loop waited.
                "delivered_bytes": delivered,
                "delivery_gbps": delivered / max(float(w.sum()) / 1000, 1e-9) / 1e9,
                "pss_mb": pss,
                "uss_mb": uss,
                "server_gets": server_gets(cfg["endpoint"]) if rank == 0 else None,
            }
        )
    return rows


def _init_group(rank: int, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world"],
    )


def run_torch_rank(system: str, rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank of a system without Ray: plain s3fs, Manager dict, simplecache, LitData."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from systems import ManagerDictDataset, PlainS3Dataset, SimpleCacheDataset

    _init_group(rank, cfg)
    pre = PREPROCESS[cfg["dataset"]]
    urls, opts, workers = cfg["urls"], cfg["storage_options"], cfg["workers"]
    node = rank // cfg["ranks_per_node"]
    if system == "litdata":
        from systems import litdata_loader

        loader = litdata_loader(cfg, node, rank)
        rows = measure_epochs(system, rank, cfg, lambda epoch: loader)
        dist.destroy_process_group()
        return rows
    if system == "plain":
        ds = PlainS3Dataset(urls, opts, pre)
    elif system == "simplecache":
        ds = SimpleCacheDataset(
            # One cache directory per node and per run: every run starts cold.
            urls,
            opts,
            pre,
            cache_dir=f"{cfg['tmp']}/{cfg['namespace']}/sc-node{node}",
        )
    else:
        import multiprocessing as mp

        ds = ManagerDictDataset(urls, opts, pre, mp.Manager().dict())
    sampler = DistributedSampler(
        ds, num_replicas=cfg["world"], rank=rank, shuffle=True, seed=0
    )
    loader = DataLoader(
        ds,
        batch_size=cfg["batch_size"],
        sampler=sampler,
        collate_fn=list,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context="fork" if workers else None,
    )
    rows = measure_epochs(system, rank, cfg, lambda epoch: loader, sampler.set_epoch)
    dist.destroy_process_group()
    return rows


class RayRank:
    """A rank living in a Ray actor (shardcache, Ray Data), as under Ray Train."""

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)

    def run(self, system: str, rank: int, cfg: dict[str, Any], split: Any = None):
        import torch.distributed as dist

        _init_group(rank, cfg)
        try:
            if system == "ray_data":
                return measure_epochs(
                    system,
                    rank,
                    cfg,
                    lambda epoch: split.iter_torch_batches(
                        batch_size=cfg["batch_size"], prefetch_batches=4
                    ),
                )
            return self._shardcache(system, rank, cfg)
        finally:
            dist.destroy_process_group()

    def _shardcache(self, system: str, rank: int, cfg: dict[str, Any]):
        from torch.utils.data import DataLoader

        from shardcache import DistributedCachedDataset

        ds = DistributedCachedDataset(
            cfg["prefix"],
            preprocess=PREPROCESS[cfg["dataset"]],
            storage_options=cfg["storage_options"],
            redis_url=cfg["redis_url"],
            name=f"bench-{cfg['dataset']}",
            namespace=cfg["namespace"],
            rank=rank,
            world_size=cfg["world"],
            seed=0,
        )
        loader = DataLoader(
            ds, batch_size=cfg["batch_size"], sampler=ds.sampler, collate_fn=list
        )
        changed: list[str] = []

        def before_epoch(epoch: int) -> None:
            if epoch == cfg.get("change_before_epoch"):
                import torch.distributed as dist

                if rank == 0:  # 1% of the objects get a new version upstream
                    _rewrite(cfg["change_urls"], cfg["storage_options"])
                dist.barrier()
                changed.extend(ds.refresh())
            ds.set_epoch(epoch)

        rows = measure_epochs(system, rank, cfg, lambda epoch: loader, before_epoch)
        for r in rows:
            r["refreshed"] = len(changed)
        ds.close()
        return rows


def _rewrite(urls: list[str], storage_options: dict[str, Any]) -> None:
    """Give objects a new version with the same size (a new ETag)."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options)
    for url in urls:  # new bytes without reading the old (GETs count)
        fs.pipe_file(url, os.urandom(int(fs.size(url))))

"""One DDP rank of a benchmarked system: build its loader, run the epochs, return rows.

Systems that use Ray run their ranks as Ray actors placed ``ranks_per_node``
per node (as Ray Train does); the others run as plain spawned processes (as
torchrun does). Both share :func:`measure_epochs`, so every system is timed
the same way, and every system hands the loop a collated batch: a
``(B, C, H, W)`` / ``(B, 4096)`` tensor or a dict of them, built by the
system's own recommended path.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from memory import machine_busy_s, rss_anon, tree_anon
from samples import PREPROCESS, PREPROCESS_TAR

# A collated batch is one tensor, a dict of them, or a short tuple/list of
# them (default_collate turns ``(x, y)`` samples into ``[X, Y]``); a long list
# is per-sample views, which no training step consumes.
MAX_BATCH_FIELDS = 8
# DataLoader-based baselines can stop an epoch early (cfg["epoch_cap_s"]) so
# a full run fits its time budget; the other systems' iterators are not
# restartable mid-epoch, so they always run whole epochs.
CAPPABLE = ("plain", "manager_dict", "simplecache")


def server_gets(endpoint: str) -> int:
    """GETs counted so far at the storage side (the emulator's control API)."""
    with urllib.request.urlopen(f"{endpoint}/_emulator/stats", timeout=10) as resp:
        return int(sum(json.load(resp)["gets"].values()))


def _pss_mb(pids: list[int]) -> float:
    import psutil

    pss = 0.0
    for pid in pids:
        try:
            pss += getattr(psutil.Process(pid).memory_full_info(), "pss", 0) / 2**20
        except (psutil.Error, OSError):
            continue
    return pss


def collated_size(batch: Any, value_bytes: int) -> tuple[int, int]:
    """(samples, tensor bytes) of a collated batch; refuses anything else."""
    import torch

    if isinstance(batch, dict):
        fields = list(batch.values())
    elif isinstance(batch, list | tuple):
        fields = list(batch)
    else:
        fields = [batch]
    if not fields or len(fields) > MAX_BATCH_FIELDS:
        raise TypeError(
            f"expected a collated batch (a tensor, or a dict/tuple of them), got a "
            f"{type(batch).__name__} of {len(fields)} items: per-sample views are "
            "not what a training step consumes"
        )
    for f in fields:
        if not isinstance(f, torch.Tensor) or f.dim() < 2:
            raise TypeError(
                f"expected collated tensors with a batch dimension, got "
                f"{type(f).__name__} {getattr(f, 'shape', '')}"
            )
    n = int(fields[0].shape[0])
    x_bytes = int(fields[0].numel() * fields[0].element_size())
    if x_bytes != n * value_bytes:
        raise TypeError(
            f"batch of {n} samples holds {x_bytes} bytes, expected {value_bytes} "
            f"per sample (shape {tuple(fields[0].shape)})"
        )
    return n, sum(int(f.numel() * f.element_size()) for f in fields)


def measure_epochs(
    system: str,
    rank: int,
    cfg: dict[str, Any],
    batches: Callable[[int], Iterable[Any]],
    before_epoch: Callable[[int], None] = lambda epoch: None,
    *,
    anon_before: int,
    exclude_pids: Iterable[int] = (),
    path: str = "",
) -> list[dict[str, Any]]:
    """Time ``cfg['epochs']`` epochs of ``batches(epoch)`` in lockstep with the other ranks.

    ``anon_before`` is the rank's RssAnon (with its children) before its
    dataset was built; the rows carry the growth since then, per epoch.
    """
    import psutil
    import torch
    import torch.distributed as dist

    me, rows = psutil.Process(), []
    cap_s = cfg.get("epoch_cap_s", 0.0) if system in CAPPABLE else 0.0
    skip = list(exclude_pids)
    for epoch in range(cfg["epochs"]):
        before_epoch(epoch)
        dist.barrier()
        busy0 = machine_busy_s() if rank == 0 else 0.0
        waits, cpu, n, delivered, capped = [], [], 0, 0, False
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
            count, nbytes = collated_size(batch, cfg["value_bytes"])
            n, delivered = n + count, delivered + nbytes
            del batch
            time.sleep(cfg["step_ms"] / 1000)  # the "training step"
            # Lockstep (a straggler shows), and every rank stops together
            # when one of them is past the epoch cap.
            stop = torch.tensor([float(cap_s > 0 and now - started > cap_s)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            last = time.perf_counter()
            last_cpu = time.thread_time()
            if stop.item() > 0:
                capped = True
                break
        elapsed = time.perf_counter() - started
        if not waits:
            raise RuntimeError(f"{system}: rank {rank} got no batch in epoch {epoch}")
        dist.barrier()
        busy = machine_busy_s() - busy0 if rank == 0 else None
        pids = [
            p for p in [me.pid, *(c.pid for c in me.children(True))] if p not in skip
        ]
        w, c = np.asarray(waits) * 1000, np.asarray(cpu) * 1000
        rows.append(
            {
                "system": system,
                "path": path,
                "rank": rank,
                "node": rank // cfg["ranks_per_node"],
                "epoch": epoch,
                "samples": n,
                "batches": len(waits),
                "capped": capped,
                "seconds": elapsed,
                "samples_per_s": n / elapsed,
                "first_batch_s": first,
                # Machine-wide busy CPU seconds in this epoch (rank 0 only).
                "machine_cpu_s": busy,
                "wait_p50_ms": float(np.percentile(w, 50)),
                "wait_p99_ms": float(np.percentile(w, 99)),
                "wait_mean_ms": float(w.mean()),
                "wait_cpu_p50_ms": float(np.percentile(c, 50)),
                "wait_cpu_p99_ms": float(np.percentile(c, 99)),
                # Every batch's wait, so the report can pool the warm epochs.
                "waits_ms": [round(float(x), 4) for x in w],
                # Loader-only delivery: collated bytes over the time the loop waited.
                "delivered_bytes": delivered,
                "delivery_gbps": delivered / max(float(w.sum()) / 1000, 1e-9) / 1e9,
                "pss_mb": _pss_mb(pids),
                "rank_anon_growth_bytes": tree_anon(me.pid, skip) - anon_before,
                "server_gets": (
                    server_gets(cfg["endpoint"])
                    if rank == 0 and cfg.get("endpoint")
                    else None
                ),
            }
        )
    return rows


def _init_group(rank: int, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Imported before the memory baseline: their fixed cost is not per sample.
    import fsspec  # noqa: F401
    import PIL.Image  # noqa: F401

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world"],
    )


def run_torch_rank(system: str, rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank of a system without Ray: plain loader, Manager dict, simplecache, LitData."""
    import torch.distributed as dist

    from systems import (
        FileDataset,
        ManagerDictDataset,
        PlainS3Dataset,
        SimpleCacheDataset,
    )

    _init_group(rank, cfg)
    anon0 = tree_anon(os.getpid())
    pre = PREPROCESS[cfg["dataset"]]
    urls, opts, workers = cfg["urls"], cfg["storage_options"], cfg["workers"]
    node = rank // cfg["ranks_per_node"]
    if system == "litdata":
        from systems import litdata_loader

        loader = litdata_loader(cfg, node, rank)
        rows = measure_epochs(
            system,
            rank,
            cfg,
            lambda epoch: loader,
            anon_before=anon0,
            path="StreamingDataLoader (default collate)",
        )
        dist.destroy_process_group()
        return rows
    manager: Any = None
    if system == "plain" and cfg["source"] == "local":
        ds: Any = FileDataset(urls, pre)
    elif system == "plain":
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

        manager = mp.Manager()
        ds = ManagerDictDataset(urls, opts, pre, manager.dict())
    manager_pid = manager._process.pid if manager is not None else None
    manager_anon0 = rss_anon(manager_pid) if manager_pid else 0
    loader, sampler = distributed_loader(ds, cfg, rank)
    rows = measure_epochs(
        system,
        rank,
        cfg,
        lambda epoch: loader,
        sampler.set_epoch,
        anon_before=anon0,
        exclude_pids=[manager_pid] if manager_pid else [],
        path=f"DataLoader(num_workers={workers}, default collate)",
    )
    if manager is not None:
        # The Manager process is this rank's cache side; its values are
        # payload held in anonymous memory, so they are subtracted.
        held = len(ds.shared)
        for r in rows:
            r["cache_anon_growth_bytes"] = rss_anon(manager_pid) - manager_anon0
            r["cache_payload_bytes"] = held * cfg["value_bytes"]
        manager.shutdown()
    dist.destroy_process_group()
    return rows


def distributed_loader(ds: Any, cfg: dict[str, Any], rank: int) -> tuple[Any, Any]:
    """What most people write around a map-style Dataset: a shuffling
    ``DistributedSampler`` and ``DataLoader(num_workers=cfg["workers"])``
    (forked workers, persistent across epochs). Returns (loader, sampler)."""
    from torch.utils.data import DataLoader, DistributedSampler

    workers = cfg["workers"]
    sampler = DistributedSampler(
        ds, num_replicas=cfg["world"], rank=rank, shuffle=True, seed=0
    )
    loader = DataLoader(
        ds,
        batch_size=cfg["batch_size"],
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context="fork" if workers else None,
    )
    return loader, sampler


def shardcache_batches(
    ds: Any, batch_size: int, path: str = "auto"
) -> tuple[Callable[[int], Any], str]:
    """shardcache's own batching: ``ds.loader`` where the SDK has it (or
    ``path="loader"``), else (or ``path="dataloader"``) a DataLoader over
    ``ds.sampler`` with the default collate in the rank, ``num_workers=0``."""
    if path == "loader" or (path == "auto" and hasattr(ds, "loader")):
        loader = ds.loader(batch_size=batch_size, drop_last=False)
        return (lambda epoch: loader), "ds.loader()"
    from torch.utils.data import DataLoader

    loader = DataLoader(ds, batch_size=batch_size, sampler=ds.sampler, num_workers=0)
    return (lambda epoch: loader), "DataLoader(sampler=ds.sampler, default collate)"


def shardcache_dataset(cfg: dict[str, Any], rank: int, world: int, **kw: Any) -> Any:
    from shardcache import DistributedCachedDataset

    if cfg.get("format"):  # packed shards, read in place (no conversion step)
        kw.setdefault("format", cfg["format"])
    for key in ("chunk_samples", "shuffle_block"):
        if cfg.get(key):
            kw.setdefault(key, cfg[key])
    preprocess = PREPROCESS_TAR if cfg.get("format") == "tar" else PREPROCESS
    return DistributedCachedDataset(
        kw.pop("urls", cfg["prefix"]),
        preprocess=preprocess[cfg["dataset"]],
        storage_options=cfg["storage_options"] or None,
        redis_url=cfg["redis_url"],
        name=kw.pop("name", f"bench-{cfg['dataset']}"),
        namespace=cfg["namespace"],
        rank=rank,
        world_size=world,
        seed=0,
        **kw,
    )


class RayRank:
    """A rank living in a Ray actor (shardcache, Ray Data), as under Ray Train."""

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)

    def run(self, system: str, rank: int, cfg: dict[str, Any], split: Any = None):
        import torch.distributed as dist

        _init_group(rank, cfg)
        anon0 = tree_anon(os.getpid())
        try:
            if system == "ray_data":
                return measure_epochs(
                    system,
                    rank,
                    cfg,
                    lambda epoch: split.iter_torch_batches(
                        batch_size=cfg["batch_size"], prefetch_batches=4
                    ),
                    anon_before=anon0,
                    path="iter_torch_batches",
                )
            return self._shardcache(system, rank, cfg, anon0)
        finally:
            dist.destroy_process_group()

    def _shardcache(self, system: str, rank: int, cfg: dict[str, Any], anon0: int):
        ds = shardcache_dataset(cfg, rank, cfg["world"])
        batches, path = shardcache_batches(
            ds, cfg["batch_size"], cfg.get("shardcache_path", "auto")
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

        rows = measure_epochs(
            system, rank, cfg, batches, before_epoch, anon_before=anon0, path=path
        )
        for r in rows:
            r["refreshed"] = len(changed)
        ds.close()
        return rows


def _rewrite(urls: list[str], storage_options: dict[str, Any]) -> None:
    """Give objects a new version with the same size (a new ETag)."""
    import fsspec

    fs, _ = fsspec.url_to_fs(urls[0], **storage_options)
    for url in urls:  # new bytes without reading the old (GETs count)
        fs.pipe_file(url, os.urandom(int(fs.size(url))))

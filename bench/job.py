"""One training job of bench/many_jobs.py, started the way a user starts one.

    python -m torch.distributed.run --nproc_per_node=2 bench/job.py SYSTEM CFG.json OUT

Each rank builds its system's loader the way that system's README shows it
(shardcache: ``DistributedCachedDataset`` with embedded defaults, no
``job=``, no ``close()``, batches from ``ds.loader(B)``; plain: a map-style
Dataset over s3fs or local files with ``DataLoader(num_workers=2)`` and a
``DistributedSampler``; LitData and Mosaic: ``StreamingDataset`` with a
cache directory of the job's own), then runs ``ranks.measure_epochs`` (the harness's timed
loop: a fixed sleep and an all-reduce per step, so the two ranks run in
lockstep) and writes ``OUT.<rank>.json``: the epoch rows, the wall-clock
times the script started, got its first batch and ended, and (shardcache)
the rank's own hit and miss counts.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before torch is imported: a job's start-up counts

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

Loader = tuple[Any, Callable[[int], None], str, Any]  # loader, set_epoch, path, ds


def _shardcache(cfg: dict[str, Any], rank: int, world: int) -> Loader:
    from samples import PREPROCESS

    from shardcache import DistributedCachedDataset

    ds = DistributedCachedDataset(
        cfg["prefix"],
        preprocess=PREPROCESS[cfg["dataset"]],
        storage_options=cfg["storage_options"] or None,
    )
    return ds.loader(cfg["batch_size"]), ds.set_epoch, "ds.loader()", ds


def _plain(cfg: dict[str, Any], rank: int, world: int) -> Loader:
    from samples import PREPROCESS

    from ranks import distributed_loader
    from systems import FileDataset, PlainS3Dataset

    pre = PREPROCESS[cfg["dataset"]]
    if cfg["source"] == "local":
        ds: Any = FileDataset(cfg["urls"], pre)
    else:
        ds = PlainS3Dataset(cfg["urls"], cfg["storage_options"], pre)
    loader, sampler = distributed_loader(ds, cfg, rank)
    path = f"DataLoader(num_workers={cfg['workers']})"
    return loader, sampler.set_epoch, path, None


def _litdata(cfg: dict[str, Any], rank: int, world: int) -> Loader:
    from systems import litdata_loader

    # One cache directory per job, shared by its ranks (LitData's default
    # cache is per machine and input; each job here has its own, as its docs
    # show a job's cache_dir). litdata_loader names it after ``rank``.
    loader = litdata_loader(cfg, 0, 0)
    return loader, lambda epoch: None, "StreamingDataLoader", None


def _mosaic(cfg: dict[str, Any], rank: int, world: int) -> Loader:
    """Mosaic Streaming in .venv-mosaic (bench/mosaic.py says why): the shards
    of the one conversion, cached in a local directory of the job's own (on
    local files: read in place). It reads the layout from torchrun's env."""
    from mosaic import s3_env
    from streaming import StreamingDataLoader, StreamingDataset

    remote = cfg["mosaic_remote"]
    if remote:
        s3_env(cfg)
    ds = StreamingDataset(
        remote=remote,
        local=f"{cfg['tmp']}/mosaic-{cfg['namespace']}"
        if remote
        else cfg["mosaic_out"],
        shuffle=True,
        shuffle_seed=1,
        batch_size=cfg["batch_size"],
    )
    workers = cfg["workers"]
    loader = StreamingDataLoader(
        ds,
        batch_size=cfg["batch_size"],
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    return loader, lambda epoch: None, "StreamingDataLoader", None


LOADERS = {
    "shardcache": _shardcache,
    "plain": _plain,
    "litdata": _litdata,
    "mosaic": _mosaic,
}


def main() -> None:
    system, cfg_path, out = sys.argv[1:4]
    cfg = json.loads(Path(cfg_path).read_text())
    import torch.distributed as dist
    from memory import tree_anon

    from ranks import measure_epochs

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    anon0 = tree_anon(os.getpid())
    loader, set_epoch, path, ds = LOADERS[system](cfg, rank, world)
    first: list[float] = []

    def batches(epoch: int) -> Iterator[Any]:
        for batch in loader:
            if not first:
                first.append(time.time())
            yield batch

    rows = measure_epochs(
        system, rank, cfg, batches, set_epoch, anon_before=anon0, path=path
    )
    result = {
        "rank": rank,
        "rows": rows,
        "started": STARTED,
        "first_batch": first[0],
        "ended": time.time(),
        "pid": os.getpid(),
    }
    if ds is not None:
        stats = ds.stats()
        result.update(hits=stats["hits"], misses=stats["misses"])
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What read-only samples cost: the README's DataLoader path as it is, against
a copy per sample and against the zero-copy views it used to hand out.

Since the fix for in-place writes (``x.mul_(2)`` on a sample wrote into the
shared chunk), ``ds[i]``, ``__getitems__`` and a transform's input are
samples the caller owns. ``__getitems__`` gathers a batch in one copy into a
tensor of its own and hands out its rows; before, each sample was a copy of
its own. This times warm epochs of ``DataLoader(ds, batch_size=B,
sampler=ds.sampler)`` (``__getitems__`` then ``default_collate``: what the
training step receives) three ways, in one process on a warm cache, and
``ds.loader(B)`` (one gather, no list) beside them. The per-sample copies
and the views are reproduced inside this process only.

    PYTHONPATH=sdk:services:bench .venv/bin/python bench/readonly.py \\
        --samples 20000 --sample-bytes 4096 --batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from loader import _write  # noqa: E402
from samples import blob  # noqa: E402


def _epoch_rate(ds, batches, epochs: int) -> float:
    """Samples per second over ``epochs`` warm epochs of ``batches()``."""
    n, t = 0, 0.0
    for epoch in range(epochs):
        ds.set_epoch(1 + epoch)
        start = time.perf_counter()
        for batch in batches():
            n += len(batch)
        t += time.perf_counter() - start
    return n / t


def _per_sample(chunks, chunk_ids, rows, indices, url_of):  # noqa: ANN001, ANN202
    """``delivery.samples`` as it was: one copy (``_owned``) per sample."""
    from shardcache.delivery import sample

    return [
        sample(chunks[c], r, i, url_of)
        for c, r, i in zip(
            chunk_ids.tolist(), rows.tolist(), indices.tolist(), strict=True
        )
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--sample-bytes", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3, help="warm epochs timed")
    args = ap.parse_args()

    import ray
    import torch

    import shardcache.delivery as delivery
    from shardcache import DistributedCachedDataset
    from shardcache.embedded import start_redis_server

    tmp = Path(tempfile.mkdtemp(prefix="shardcache-readonly-"))
    _write(tmp / "data", args.samples, args.sample_bytes)
    redis_proc, redis_url = start_redis_server(tmp, password="bench")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ds = DistributedCachedDataset(
            f"{tmp / 'data'}/", preprocess=blob, redis_url=redis_url,
            namespace="readonlybench", rank=0, world_size=1, seed=0,
        )  # fmt: skip
        ds.set_epoch(0)
        for _ in ds.loader(args.batch):  # the cold epoch: builds every chunk
            pass
        dataloader = torch.utils.data.DataLoader(
            ds, batch_size=args.batch, sampler=ds.sampler
        )
        batch_gather = _epoch_rate(ds, lambda: dataloader, args.epochs)
        gathered_samples = delivery.samples
        delivery.samples = _per_sample  # the copy per sample of before
        copies = _epoch_rate(ds, lambda: dataloader, args.epochs)
        owned = delivery._owned
        delivery._owned = torch.from_numpy  # the old zero-copy views
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            views = _epoch_rate(ds, lambda: dataloader, args.epochs)
        delivery._owned = owned
        delivery.samples = gathered_samples
        gathered = _epoch_rate(ds, lambda: ds.loader(args.batch), args.epochs)
    finally:
        ray.shutdown()
        redis_proc.terminate()
    print(json.dumps({
        "command": "bench/readonly.py "
        f"--samples {args.samples} --sample-bytes {args.sample_bytes} "
        f"--batch {args.batch} --epochs {args.epochs}",
        "dataloader_batch_gather_samples_per_s": round(batch_gather),
        "dataloader_copy_per_sample_samples_per_s": round(copies),
        "dataloader_views_samples_per_s": round(views),
        "copy_cost": round(1 - batch_gather / views, 3),
        "ds_loader_samples_per_s": round(gathered),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

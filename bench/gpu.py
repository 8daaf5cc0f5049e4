"""Time to a batch on the GPU: the cache's loader against a pinned DataLoader.

Issue 30's GPU figures. What a training step on a GPU waits for is a
normalised float batch in device memory, so every path here is timed up to
that tensor, with the normalisation on the GPU (the ``fast_collate`` style:
uint8 crosses PCIe, 4x fewer bytes than float32):

* ``cache_device``: ``ds.loader(B, device="cuda")``: pinned gather, the copy
  issued one batch ahead on a side stream (``non_blocking``);
* ``cache_sync``: ``ds.loader(B)`` then ``.cuda()`` in the loop (no pinning,
  no overlap): what a user who ignores ``device=`` gets;
* ``plain_pinned_<N>w``: ``DataLoader(num_workers=N, pin_memory=True)`` over the
  same files, ``.cuda(non_blocking=True)`` in the loop.

The step is ``--step-ms`` of GPU work (a matmul loop) so a copy issued ahead
can hide behind it. Each figure is a warm epoch: samples/s and the p50/p99
time the loop waited for a device batch. Where there is no CUDA device the
script prints ``{"skipped": ...}`` and exits 0: the project never needs one.

    PYTHONPATH=sdk:services:bench .venv/bin/python bench/gpu.py --samples 4000
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from cold_readme import _Files, _write  # the same files and plain baseline

IMAGE_BYTES = 3 * 224 * 224  # (3, 224, 224) uint8: 150 KB per image


def _timed(batches, to_device, step, sums=None) -> dict[str, float]:  # noqa: ANN001
    """A warm epoch: each batch made a normalised device tensor, then a step.

    ``sums``: a list to append each batch's sum to, queued on the GPU after
    the step, so a copy that overwrote a batch the step still read shows as
    a sum that differs from the host's (checked by the caller).
    """
    import torch

    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255
    waits, n = [], 0
    torch.cuda.synchronize()
    start = last = time.perf_counter()
    for batch in batches:
        on_device = to_device(batch)
        x = on_device.float().sub_(mean).div_(std)
        torch.cuda.current_stream().synchronize()  # the batch is there
        waits.append(time.perf_counter() - last)
        n += int(x.shape[0])
        step()
        if sums is not None:
            sums.append(on_device.sum(dtype=torch.int64))
        last = time.perf_counter()
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    return {
        "samples_per_s": round(n / total, 1),
        "first_wait_ms": round(1e3 * waits[0], 3),
        "p50_wait_ms": round(1e3 * float(np.percentile(waits, 50)), 3),
        "p99_wait_ms": round(1e3 * float(np.percentile(waits, 99)), 3),
    }


def _host_sums(ds, batch: int) -> list[int]:  # noqa: ANN001
    """Each batch's sum in epoch 1, read on the host."""
    import torch

    ds.set_epoch(1)
    return [int(b.sum(dtype=torch.int64)) for b in ds.loader(batch)]


def _unsynced_sums(ds, batch: int, step) -> list[int]:  # noqa: ANN001
    """Epoch 1 to the GPU in a loop that never waits for it: each batch's
    sum is queued after the step, so an overwritten batch shows."""
    import torch

    ds.set_epoch(1)
    queued = []
    for on_device in ds.loader(batch, device="cuda"):
        step()
        queued.append(on_device.sum(dtype=torch.int64))
    return [int(v) for v in queued]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--step-ms",
        type=float,
        default=5.0,
        help="GPU work per step, as matmuls of 1024x1024 counted at ~0.1 ms each",
    )
    ap.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[2],
        help="the plain DataLoader's num_workers, one run each",
    )
    ap.add_argument(
        "--check-only",
        action="store_true",
        help="only check device batches against the host's in a loop that never waits",
    )
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (torch.cuda.is_available() "
                          "is False): nothing to measure"}))  # fmt: skip
        return
    from shardcache import DistributedCachedDataset

    work = Path(tempfile.mkdtemp(prefix="shardcache-gpu-"))
    a = torch.randn(1024, 1024, device="cuda")

    def step() -> None:
        # About --step-ms of GPU work, queued (the loop does not wait for it).
        for _ in range(max(1, int(args.step_ms / 0.1))):
            a @ a  # noqa: B018

    try:
        _write(work / "data", args.samples, IMAGE_BYTES)
        ds = DistributedCachedDataset(f"file://{work / 'data'}/*.npy")
        out: dict[str, object] = {
            "device": torch.cuda.get_device_name(0),
            "samples": args.samples,
            "batch": args.batch,
            "step_ms": args.step_ms,
        }
        ds.set_epoch(0)
        for _ in ds.loader(args.batch):  # the cold epoch fills the cache
            pass
        if args.check_only:
            # Only the race check, with a long step: the loop never waits,
            # so the copies run far ahead of the steps that read batches.
            host = _host_sums(ds, args.batch)
            unsynced = _unsynced_sums(ds, args.batch, step)
            out["unsynced_batches_equal_host"] = unsynced == host
            out["unsynced_batches_differing"] = sum(
                a != b for a, b in zip(unsynced, host, strict=True)
            )
            print(json.dumps(out, indent=1))
            return
        # Where the host side's time goes: the same warm epoch with no GPU
        # work, gathered into reused pageable buffers and into pinned ones,
        # and what one pinned batch buffer costs to allocate.
        for label, pin in (("host_pageable", False), ("host_pinned", True)):
            ds.set_epoch(1)
            t0, n = time.perf_counter(), 0
            for b in ds.loader(args.batch, pin_memory=pin):
                n += int(b.shape[0])
            out[label] = {"samples_per_s": round(n / (time.perf_counter() - t0), 1)}
        allocs = []
        for _ in range(50):
            t0 = time.perf_counter()
            t = torch.empty(
                (args.batch, IMAGE_BYTES), dtype=torch.uint8, pin_memory=True
            )
            allocs.append(time.perf_counter() - t0)
            del t
        out["pinned_alloc_p50_ms"] = round(1e3 * float(np.median(allocs)), 3)
        ds.set_epoch(1)
        sums: list = []
        out["cache_device"] = _timed(
            ds.loader(args.batch, device="cuda"), lambda b: b, step, sums
        )
        # The same epoch again on the host: every device batch must hold
        # what the host's does, also while the next copies ran beside steps.
        host = _host_sums(ds, args.batch)
        device_sums = [int(v) for v in sums]
        out["device_batches_equal_host"] = device_sums == host
        # A training loop that never waits for the GPU (no per-batch sync,
        # as most do not): the copies run ahead of steps still queued.
        out["unsynced_batches_equal_host"] = (
            _unsynced_sums(ds, args.batch, step) == host
        )
        if device_sums != host:
            out["batches_differing"] = sum(
                a != b for a, b in zip(device_sums, host, strict=False)
            ) + abs(len(device_sums) - len(host))
        ds.set_epoch(2)
        out["cache_sync"] = _timed(ds.loader(args.batch), lambda b: b.cuda(), step)
        ds.set_epoch(3)  # again, after the other: the order is not the cause
        out["cache_device_again"] = _timed(
            ds.loader(args.batch, device="cuda"), lambda b: b, step
        )
        for workers in args.workers:
            plain = torch.utils.data.DataLoader(
                _Files(work / "data"),
                batch_size=args.batch,
                shuffle=True,
                num_workers=workers,
                pin_memory=True,
                persistent_workers=True,
            )
            for _ in plain:  # its first epoch pages the files in
                pass
            out[f"plain_pinned_{workers}w"] = _timed(
                plain, lambda b: b.cuda(non_blocking=True), step
            )
            del plain
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Time to a batch on the GPU: the cache's loader against a pinned DataLoader.

Issue 30's GPU figures. What a training step on a GPU waits for is a
normalised float batch in device memory, so every path here is timed up to
that tensor, with the normalisation on the GPU (the ``fast_collate`` style:
uint8 crosses PCIe, 4x fewer bytes than float32):

* ``cache_device``: ``ds.loader(B, device="cuda")``: pinned gather, the copy
  issued one batch ahead on a side stream (``non_blocking``);
* ``cache_sync``: ``ds.loader(B)`` then ``.cuda()`` in the loop (no pinning,
  no overlap): what a user who ignores ``device=`` gets;
* ``plain_pinned``: ``DataLoader(num_workers=2, pin_memory=True)`` over the
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


def _timed(batches, to_device, step) -> dict[str, float]:  # noqa: ANN001
    """A warm epoch: each batch made a normalised device tensor, then a step."""
    import torch

    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255
    waits, n = [], 0
    torch.cuda.synchronize()
    start = last = time.perf_counter()
    for batch in batches:
        x = to_device(batch).float().sub_(mean).div_(std)
        torch.cuda.current_stream().synchronize()  # the batch is there
        waits.append(time.perf_counter() - last)
        n += int(x.shape[0])
        step()
        last = time.perf_counter()
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    return {
        "samples_per_s": round(n / total, 1),
        "p50_wait_ms": round(1e3 * float(np.percentile(waits, 50)), 3),
        "p99_wait_ms": round(1e3 * float(np.percentile(waits, 99)), 3),
    }


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
        ds.set_epoch(1)
        out["cache_device"] = _timed(
            ds.loader(args.batch, device="cuda"), lambda b: b, step
        )
        ds.set_epoch(2)
        out["cache_sync"] = _timed(ds.loader(args.batch), lambda b: b.cuda(), step)
        plain = torch.utils.data.DataLoader(
            _Files(work / "data"),
            batch_size=args.batch,
            shuffle=True,
            num_workers=2,
            pin_memory=True,
            persistent_workers=True,
        )
        for _ in plain:  # its first epoch pages the files in
            pass
        out["plain_pinned"] = _timed(
            plain, lambda b: b.cuda(non_blocking=True), step
        )
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""A cold epoch in a script that finds the cache already running.

The user's path after the demo: the embedded head and stores were started by
an earlier script, which has exited. Each run of this script writes a folder
of its own (so every chunk is cold), reads one epoch with the README's
``DataLoader(ds, batch_size=64, sampler=ds.sampler)``, and prints the first
batch's wait, the epoch's time and how many build processes the node started
during the epoch (a process whose title is ``ray::run_build`` or
``ray::BuildWorker`` not seen before the epoch began).

    PYTHONPATH=sdk:services .venv/bin/python bench/later_script.py /tmp/later/d1
    PYTHONPATH=sdk:services .venv/bin/python bench/later_script.py /tmp/later/d2
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from shardcache import DistributedCachedDataset

BUILDS = re.compile(r"^ray::(run_build|BuildWorker)")


def _build_pids() -> set[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True)
    return {
        pid
        for pid, _, args in (ln.strip().partition(" ") for ln in out.stdout.splitlines()[1:])
        if BUILDS.match(args)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--samples", type=int, default=800)
    args = ap.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    for i in range(args.samples):
        np.save(args.folder / f"{i:05d}.npy", np.full((3, 224, 224), i % 251, np.uint8))
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(_build_pids())
            time.sleep(0.05)

    ds = DistributedCachedDataset(f"file://{args.folder}/*.npy", chunk_bytes=4 << 20)
    before = _build_pids()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.perf_counter()
    first = None
    for _ in DataLoader(ds, batch_size=64, sampler=ds.sampler):
        first = first if first is not None else time.perf_counter() - started
    took = time.perf_counter() - started
    stop.set()
    watcher.join()
    print(json.dumps({
        "first_batch_s": round(first or 0.0, 2),
        "epoch_s": round(took, 2),
        "build_processes_before": len(before),
        "build_processes_started_during_epoch": len(seen - before),
    }))  # fmt: skip


if __name__ == "__main__":
    main()

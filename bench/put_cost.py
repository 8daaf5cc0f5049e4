"""What a built chunk's trip into the object store costs, by whether its pages are new.

A build task's chunk reaches the object store as the task's return value:
Ray copies it into the node's shared memory. This times that copy for a
chunk the size the cold-epoch benchmark builds (110 x (3, 224, 224) uint8,
16.5 MB) in a worker, twice: every copy kept alive (each lands in
object-store pages nobody has touched yet, as in a cold epoch) and every
copy dropped before the next (the same pages again). ``--preallocate``
starts Ray with ``RAY_preallocate_plasma_memory=1`` (the store's memory
populated when it starts). Prints one JSON line of milliseconds per put.

    .venv/bin/python bench/put_cost.py
    .venv/bin/python bench/put_cost.py --preallocate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--puts", type=int, default=40)
    parser.add_argument("--preallocate", action="store_true")
    args = parser.parse_args()
    if args.preallocate:
        os.environ["RAY_preallocate_plasma_memory"] = "1"
    import ray

    started = time.perf_counter()
    ray.init(
        num_cpus=2,
        object_store_memory=2 * 1024**3,
        include_dashboard=False,
        log_to_driver=False,
    )
    start_s = time.perf_counter() - started

    @ray.remote
    def puts(count: int, keep: bool) -> list[float]:
        chunk = {"_": np.full((110, 3, 224, 224), 7, np.uint8)}
        kept, times = [], []
        for _ in range(count):
            t = time.perf_counter()
            ref = ray.put(chunk)
            times.append((time.perf_counter() - t) * 1000)
            if keep:
                kept.append(ref)
        return times

    out = {"preallocate": args.preallocate, "ray_init_s": round(start_s, 2)}
    for name, keep in (("new_pages", True), ("reused_pages", False)):
        times = ray.get(puts.remote(args.puts, keep))[2:]  # the first two warm up
        out[name] = {
            "p50_ms": round(statistics.median(times), 2),
            "gb_per_s": round(110 * 3 * 224 * 224 / statistics.median(times) / 1e6, 2),
        }
    ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

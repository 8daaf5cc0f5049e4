"""Time to the first batch while a large prefix is still being listed.

    .venv/bin/python bench/first_batch.py --samples 100000,1000000,10000000 --latency-ms 30

The S3 emulator's synthetic bucket ``synthetic-N`` stands in for a prefix of
N objects of 100 B (LIST pages computed, 1,000 keys each, 10,000 keys per
sub-prefix; every LIST request answered after ``--latency-ms``; each
object's bytes computed on GET). Per size, a fresh user HOME: a first
script warms its embedded head (Redis, Ray, the stores and build actors),
as any script after a user's first finds them (a fresh head per size, so
the builds one size's first batch asked for never slow the next size's
listing); then a fresh process runs the
README's lines with one rank: ``DistributedCachedDataset(url)``, a
``DataLoader(ds, batch_size=64, sampler=ds.sampler)`` and its first batch,
then ``len(ds)``, which returns once the whole listing is published.
Printed per size (one JSON line): ``construct_s`` (the constructor's
return), ``first_batch_s`` (the first collated batch in hand, from the
constructor's call), ``from_prefix`` (that batch came while the listing
still ran) and ``prefix_objects`` (what the listing had published then),
and ``listing_s`` (the whole listing published: what the first batch
waited for before stream-while-listing, its lower bound then).
``gets_by_exit``: the GETs made by then (the first batch's chunks and what
the prefetch asked for next); ``most_gets_in_flight``: the most GETs the
emulator served at once. ``--get-latency-ms`` holds every object GET too
(a first batch that waits for thousands of GETs: ``--samples 8200``). The stores read with checksums off (``SHARDCACHE_VERIFY_CHECKSUM=0``): the
synthetic ETags are no MD5 of the synthetic bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def raw(data):
    return np.frombuffer(data, np.uint8)

url, options = sys.argv[1], json.loads(sys.argv[2])
t0 = time.perf_counter()
ds = DistributedCachedDataset(url, preprocess=raw, storage_options=options)
construct_s = time.perf_counter() - t0
loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=ds.sampler)
batch = next(iter(loader))
first_batch_s = time.perf_counter() - t0
from_prefix, prefix_objects = ds.manifest.is_prefix, len(ds.manifest)
n = len(ds)  # the whole listing
listing_s = time.perf_counter() - t0
print(json.dumps({
    "objects": n, "construct_s": round(construct_s, 2),
    "first_batch_s": round(first_batch_s, 2), "batch_shape": list(batch.shape),
    "from_prefix": from_prefix, "prefix_objects": prefix_objects,
    "listing_s": round(listing_s, 2),
}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", default="100000,1000000,10000000")
    ap.add_argument("--latency-ms", type=float, default=30.0)
    ap.add_argument(
        "--get-latency-ms", type=float, default=0.0,
        help="also hold every object GET this long before its first byte",
    )  # fmt: skip
    args = ap.parse_args()

    from shardcache_server.emulator import FaultPlan, S3Emulator

    root = Path(tempfile.mkdtemp(prefix="shardcache-first-batch-"))
    home = root / "home"
    home.mkdir()
    script = root / "first_batch.py"
    script.write_text(CHILD)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")},
        "HOME": str(home),
        "SHARDCACHE_VERIFY_CHECKSUM": "0",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    emu = S3Emulator().start()
    options = json.dumps(emu.storage_options())

    def run(url: str) -> dict:
        done = subprocess.run(
            [sys.executable, str(script), url, options],
            env=env, cwd=root, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        return json.loads(done.stdout.strip().splitlines()[-1])

    def stop() -> None:
        subprocess.run(
            [sys.executable, "-m", "shardcache_server.cli", "local", "stop"],
            env=env, capture_output=True, check=False,
        )  # fmt: skip

    try:
        for n in (int(s) for s in args.samples.split(",")):
            stop()
            emu.set_faults(FaultPlan())
            run("s3://synthetic-5000/")  # the head, stores and build actors start
            emu.set_faults(
                FaultPlan(
                    list_latency_s=args.latency_ms / 1000,
                    latency_s=args.get_latency_ms / 1000,
                )
            )
            emu.reset_counts()
            gets0 = emu.total_gets
            lists0 = emu.lists
            started = time.time()
            result = run(f"s3://synthetic-{n}/")
            print(
                json.dumps(
                    {**result, "list_requests": emu.lists - lists0,
                     "gets_by_exit": emu.total_gets - gets0,
                     "most_gets_in_flight": emu.most_in_flight,
                     "latency_ms": args.latency_ms, "get_latency_ms": args.get_latency_ms,
                     "wall_s": round(time.time() - started, 1),
                     "load_avg_1m": round(os.getloadavg()[0], 1), "cpus": os.cpu_count()}
                ),
                flush=True,
            )  # fmt: skip
    finally:
        stop()
        emu.stop()


if __name__ == "__main__":
    main()

"""What listing a source costs: time, CPU, requests, peak memory, bytes kept per object.

    .venv/bin/python bench/listing.py --source local --samples 100000 --dir /tmp/scale
    .venv/bin/python bench/listing.py --source emulator --samples 1000000 --latency-ms 30

``local`` lists ``--samples`` files of 100 B (written as bench/scale.py
writes them, 10,000 per directory, reused when present); ``emulator``
lists the S3 emulator's synthetic bucket (``synthetic-N``: LIST pages
computed, nothing stored; keys 10,000 per sub-prefix) with a fixed
``--latency-ms`` added to every LIST request. Each listing runs in a fresh
child process, so its peak is its own: ``peak_bytes_per_object`` is the
growth of the child's peak RSS (``VmHWM``, reset before listing) over its
RSS before, per object; ``kept_bytes_per_object`` is the published
manifest's arrays. ``--find`` also measures the old way
(``fs.find(detail=True)``, one dict per object) for comparison. ``--fan-out``
lists in a child that is a Ray driver (a local Ray instance of all the
machine's CPUs, started before the clock) with groups of sub-prefixes sent
to Ray tasks, as the stores list (``list_fanout.py``); its ``cpu_s`` is the
child's own, ``machine_cpu_s`` every process's (the emulator's too). Since
nothing can be read before the listing is published, ``list_s`` bounds the
time to the first batch from below. Prints one JSON line per run.
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
from typing import Any

HERE = Path(__file__).resolve().parent


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _child(args: argparse.Namespace) -> None:
    """List once in this (fresh) process and print what it cost."""
    import fsspec

    from shardcache_server.objects import list_source

    options = json.loads(args.options)
    fsspec.filesystem("file")  # imports done before the baseline
    fan_out = None
    if args.fan_out:
        import ray

        from shardcache_server.list_fanout import FanOut

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        fan_out = FanOut(options, None)
    if args.url.startswith("s3://"):
        import s3fs  # noqa: F401
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    rss0 = _status("VmRSS")
    wall0, cpu0, busy0 = time.perf_counter(), time.process_time(), _busy_s()
    if args.find:
        fs, path = fsspec.url_to_fs(args.url, **options)
        listed = fs.find(path, detail=True)
        n, kept = len(listed), 0
    else:
        manifest = list_source(args.url, options, None, fan_out)
        n = len(manifest)
        kept = sum(a.nbytes for a in manifest.columns.values())
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    busy = _busy_s() - busy0
    print(
        json.dumps(
            {
                "objects": n,
                "list_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "machine_cpu_s": round(busy, 2),
                "peak_bytes_per_object": round((_status("VmHWM") - rss0) / n, 1),
                "kept_bytes_per_object": round(kept / n, 1) if kept else None,
            }
        )
    )


def _busy_s() -> float:
    """CPU seconds every process of the machine has spent (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _run_child(
    url: str, options: dict[str, Any], find: bool, fan_out: bool = False
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--url", url]
    cmd += ["--options", json.dumps(options)] + (["--find"] if find else [])
    cmd += ["--fan-out"] if fan_out else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--source", choices=["local", "emulator"], default="local")
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--dir", default=None, help="local files (default: a temp dir)")
    ap.add_argument("--latency-ms", type=float, default=30.0)
    ap.add_argument(
        "--find", action="store_true", help="also time fs.find(detail=True)"
    )
    ap.add_argument(
        "--fan-out", action="store_true", help="list sub-prefix groups in Ray tasks"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    runs = []
    if args.source == "local":
        sys.path.insert(0, str(HERE))
        from scale import write_samples

        root = Path(args.dir or tempfile.mkdtemp(prefix="shardcache-listing-"))
        files = root / f"n{args.samples}-b100"
        marker = root / f"{files.name}.done"
        if not marker.exists():
            write_samples(files, args.samples, 100)
            marker.write_text("")
        url, options = f"{files}/", {}
        runs.append(("streaming", _run_child(url, options, False)))
        if args.find:
            runs.append(("fsspec find", _run_child(url, options, True)))
        extra: dict[str, Any] = {}
    else:
        from shardcache_server.emulator import FaultPlan, S3Emulator

        emu = S3Emulator().start()
        emu.set_faults(FaultPlan(list_latency_s=args.latency_ms / 1000))
        try:
            url = f"s3://synthetic-{args.samples}/"
            how = "streaming, fanned out to Ray tasks" if args.fan_out else "streaming"
            options = emu.storage_options()
            runs.append((how, _run_child(url, options, False, args.fan_out)))
            extra = {"list_requests": emu.lists, "latency_ms": args.latency_ms}
        finally:
            emu.stop()
    for how, result in runs:
        print(
            json.dumps(
                {"source": args.source, "how": how, **result, **extra,
                 "load_avg_1m": round(os.getloadavg()[0], 1), "cpus": os.cpu_count()}
            )
        )  # fmt: skip


if __name__ == "__main__":
    main()

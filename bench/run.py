"""Side-by-side benchmark: shardcache vs what users would pick instead, in one run.

    scripts/bench.sh                      # full run: both sources, BENCHMARKS.md
    scripts/bench.sh --quick              # small smoke run, written to a temp dir

Two source profiles: ``s3`` (moto behind the emulator's seeded latency model;
GETs counted at the server) and ``local`` (the same datasets as files on
local disk, page cache warm, no latency: the cold epoch is CPU bound). Ranks
are gloo processes; each "training step" is a fixed sleep plus an
all-reduce, so ranks run in lockstep and stragglers show. Every system hands
the loop a collated batch built by its own recommended path.

This module is the command line and the run loop; ``scenarios.py`` says what
runs with which settings, ``prepare.py`` writes the data, ``launch.py`` runs
one system (its ranks live in ``ranks.py`` and ``systems.py``), and
``report.py`` writes BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
# The emulator's fake credentials, for clients that only read the environment.
for _k, _v in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}.items():
    os.environ.setdefault(_k, _v)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Every Ray worker (the ranks of the Ray-based systems) imports bench/ modules.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
)

from launch import Context, raylet_pids, run_system  # noqa: E402
from prepare import memcpy_gbps, prepare_local, prepare_s3  # noqa: E402
from samples import VALUE_BYTES  # noqa: E402
from scenarios import DATASETS, QUICK_SYSTEMS, SCENARIOS, SYSTEMS, run_config  # noqa: E402

MIN_WARM_BATCHES = 100  # per rank, so a warm p99 is not a maximum


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="small smoke run, fewer systems"
    )
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--blobs", type=int, default=20000)
    ap.add_argument("--epochs", type=int, default=3, help="1 cold + the rest warm")
    ap.add_argument("--image-px", type=int, default=470, help="JPEG side in pixels")
    ap.add_argument("--batch-images", type=int, default=16)
    ap.add_argument("--batch-blobs", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions")
    ap.add_argument("--sources", default="s3,local", help="comma list of: s3, local")
    ap.add_argument(
        "--profile",
        default="s3-standard",
        choices=["none", "s3-standard", "slow", "express"],
        help="latency model of the s3 source",
    )
    ap.add_argument(
        "--bandwidth-mb-s",
        type=float,
        default=0.0,
        help="cap each GET's body rate, MB/s per connection (0: no cap)",
    )
    ap.add_argument("--nodes", type=int, default=2, help="Ray nodes on this machine")
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument(
        "--lean-ranks-per-node",
        type=int,
        default=1,
        help="a second layout for the latency-consistency figures, with no more "
        "ranks than cores (0: none)",
    )
    ap.add_argument(
        "--lean-systems",
        default="shardcache",
        help="systems also run in the lean layout (comma list)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="DataLoader workers per rank of the DataLoader-based systems",
    )
    ap.add_argument(
        "--epoch-cap-s",
        type=float,
        default=240.0,
        help="stop an epoch of plain/manager_dict/simplecache after this many "
        "seconds, all ranks together (0: whole epochs); capped epochs are flagged",
    )
    ap.add_argument(
        "--shardcache-path",
        default="auto",
        choices=["auto", "loader", "dataloader"],
        help="shardcache's batching: ds.loader() (auto: when the SDK has it) or "
        "DataLoader(ds, sampler=ds.sampler) with the default collate",
    )
    ap.add_argument("--object-store-mb", type=int, default=1024, help="per Ray node")
    ap.add_argument("--systems", default=None, help="comma list (default: all)")
    ap.add_argument(
        "--out",
        default=None,
        help="directory for the JSON, PNG and BENCHMARKS.md (default: bench/results/ "
        "and the repository's BENCHMARKS.md; --quick: a new temp directory)",
    )
    args = ap.parse_args()
    if args.quick:
        args.images, args.blobs, args.reps = 160, 1024, 1
        args.systems = args.systems or ",".join(QUICK_SYSTEMS)
        args.out = args.out or tempfile.mkdtemp(prefix="shardcache-bench-quick-")
    args.systems = args.systems or ",".join(SYSTEMS + SCENARIOS)
    return args


def _layouts(
    args: argparse.Namespace, systems: list[str]
) -> list[tuple[int, list[str]]]:
    layouts = [(args.ranks_per_node, systems)]
    if args.lean_ranks_per_node and args.lean_ranks_per_node != args.ranks_per_node:
        lean = [s for s in args.lean_systems.split(",") if s in systems]
        if lean:
            layouts.append((args.lean_ranks_per_node, lean))
    return layouts


def main() -> None:
    args = _parse_args()

    import ray

    from shardcache.embedded import start_loopback_cluster, start_redis_server

    systems = args.systems.split(",")
    sources = args.sources.split(",")
    batch = {"images": args.batch_images, "blobs": args.batch_blobs}
    counts = {"images": args.images, "blobs": args.blobs}
    world = args.nodes * args.ranks_per_node
    for d in DATASETS:
        warm = (args.epochs - 1) * (counts[d] // world // batch[d])
        if warm < MIN_WARM_BATCHES:
            print(f"note: {d}: {warm} warm batches per rank (< {MIN_WARM_BATCHES})")
    tmp = tempfile.mkdtemp(prefix="shardcache-bench-")
    redis_proc, redis_url = start_redis_server(Path(tmp), password="bench")
    emulator, fs, calibration = None, None, None
    sizes: dict[str, float] = {}
    if "s3" in sources:
        emulator, fs, calibration, sizes = prepare_s3(args, systems)
    local_root = Path(tmp) / "local"
    if "local" in sources:
        sizes = prepare_local(local_root, args)
    memcpy_runs = {d: [memcpy_gbps(batch[d] * VALUE_BYTES[d])] for d in DATASETS}
    cpus_per_node = max(2, (os.cpu_count() or 2) // args.nodes)
    cluster = start_loopback_cluster(
        args.nodes, args.object_store_mb * 2**20, cpus_per_node
    )
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    # The spawned torch ranks join this cluster: the SDK never joins one it
    # finds by "auto" unless told to.
    os.environ["RAY_ADDRESS"] = cluster.address
    ctx = Context(emulator, redis_url, raylet_pids(cluster))
    results: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for source in sources:
                for dataset in DATASETS:
                    for rpn, layout_systems in _layouts(args, systems):
                        for system in layout_systems:
                            cfg = run_config(
                                args, rep, source, dataset, system, rpn, tmp,
                                redis_url, emulator, fs, local_root,
                            )  # fmt: skip
                            if cfg is None:
                                continue
                            label = f"{cfg['layout']} {source} {dataset} {system}"
                            print(f"rep {rep} {label:40s} ...", end=" ", flush=True)
                            t = time.perf_counter()
                            try:
                                rows = run_system(system, cfg, ctx)
                            except (
                                Exception
                            ) as exc:  # one system failing must not sink the run
                                print(
                                    f"FAILED: {type(exc).__name__}: {exc}", flush=True
                                )
                                results.append(
                                    {"rep": rep, "source": source, "dataset": dataset,
                                     "layout": cfg["layout"], "system": system,
                                     "error": f"{type(exc).__name__}: {exc}"[:500]}
                                )  # fmt: skip
                                continue
                            for r in rows:
                                r.update(
                                    {"rep": rep, "source": source, "dataset": dataset,
                                     "layout": cfg["layout"]}
                                )  # fmt: skip
                            results += rows
                            print(f"{time.perf_counter() - t:.0f}s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if emulator is not None:
            emulator.stop()
        redis_proc.terminate()
    for d in DATASETS:  # the reference again at the end: the best of both
        memcpy_runs[d].append(memcpy_gbps(batch[d] * VALUE_BYTES[d]))
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["scripts/bench.sh", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "sources": sources,
        "profile": args.profile,
        "bandwidth_mb_s": args.bandwidth_mb_s,
        "storage_calibration": calibration,
        "object_bytes": sizes,
        "value_bytes": VALUE_BYTES,
        "batch_size": batch,
        "workers": args.workers,
        "epoch_cap_s": args.epoch_cap_s,
        "memcpy_gbps": {d: max(v) for d, v in memcpy_runs.items()},
        "memcpy_runs_gbps": memcpy_runs,
        "nodes": args.nodes,
        "cpus_per_ray_node": cpus_per_node,
        "layout": f"{args.nodes} Ray nodes x {args.ranks_per_node} ranks (gloo)",
        "rows": results,
    }
    _write(report, args)


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    from report import write_report

    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path, md = out / f"{stamp}.json", out / "BENCHMARKS.md"
    else:
        path, md = HERE / "results" / f"{stamp}.json", HERE.parent / "BENCHMARKS.md"
    path.write_text(json.dumps(report, indent=1))
    write_report(report, md, path.with_suffix(".png"))
    print(f"wrote {path}, {path.with_suffix('.png')} and {md}")


if __name__ == "__main__":
    main()

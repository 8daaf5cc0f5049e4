"""Side-by-side benchmark: shardcache vs what users would pick instead, in one run.

    scripts/bench.sh                      # full run, writes bench/results/<date>.json + BENCHMARKS.md
    scripts/bench.sh --quick              # a small smoke run

Storage is moto's S3 behind the emulator's seeded latency model; GETs are
counted at the server. Ranks are gloo processes; each "training step" is a
fixed sleep plus an all-reduce, so ranks run in lockstep and stragglers show.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import queue
import socket
import subprocess
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

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Every Ray worker (the ranks of the Ray-based systems) imports bench/ modules.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
)
NODES, RANKS_PER_NODE = 2, 2
SYSTEMS = (
    "plain",
    "manager_dict",
    "simplecache",
    "ray_data",
    "litdata",
    "mosaic",
    "shardcache",
)
# Mosaic Streaming runs in an environment of its own (bench/mosaic.py says why).
MOSAIC_PYTHON = HERE.parent / ".venv-mosaic" / "bin" / "python"
# shardcache under a cache holding half the dataset, and with 1% changed upstream.
SCENARIOS = ("shardcache_lru50", "shardcache_static50", "shardcache_changed1")
RAY_SYSTEMS = ("ray_data", "shardcache", *SCENARIOS)


def _torch_rank(system: str, rank: int, cfg: dict[str, Any], out: Any) -> None:
    from ranks import run_torch_rank

    out.put(run_torch_rank(system, rank, cfg))


def memcpy_gbps(nbytes_per_sample: int, samples: int) -> float:
    src = np.random.default_rng(0).integers(
        0, 255, nbytes_per_sample * samples, dtype=np.uint8
    )
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best / 1e9


def calibrate_storage(emulator: Any, fs: Any, url: str) -> dict[str, float]:
    """moto's own service time with no latency model: sequential GET time,
    GET/s with 16 concurrent clients, and storage-side CPU per GET."""
    from concurrent.futures import ThreadPoolExecutor

    from shardcache_server.emulator import FaultPlan

    emulator.set_faults(FaultPlan())
    fs.cat_file(url)  # warm the connection
    times = []
    for _ in range(100):
        started = time.perf_counter()
        fs.cat_file(url)
        times.append(time.perf_counter() - started)
    emulator.reset_counts()
    started = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: fs.cat_file(url), range(400)))
    elapsed = time.perf_counter() - started
    return {
        "sequential_get_ms_p50": float(np.median(times) * 1000),
        "concurrent16_gets_per_s": 400 / elapsed,
        "storage_cpu_ms_per_get": emulator.cpu_s / max(emulator.total_gets, 1) * 1000,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_processes(system: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_torch_rank, args=(system, r, cfg, out))
        for r in range(cfg["world"])
    ]
    for p in procs:
        p.start()
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + 600  # a hung system costs 10 minutes, not the run
    while len(rows) < cfg["world"] * cfg["epochs"]:
        try:
            rows += out.get(timeout=5)
        except queue.Empty as exc:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"{system}: a rank failed (exit codes {failed}); see stderr above"
                ) from exc
    for p in procs:
        p.join(timeout=120)
    return rows


def _ray_data_splits(cfg: dict[str, Any]) -> tuple[list[Any], float]:
    """read_binary_files + map(preprocess) + materialize(), split per rank."""
    import pyarrow.fs
    import ray

    from ranks import PREPROCESS

    pre = PREPROCESS[cfg["dataset"]]
    endpoint = cfg["endpoint"]
    fs = pyarrow.fs.S3FileSystem(
        access_key="testing",
        secret_key="testing",
        endpoint_override=endpoint.split("://", 1)[1],
        scheme="http",
        region="us-east-1",
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    started = time.perf_counter()
    ds = (
        ray.data.read_binary_files(cfg["prefix"].removeprefix("s3://"), filesystem=fs)
        .map(lambda row: {"x": pre(row["bytes"])})
        .materialize()
    )
    return ds.streaming_split(cfg["world"], equal=True), time.perf_counter() - started


def _run_ray_ranks(system: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import ray

    from ranks import RayRank

    env = {"SHARDCACHE_" + k.upper(): str(v) for k, v in cfg["store_env"].items()}
    splits: list[Any] = [None] * cfg["world"]
    if system == "ray_data":
        splits, cfg["prepare_s"] = _ray_data_splits(cfg)
    actor = ray.remote(RayRank)
    ranks = [
        actor.options(
            num_cpus=0,
            resources={f"node{r // RANKS_PER_NODE}": 0.01},
            runtime_env={"env_vars": env},
        ).remote(env)
        for r in range(cfg["world"])
    ]
    try:
        per_rank = ray.get(
            [a.run.remote(system, r, cfg, splits[r]) for r, a in enumerate(ranks)],
            timeout=1800,
        )
    finally:
        for a in ranks:
            ray.kill(a)
    return [row for rows in per_rank for row in rows]


# Each emulated node of Mosaic gets a private /dev/shm, as a real machine has
# (bench/mosaic.py says why).
_OWN_SHM = ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=4g tmpfs /dev/shm && exec "$0" "$@"']  # fmt: skip


def _mosaic(
    cfg: dict[str, Any], *args: str, own_shm: bool = False
) -> subprocess.Popen[bytes]:
    if not MOSAIC_PYTHON.exists():
        raise RuntimeError(
            f"{MOSAIC_PYTHON} is missing; scripts/bench.sh creates it (torch 2.14.1, "
            "torchvision 0.29.1, mosaicml-streaming)"
        )
    path = Path(cfg["tmp"]) / f"{cfg['namespace']}.json"
    path.write_text(json.dumps(cfg))
    command = [
        str(MOSAIC_PYTHON),
        str(HERE / "mosaic.py"),
        args[0],
        str(path),
        *args[1:],
    ]
    return subprocess.Popen((_OWN_SHM if own_shm else []) + command)


def _wait_all(system: str, procs: list[subprocess.Popen[bytes]], timeout_s: float):
    deadline = time.monotonic() + timeout_s  # a hung system costs this, not the run
    try:
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{system}: timed out after {timeout_s:.0f}s") from exc
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(
            f"{system}: a process failed (exit codes {codes}); see stderr above"
        )


def _run_mosaic_ranks(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    out_dir = Path(cfg["tmp"]) / f"{cfg['namespace']}-rows"
    out_dir.mkdir()
    nodes = range(cfg["world"] // cfg["ranks_per_node"])
    _wait_all(
        "mosaic",
        [_mosaic(cfg, "node", str(n), str(out_dir), own_shm=True) for n in nodes],
        600,
    )
    return [
        row
        for r in range(cfg["world"])
        for row in json.loads((out_dir / f"rank{r}.json").read_text())
    ]


def _litdata_convert(cfg: dict[str, Any]) -> None:
    """LitData's optimize(): chunks uploaded next to the source."""
    import s3fs

    from systems import litdata_convert

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **cfg["storage_options"])
    cfg["litdata_prefix"] = litdata_convert(cfg, fs)


def _mosaic_convert(cfg: dict[str, Any]) -> None:
    """Mosaic's MDSWriter, in Mosaic's own environment."""
    _wait_all("mosaic conversion", [_mosaic(cfg, "convert")], 600)


CONVERSIONS = {"litdata": _litdata_convert, "mosaic": _mosaic_convert}


def run_system(system: str, cfg: dict[str, Any], emulator: Any) -> list[dict[str, Any]]:
    emulator.reset_counts()
    cfg = {**cfg, "port": _free_port(), "prepare_s": 0.0, "prepare_gets": 0}
    if system in CONVERSIONS:  # a conversion step before training, timed apart
        started = time.perf_counter()
        CONVERSIONS[system](cfg)
        cfg["prepare_s"] = time.perf_counter() - started
        cfg["prepare_gets"] = emulator.total_gets
    if system == "mosaic":
        rows = _run_mosaic_ranks(cfg)
    elif system in RAY_SYSTEMS:
        rows = _run_ray_ranks(system, cfg)
    else:
        rows = _run_processes(system, cfg)
    gets, storage_cpu_s = emulator.total_gets, emulator.cpu_s
    for r in rows:
        r["storage_cpu_s"] = storage_cpu_s
        # Every GET of the job, conversion included; prepare_* is reported apart.
        r["gets_per_object"] = gets / len(cfg["urls"])
        r["prepare_s"], r["prepare_gets"] = cfg["prepare_s"], cfg["prepare_gets"]
        if r["epoch"] == 0:
            # A system that converts or materialises first pays for it in epoch 1.
            r["seconds"] += cfg["prepare_s"]
            r["first_batch_s"] += cfg["prepare_s"]
            r["samples_per_s"] = r["samples"] / r["seconds"]
    return rows


def _scenario_env(system: str, dataset: str, values_bytes: int) -> dict[str, Any]:
    """Store settings of a scenario: a per-node budget of half its share of values."""
    if system in ("shardcache_lru50", "shardcache_static50"):
        return {
            "cache_bytes": values_bytes // (2 * NODES),
            "eviction": "static" if "static" in system else "lru",
            # The rank pins nothing, so the store's budget is all there is.
            "hold_bytes": 0,
        }
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--blobs", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--image-px", type=int, default=470, help="JPEG side in pixels")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument(
        "--profile",
        default="s3-standard",
        choices=["none", "s3-standard", "slow", "express"],
    )
    ap.add_argument(
        "--bandwidth-mb-s",
        type=float,
        default=0.0,
        help="cap each GET's body rate, MB/s per connection (0: no cap)",
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS + SCENARIOS))
    args = ap.parse_args()
    if args.quick:
        args.images, args.blobs, args.reps = 200, 600, 1

    import ray
    import s3fs

    from shardcache.embedded import start_loopback_cluster, start_redis_server
    from shardcache_server.datagen import upload_blobs, upload_images
    from shardcache_server.emulator import LATENCY_PROFILES, S3Emulator

    from ranks import IMAGE_PX

    systems = args.systems.split(",")
    tmp = tempfile.mkdtemp(prefix="shardcache-bench-")
    redis_proc, redis_url = start_redis_server(Path(tmp), password="bench")
    emulator = S3Emulator().start()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **emulator.storage_options())
    fs.mkdir("bench")
    print(f"generating {args.images} JPEGs and {args.blobs} 4 KB blobs ...", flush=True)
    upload_images(fs, "bench/images", args.images, size=args.image_px, fmt="JPEG")
    upload_blobs(fs, "bench/blobs", args.blobs, 4096)
    counts = {"images": args.images, "blobs": args.blobs}
    sizes = {"images": fs.du("bench/images") / args.images, "blobs": 4096}
    value_bytes = {"images": IMAGE_PX * IMAGE_PX * 3, "blobs": 4096}  # preprocessed
    calibration = calibrate_storage(emulator, fs, f"s3://{fs.find('bench/images')[0]}")
    print(f"storage calibration: {calibration}", flush=True)
    emulator.set_faults(
        dataclasses.replace(
            LATENCY_PROFILES[args.profile],
            bandwidth_bytes_per_s=args.bandwidth_mb_s * 1e6,
        )
    )
    # 2 Ray nodes on this machine, 2 ranks each (ray.cluster_utils.Cluster).
    cluster = start_loopback_cluster(NODES, 512 * 2**20)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    results: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for dataset in ("images", "blobs"):
                prefix = f"s3://bench/{dataset}/"
                urls = sorted(f"s3://{p}" for p in fs.find(prefix))
                for system in systems:  # interleaved: every system once per repetition
                    if system == "shardcache_changed1" and dataset != "blobs":
                        continue  # rewriting a JPEG's bytes would not decode
                    cfg = {
                        "dataset": dataset,
                        "prefix": prefix,
                        "urls": urls,
                        "storage_options": emulator.storage_options(),
                        "endpoint": emulator.endpoint_url,
                        "redis_url": redis_url,
                        # A fresh cache per run: every run starts cold.
                        "namespace": f"bench{rep}{dataset[0]}{system.replace('_', '')}",
                        "store_env": _scenario_env(
                            system, dataset, value_bytes[dataset] * counts[dataset]
                        ),
                        "epochs": args.epochs,
                        "world": NODES * RANKS_PER_NODE,
                        "ranks_per_node": RANKS_PER_NODE,
                        "batch_size": 32 if dataset == "images" else 128,
                        "workers": 2,
                        "step_ms": 2.0,
                        "tmp": tmp,
                    }
                    if system == "shardcache_changed1":
                        step = max(1, len(urls) // max(1, len(urls) // 100))
                        cfg["change_urls"] = urls[::step][: max(1, len(urls) // 100)]
                        cfg["change_before_epoch"] = args.epochs - 1
                    print(
                        f"rep {rep} {dataset:6s} {system:20s} ...", end=" ", flush=True
                    )
                    t = time.perf_counter()
                    try:
                        rows = run_system(system, cfg, emulator)
                    except Exception as exc:  # one system failing must not sink the run
                        print(f"FAILED: {type(exc).__name__}: {exc}", flush=True)
                        results.append(
                            {"rep": rep, "dataset": dataset, "system": system,
                             "error": f"{type(exc).__name__}: {exc}"[:500]}
                        )  # fmt: skip
                        continue
                    for r in rows:
                        r.update({"rep": rep, "dataset": dataset})
                    results += rows
                    print(f"{time.perf_counter() - t:.0f}s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        emulator.stop()
        redis_proc.terminate()
    # memcpy of the bytes each system delivers (the preprocessed tensors).
    memcpy = {d: memcpy_gbps(value_bytes[d], 1000) for d in value_bytes}
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["scripts/bench.sh", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "profile": args.profile,
        "bandwidth_mb_s": args.bandwidth_mb_s,
        "storage_calibration": calibration,
        "object_bytes": sizes,
        "memcpy_gbps": memcpy,
        "layout": f"{NODES} Ray nodes x {RANKS_PER_NODE} ranks (gloo)",
        "rows": results,
    }
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    path = HERE / "results" / f"{stamp}.json"
    path.write_text(json.dumps(report, indent=1))
    from report import write_report

    write_report(
        report, HERE.parent / "BENCHMARKS.md", HERE / "results" / f"{stamp}.png"
    )
    print(f"wrote {path} and BENCHMARKS.md")


if __name__ == "__main__":
    main()

"""Side-by-side benchmark: shardcache vs what users would pick instead, in one run.

    scripts/bench.sh                      # full run: both sources, BENCHMARKS.md
    scripts/bench.sh --quick              # small smoke run, written to a temp dir

Two source profiles: ``s3`` (moto behind the emulator's seeded latency model;
GETs counted at the server) and ``local`` (the same datasets as files on
local disk, page cache warm, no latency: the cold epoch is CPU bound). Ranks
are gloo processes; each "training step" is a fixed sleep plus an
all-reduce, so ranks run in lockstep and stragglers show. Every system hands
the loop a collated batch built by its own recommended path.
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
SYSTEMS = (
    "plain",
    "manager_dict",
    "simplecache",
    "ray_data",
    "litdata",
    "mosaic",
    "shardcache",
    "shardcache_tar",
)
QUICK_SYSTEMS = ("plain", "ray_data", "shardcache")
# Caching a local file on local disk measures nothing.
REMOTE_ONLY = ("simplecache",)
# Mosaic Streaming runs in an environment of its own (bench/mosaic.py says why).
MOSAIC_PYTHON = HERE.parent / ".venv-mosaic" / "bin" / "python"
# shardcache under a cache holding half the dataset, and with 1% changed
# upstream; run on the s3 source, where GETs are counted.
SCENARIOS = (
    "shardcache_lru50",
    "shardcache_static50",
    "shardcache_clairvoyant50",
    "shardcache_changed1",
)
HALF_CACHE = {  # scenario -> eviction policy, each at half of the node's share
    "shardcache_lru50": "lru",
    "shardcache_static50": "static",
    "shardcache_clairvoyant50": "clairvoyant",
}
# A real dataset is thousands of chunks; at the default 4,096 samples the 20,000
# blobs are 5, and a half-share budget would hold one. The half-cache scenarios
# cut the data in smaller chunks (~30-40 per node) so a policy has choices,
# and shuffle in blocks of about two chunks (shuffle_block): with the whole
# shard shuffled, every batch touches most of a rank's chunks and a cache of
# half of them rebuilds chunks in every batch whatever the policy (measured:
# 21 GETs per object by the second epoch of lru50 on the images).
HALF_CACHE_CHUNK_SAMPLES = {"blobs": 256, "images": 64}
HALF_CACHE_SHUFFLE_BLOCK = {"blobs": 512, "images": 128}
# The same datasets as WebDataset tar shards, read in place by format="tar".
PACKED = {"shardcache_tar": "tar"}
TAR_SAMPLES_PER_SHARD = {"images": 250, "blobs": 1000}
RAY_SYSTEMS = ("ray_data", "shardcache", *PACKED, *SCENARIOS)
DATASETS = ("images", "blobs")
MIN_WARM_BATCHES = 100  # per rank, so a warm p99 is not a maximum
MEMCPY_BYTES = 256 * 2**20  # source of the memcpy reference: well past the caches


def _torch_rank(system: str, rank: int, cfg: dict[str, Any], out: Any) -> None:
    from ranks import run_torch_rank

    out.put(run_torch_rank(system, rank, cfg))


def memcpy_gbps(batch_bytes: int) -> float:
    """Batch-sized copies into freshly allocated tensors on one thread, out of
    a source larger than the caches: what collating the same bytes costs at
    memory bandwidth. Best of 3 passes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks collate on one thread
    try:
        n = max(4, MEMCPY_BYTES // batch_bytes)
        src = torch.randint(0, 255, (n, batch_bytes), dtype=torch.uint8)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for i in range(n):
                torch.empty(batch_bytes, dtype=torch.uint8).copy_(src[i])
            best = min(best, time.perf_counter() - started)
        return n * batch_bytes / best / 1e9
    finally:
        torch.set_num_threads(threads)


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
    deadline = time.monotonic() + 1800  # a hung system costs 30 minutes, not the run
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


def _ray_data_splits(cfg: dict[str, Any]) -> list[Any]:
    """read_binary_files + map(preprocess) + materialize(), split per rank."""
    import ray
    from memory import machine_busy_s

    from ranks import PREPROCESS

    pre = PREPROCESS[cfg["dataset"]]
    kwargs: dict[str, Any] = {}
    path = cfg["prefix"]
    if cfg["source"] == "s3":
        import pyarrow.fs

        kwargs["filesystem"] = pyarrow.fs.S3FileSystem(
            access_key="testing",
            secret_key="testing",
            endpoint_override=cfg["endpoint"].split("://", 1)[1],
            scheme="http",
            region="us-east-1",
        )
        path = path.removeprefix("s3://")
    ray.data.DataContext.get_current().enable_progress_bars = False
    started, busy0 = time.perf_counter(), machine_busy_s()
    ds = (
        ray.data.read_binary_files(path, **kwargs)
        .map(lambda row: {"x": pre(row["bytes"])})
        .materialize()
    )
    cfg["prepare_s"] = time.perf_counter() - started
    cfg["prepare_cpu_s"] = machine_busy_s() - busy0
    return ds.streaming_split(cfg["world"], equal=True)


def _run_ray_ranks(system: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import ray

    from ranks import RayRank

    env = {"SHARDCACHE_" + k.upper(): str(v) for k, v in cfg["store_env"].items()}
    splits: list[Any] = [None] * cfg["world"]
    if system == "ray_data":
        splits = _ray_data_splits(cfg)
    actor = ray.remote(RayRank)
    ranks = [
        actor.options(
            num_cpus=0,
            resources={f"node{r // cfg['ranks_per_node']}": 0.01},
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
        1800,
    )
    return [
        row
        for r in range(cfg["world"])
        for row in json.loads((out_dir / f"rank{r}.json").read_text())
    ]


def _litdata_convert(cfg: dict[str, Any]) -> None:
    """LitData's optimize(): chunks uploaded next to the source (or kept local)."""
    from systems import litdata_convert

    fs = None
    if cfg["source"] == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **cfg["storage_options"])
    cfg["litdata_prefix"] = litdata_convert(cfg, fs)


def _mosaic_convert(cfg: dict[str, Any]) -> None:
    """Mosaic's MDSWriter, in Mosaic's own environment."""
    _wait_all("mosaic conversion", [_mosaic(cfg, "convert")], 1800)


CONVERSIONS = {"litdata": _litdata_convert, "mosaic": _mosaic_convert}


def _start_stores(cfg: dict[str, Any]) -> None:
    """Start this run's stores with a one-object dataset in the same namespace,
    so the memory baseline is taken with the store processes already up.

    The stores are started here, in the driver, with the scenario's settings:
    the ranks' environment would come too late (a store started once is found,
    not restarted), which is why the half-cache budgets once did not bind.
    """
    from shardcache_server.cluster import ensure_stores
    from shardcache_server.settings import ServiceSettings

    from ranks import shardcache_batches, shardcache_dataset

    settings = ServiceSettings(
        redis_url=cfg["redis_url"], namespace=cfg["namespace"], **cfg["store_env"]
    )
    ensure_stores(settings)
    ds = shardcache_dataset(
        cfg, 0, 1, urls=[cfg["urls"][0]], name=f"warmup-{cfg['dataset']}"
    )
    batches, _ = shardcache_batches(ds, 1, cfg["shardcache_path"])
    ds.set_epoch(0)
    for _batch in batches(0):
        pass
    ds.close()


@dataclasses.dataclass
class Context:
    """What every system run shares: the emulator (or none), Redis, the raylets."""

    emulator: Any
    redis_url: str
    raylet_pids: list[int]


def run_system(system: str, cfg: dict[str, Any], ctx: Context) -> list[dict[str, Any]]:
    from memory import CacheSideMeter, machine_busy_s, redis_used_memory, rss_anon

    from shardcache_server.cluster import kill_stores

    emulator = ctx.emulator if cfg["source"] == "s3" else None
    cfg = {
        **cfg,
        "port": _free_port(),
        "prepare_s": 0.0,
        "prepare_gets": 0,
        "prepare_cpu_s": 0.0,
    }
    is_shardcache = system.startswith("shardcache")
    if is_shardcache:
        _start_stores(cfg)
    meter = CacheSideMeter(ctx.raylet_pids)
    meter.start()
    redis0, driver0 = redis_used_memory(ctx.redis_url), rss_anon(os.getpid())
    if emulator is not None:
        emulator.reset_counts()
    if system in CONVERSIONS:  # a conversion step before training, timed apart
        started, busy0 = time.perf_counter(), machine_busy_s()
        CONVERSIONS[system](cfg)
        cfg["prepare_s"] = time.perf_counter() - started
        cfg["prepare_cpu_s"] = machine_busy_s() - busy0
        cfg["prepare_gets"] = emulator.total_gets if emulator else 0
    try:
        if system == "mosaic":
            rows = _run_mosaic_ranks(cfg)
        elif system in RAY_SYSTEMS:
            rows = _run_ray_ranks(system, cfg)
        else:
            rows = _run_processes(system, cfg)
        job = _cache_side(system, rows, meter, driver0)
        job["redis_growth_bytes"] = redis_used_memory(ctx.redis_url) - redis0
    finally:
        if is_shardcache:
            # Each run's stores hold its values in the object store.
            kill_stores(cfg["namespace"])
    gets = emulator.total_gets if emulator else None
    for r in rows:
        r.update(job)
        r["storage_cpu_s"] = emulator.cpu_s if emulator else None
        # Every GET of the job, conversion included; prepare_* is reported apart.
        samples = cfg["samples"]  # a tar shard holds many samples
        r["gets_per_object"] = gets / samples if gets is not None else None
        r["prepare_s"], r["prepare_gets"] = cfg["prepare_s"], cfg["prepare_gets"]
        r["dataset_samples"] = samples
        if r["epoch"] == 0:
            # A system that converts or materialises first pays for it in epoch 1.
            r["seconds"] += cfg["prepare_s"]
            r["first_batch_s"] += cfg["prepare_s"]
            r["samples_per_s"] = r["samples"] / r["seconds"]
            if r["machine_cpu_s"] is not None:
                r["machine_cpu_s"] += cfg["prepare_cpu_s"]
    return rows


def _cache_side(
    system: str, rows: list[dict[str, Any]], meter: Any, driver0: int
) -> dict[str, Any]:
    """Anonymous memory the cache side grew by over the run, payload excluded."""
    from memory import rss_anon

    if system in RAY_SYSTEMS:
        grown = meter.stop()
        if system == "ray_data":  # the driver holds the materialised dataset's blocks
            grown["anon_growth_bytes"] += rss_anon(os.getpid()) - driver0
            grown["processes"].append("driver")
        return {
            "cache_side_bytes": grown["anon_growth_bytes"],
            "cache_processes": grown["processes"],
        }
    last = max(r["epoch"] for r in rows)
    managers = [
        r for r in rows if r["epoch"] == last and "cache_anon_growth_bytes" in r
    ]
    if managers:  # each rank's Manager process, minus the values it holds
        return {
            "cache_side_bytes": sum(
                r["cache_anon_growth_bytes"] - r["cache_payload_bytes"]
                for r in managers
            ),
            "cache_processes": ["multiprocessing.Manager"] * len(managers),
        }
    # Disk caches (simplecache, LitData, Mosaic) or none (plain): no process.
    return {"cache_side_bytes": None, "cache_processes": []}


def _scenario_env(
    system: str, dataset: str, values_bytes: int, nodes: int
) -> dict[str, Any]:
    """Store settings of a scenario: a per-node budget of half its share of values.

    The rank holds at most the working set of its shuffle blocks (four chunks):
    holding nothing, a chunk the store does not keep would be rebuilt for every
    batch that touches it; holding more, the rank would be a second cache.
    """
    if system in HALF_CACHE:
        from ranks import VALUE_BYTES

        chunk_bytes = HALF_CACHE_CHUNK_SAMPLES[dataset] * VALUE_BYTES[dataset]
        return {
            "cache_bytes": values_bytes // (2 * nodes),
            "eviction": HALF_CACHE[system],
            "hold_bytes": 4 * chunk_bytes,
        }
    return {}


def _raylet_pids(cluster: Any) -> list[int]:
    pids = []
    for node in cluster.list_all_nodes():
        for info in node.all_processes.get("raylet", []):
            pids.append(int(info.process.pid))
    return pids


def _write_local(root: Path, args: argparse.Namespace) -> None:
    """The same datasets as files on local disk, read once so the page cache is warm."""
    import fsspec

    from shardcache_server.datagen import upload_blobs, upload_images

    fs = fsspec.filesystem("file", auto_mkdir=True)
    for d in DATASETS:
        (root / d).mkdir(parents=True, exist_ok=True)
    upload_images(fs, str(root / "images"), args.images, size=args.image_px, fmt="JPEG")
    upload_blobs(fs, str(root / "blobs"), args.blobs, 4096)
    if any(s in PACKED for s in args.systems.split(",")):
        for d in DATASETS:
            (root / f"tar-{d}").mkdir(exist_ok=True)
        fs.pipe(_tar_shards(str(root), args))
    for path in root.rglob("*"):
        if path.is_file():
            path.read_bytes()


def _tar_shards(root: str, args: argparse.Namespace) -> dict[str, bytes]:
    """Both datasets as WebDataset tar shards under ``root/tar-<dataset>/``: the
    very bytes of the per-object files (the same generators, the same seeds),
    one sample per member (``img-000123.jpg``, ``blob-000123.bin``)."""
    from shardcache_server.datagen import make_image

    rng = np.random.default_rng(0)  # upload_blobs' sequence
    named = {
        "images": [
            (f"img-{i:06d}.jpg", make_image(i, args.image_px, "JPEG"))
            for i in range(args.images)
        ],
        "blobs": [
            (f"blob-{i:06d}.bin", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
            for i in range(args.blobs)
        ],
    }
    shards: dict[str, bytes] = {}
    for dataset, members in named.items():
        per_shard = TAR_SAMPLES_PER_SHARD[dataset]
        for s, start in enumerate(range(0, len(members), per_shard)):
            path = f"{root}/tar-{dataset}/shard-{s:04d}.tar"
            shards[path] = _tar(members[start : start + per_shard])
    return shards


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


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
    from shardcache_server.datagen import upload_blobs, upload_images
    from shardcache_server.emulator import LATENCY_PROFILES, S3Emulator

    from ranks import VALUE_BYTES

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
        import s3fs

        emulator = S3Emulator().start()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **emulator.storage_options())
        fs.mkdir("bench")
        print(f"s3: {args.images} JPEGs and {args.blobs} 4 KB blobs ...", flush=True)
        upload_images(fs, "bench/images", args.images, size=args.image_px, fmt="JPEG")
        upload_blobs(fs, "bench/blobs", args.blobs, 4096)
        if any(s in PACKED for s in systems):
            fs.pipe(_tar_shards("bench", args))
        sizes = {"images": fs.du("bench/images") / args.images, "blobs": 4096}
        calibration = calibrate_storage(
            emulator, fs, f"s3://{fs.find('bench/images')[0]}"
        )
        print(f"storage calibration: {calibration}", flush=True)
        emulator.set_faults(
            dataclasses.replace(
                LATENCY_PROFILES[args.profile],
                bandwidth_bytes_per_s=args.bandwidth_mb_s * 1e6,
            )
        )
    local_root = Path(tmp) / "local"
    if "local" in sources:
        print(f"local: the same datasets under {local_root} ...", flush=True)
        _write_local(local_root, args)
        images = list((local_root / "images").iterdir())
        sizes = {
            "images": sum(p.stat().st_size for p in images) / len(images),
            "blobs": 4096,
        }
    memcpy_runs = {d: [memcpy_gbps(batch[d] * VALUE_BYTES[d])] for d in DATASETS}
    cpus_per_node = max(2, (os.cpu_count() or 2) // args.nodes)
    cluster = start_loopback_cluster(
        args.nodes, args.object_store_mb * 2**20, cpus_per_node
    )
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    # The spawned torch ranks join this cluster: the SDK never joins one it
    # finds by "auto" unless told to.
    os.environ["RAY_ADDRESS"] = cluster.address
    ctx = Context(emulator, redis_url, _raylet_pids(cluster))
    results: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for source in sources:
                for dataset in DATASETS:
                    for rpn, layout_systems in _layouts(args, systems):
                        for system in layout_systems:
                            cfg = _config(
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


def _config(
    args: argparse.Namespace,
    rep: int,
    source: str,
    dataset: str,
    system: str,
    rpn: int,
    tmp: str,
    redis_url: str,
    emulator: Any,
    fs: Any,
    local_root: Path,
) -> dict[str, Any] | None:
    """One system run's settings, or None when it does not apply to this source."""
    from ranks import VALUE_BYTES

    if source == "local" and (system in REMOTE_ONLY or system in SCENARIOS):
        return None  # caching local files locally; scenarios count GETs (s3 only)
    if system == "shardcache_changed1" and dataset != "blobs":
        return None  # rewriting a JPEG's bytes would not decode
    folder = f"tar-{dataset}" if system in PACKED else dataset
    if source == "s3":
        prefix = f"s3://bench/{folder}/"
        urls = sorted(f"s3://{p}" for p in fs.find(prefix))
        storage_options, endpoint = emulator.storage_options(), emulator.endpoint_url
    else:
        prefix = f"{local_root / folder}/"
        urls = sorted(str(p) for p in (local_root / folder).iterdir())
        storage_options, endpoint = {}, None
    layout = f"{args.nodes}x{rpn}"
    cfg: dict[str, Any] = {
        "source": source,
        "dataset": dataset,
        "prefix": prefix,
        "urls": urls,
        "samples": args.images if dataset == "images" else args.blobs,
        "chunk_samples": (
            HALF_CACHE_CHUNK_SAMPLES.get(dataset) if system in HALF_CACHE else None
        ),
        "shuffle_block": (
            HALF_CACHE_SHUFFLE_BLOCK[dataset] if system in HALF_CACHE else None
        ),
        "format": PACKED.get(system),
        "storage_options": storage_options,
        "endpoint": endpoint,
        "redis_url": redis_url,
        # A fresh cache per run: every run starts cold.
        "namespace": f"b{rep}{source[0]}{dataset[0]}{layout.replace('x', '')}"
        f"{system.replace('_', '')}",
        "store_env": _scenario_env(
            system, dataset, VALUE_BYTES[dataset] * len(urls), args.nodes
        ),
        "epochs": args.epochs,
        "world": args.nodes * rpn,
        "ranks_per_node": rpn,
        "layout": layout,
        "batch_size": args.batch_images if dataset == "images" else args.batch_blobs,
        "value_bytes": VALUE_BYTES[dataset],
        "workers": args.workers,
        "epoch_cap_s": args.epoch_cap_s,
        "shardcache_path": args.shardcache_path,
        "step_ms": 2.0,
        "tmp": tmp,
    }
    if system == "shardcache_changed1":
        count = max(1, len(urls) // 100)
        cfg["change_urls"] = urls[:: max(1, len(urls) // count)][:count]
        cfg["change_before_epoch"] = args.epochs - 1
    return cfg


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

"""How one system run is launched and measured: its ranks, and the cache side around them.

Ranks run as spawned processes (as torchrun starts them), as Ray actors placed
per node (as Ray Train does), or, for Mosaic, as one process per node in an
environment of its own; a conversion step (LitData, Mosaic) runs first and is
timed apart. :func:`run_system` returns the ranks' rows with what the run
cost on the cache side (memory, Redis, GETs) added.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from scenarios import RAY_SYSTEMS

HERE = Path(__file__).resolve().parent
# Mosaic Streaming runs in an environment of its own (bench/mosaic.py says why).
MOSAIC_PYTHON = HERE.parent / ".venv-mosaic" / "bin" / "python"


def _torch_rank(system: str, rank: int, cfg: dict[str, Any], out: Any) -> None:
    from ranks import run_torch_rank

    out.put(run_torch_rank(system, rank, cfg))


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


def raylet_pids(cluster: Any) -> list[int]:
    pids = []
    for node in cluster.list_all_nodes():
        for info in node.all_processes.get("raylet", []):
            pids.append(int(info.process.pid))
    return pids

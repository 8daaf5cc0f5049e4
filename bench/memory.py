"""What a rank and the cache side hold: anonymous memory, Redis memory, machine CPU.

Payload that lives in shared memory (Ray's object store, torch's worker
queues, Mosaic's /dev/shm) or in the page cache (LitData's and Mosaic's
chunks, simplecache's files) is not anonymous memory, so the growth of
``RssAnon`` over a run is the per-process bookkeeping a system keeps: a
manifest, index dicts, Python objects per sample. Where a system does keep
payload in anonymous memory (the Manager dict), the caller subtracts it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

STORE_CLASS = (
    "RayCacheShard"  # the shardcache store actor's class name (store/actor.py)
)
RANK_CLASS = "RayRank"  # bench/ranks.py: the Ray-hosted ranks, counted as ranks
# Worker titles that hold nothing for the system under test: idle pooled
# workers, the ranks (counted as ranks), Ray's own per-node agents.
NOT_CACHE_SIDE = ("IDLE", RANK_CLASS, "DashboardAgent", "RuntimeEnvAgent")


def rss_anon(pid: int) -> int:
    """``RssAnon`` of one process in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return 0


def tree_pids(pid: int, exclude: Iterable[int] = ()) -> list[int]:
    """``pid`` and its descendants (DataLoader workers), minus ``exclude``."""
    import psutil

    skip = set(exclude)
    try:
        kids = [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        kids = []
    return [p for p in [pid, *kids] if p not in skip]


def private_dirty(pid: int) -> int:
    """Pages a (forked) process wrote itself, in bytes (``smaps_rollup``)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Private_Dirty:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return 0


def tree_anon(pid: int, exclude: Iterable[int] = ()) -> int:
    """``RssAnon`` of ``pid`` plus what its children (DataLoader workers) wrote.

    A forked worker's RssAnon counts every page it shares with its parent, so
    summing RssAnon would count the parent once per worker; its private dirty
    pages are what it holds of its own (the copy-on-write copies of a
    dataset's per-sample Python objects included).
    """
    pids = tree_pids(pid, exclude)
    return sum(rss_anon(p) if p == pid else private_dirty(p) for p in pids)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def ray_workers(raylet_pids: Iterable[int]) -> dict[int, str]:
    """Ray worker processes of *this* cluster (children of its raylets): pid -> title.

    Scanning only our raylets' children keeps other people's Ray clusters on
    the same machine out of the figures.
    """
    import psutil

    out: dict[int, str] = {}
    for raylet in raylet_pids:
        try:
            kids = psutil.Process(raylet).children(recursive=True)
        except psutil.Error:
            continue
        for kid in kids:
            title = cmdline(kid.pid)
            if title.startswith("ray::"):
                out[kid.pid] = title
    return out


def store_pids(root_pids: Iterable[int]) -> list[int]:
    """PIDs of the shardcache store actors under ``root_pids`` (raylets or a
    driver), found by the process title Ray gives an actor's worker
    (``ray::RayCacheShard``); Ray's state API needs the dashboard, which the
    benchmark clusters do not start."""
    return [p for p, t in ray_workers(root_pids).items() if STORE_CLASS in t]


class CacheSideMeter:
    """Anonymous-memory growth of the Ray processes that are not ranks.

    A process that existed at :meth:`start` counts its growth; one started
    during the run (a chunk builder, Ray Data's split coordinator) counts
    what it holds beyond a fresh worker (the median idle worker at start).
    Idle workers at the end hold nothing for the system and are left out.
    """

    def __init__(self, raylet_pids: list[int]):
        self.raylets = raylet_pids
        self.before: dict[int, int] = {}
        self.fresh_worker = 0

    def start(self) -> None:
        workers = ray_workers(self.raylets)
        self.before = {p: rss_anon(p) for p in workers}
        idle = sorted(self.before[p] for p, t in workers.items() if "IDLE" in t)
        self.fresh_worker = idle[len(idle) // 2] if idle else 0

    def stop(self) -> dict[str, Any]:
        grown, counted = 0, []
        for pid, title in ray_workers(self.raylets).items():
            if any(word in title for word in NOT_CACHE_SIDE):
                continue
            now = rss_anon(pid)
            base = self.before.get(pid, self.fresh_worker)
            grown += now - base
            counted.append(title.split()[0])
        return {"anon_growth_bytes": grown, "processes": sorted(counted)}


class ClusterMeter:
    """Anonymous-memory growth of every process a driver's private Ray
    cluster runs (GCS, raylet, the workers), ``exclude`` left out (the
    driver's Redis): what the issue calls "the Ray side, all processes
    together". Processes that existed at :meth:`start` count their growth;
    one started later counts what it holds beyond a fresh worker (the
    smallest worker at start). Idle workers count too: the one that ran a
    listing task is idle afterwards and may keep its heap.
    """

    def __init__(self, driver: int, exclude: Iterable[int] = ()):
        self.driver, self.exclude = driver, set(exclude)
        self.before: dict[int, int] = {}
        self.fresh_worker = 0

    def _processes(self) -> dict[int, str]:
        skip = {self.driver, *self.exclude}
        return {p: cmdline(p) for p in tree_pids(self.driver) if p not in skip}

    def start(self) -> None:
        procs = self._processes()
        self.before = {p: rss_anon(p) for p in procs}
        workers = [self.before[p] for p, t in procs.items() if t.startswith("ray::")]
        self.fresh_worker = min(workers, default=0)

    def grown(self) -> int:
        return sum(self.by_process().values())

    def by_process(self) -> dict[str, int]:
        """Growth per process, by its title (name and pid)."""
        return {
            f"{t.split()[0][:40] if t else '?'} {p}": rss_anon(p)
            - self.before.get(p, self.fresh_worker)
            for p, t in self._processes().items()
        }


def redis_used_memory(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def shm_used() -> int:
    """Bytes in use on /dev/shm (tmpfs), where Ray's object store lives."""
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def available_bytes() -> int:
    """``MemAvailable`` of the machine, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def disk_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

"""What every view shows for a dataset: the page, ``/metrics`` and ``shardcache stats``.

One place builds the figures so the three agree. The headline (hit rate,
GETs saved, origins, blocked time) is what the ranks reported
(``shardcache.usage``); the stores' own counters are *store traffic* and sit
under ``"store"``, never added to the headline.
"""

from __future__ import annotations

import time
from typing import Any

from shardcache import keys
from shardcache.index import HitStats, RedisIndex
from shardcache.usage import HEARTBEAT_S, RankUsage, UsageReader

__all__ = [
    "dataset_overview",
    "live_stores",
    "node_rows",
    "rank_rows",
    "store_traffic",
]

GENERATIONS_SHOWN = 5  # the cost of the last few version bumps
EXACT_BYTES_MAX_ENTRIES = (
    50_000  # chunks; above, cached objects and bytes are estimated
)
STRAGGLER_FACTOR = 2.0  # a rank is a straggler past twice the median
STRAGGLER_MIN_EXTRA_S = 1.0  # ...and at least this much more blocked time
STRAGGLER_MIN_EXTRA_P99_MS = 100.0  # ...or this much more p99 batch wait
# A store that has not written its heartbeat (every ``stats_flush_s``, 1 s)
# for this long is gone: its node left, or the Ray cluster it ran in ended
# (a Ray Train script's own local cluster does at exit). Its record and its
# index entries stay in Redis until a live store takes the chunks over, so
# every view counts only live stores' memory and entries.
STORE_SILENT_AFTER_S = 30.0
# A rank silent this long without a final report has stopped (SIGKILL, OOM):
# three heartbeats, so a long step or one slow Redis write is not a death.
RANK_SILENT_AFTER_S = 3 * HEARTBEAT_S


def store_traffic(s: HitStats) -> dict[str, Any]:
    """The stores' own counters: requests that reached a store, not samples served."""
    return {
        "hits": s.hits,
        "misses": s.misses,
        "hit_rate": s.hit_rate if s.hits + s.misses else None,
        "remote_reads": s.remote_reads,
        "bytes_read": s.bytes_read,
        "bytes_served": s.bytes_served,
        "errors": s.errors,
        "evictions": s.evictions,
        "uncached": s.uncached,
    }


def live_stores(index: RedisIndex) -> dict[str, dict[str, Any]]:
    """The heartbeat record of every store that wrote one in the last
    ``STORE_SILENT_AFTER_S``, by node."""
    now = time.time()
    return {
        node: info
        for node, info in index.stores().items()
        if now - float(info.get("ts", 0) or 0) <= STORE_SILENT_AFTER_S
    }


def dataset_overview(
    index: RedisIndex, usage: UsageReader, name: str
) -> dict[str, Any] | None:
    """Everything the page shows for one dataset, from Redis alone."""
    record = index.dataset(name)
    if record is None:
        return None
    # One index entry per cached chunk; each names its objects ("samples").
    # Summing reads every entry: fine up to many millions of objects (a chunk
    # holds thousands), too much on every 5 s poll past that, where the mean
    # chunk of the published listing stands in.
    chunks = index.entry_count(name, record.generation)
    if chunks <= EXACT_BYTES_MAX_ENTRIES:
        live = live_stores(index)
        # A gone store's chunks died with it (memory) or wait for a store on
        # its host (disk): not cached for any reader now.
        entries = [
            e
            for e in index.entries(name, record.generation).values()
            if e.get("owner", "") in live or "owner" not in e
        ]
        cached = sum(int(e.get("samples", 1)) for e in entries)
        cached_bytes = sum(int(e.get("size", 0)) for e in entries)
        bytes_estimated = False
    else:
        with index.errors():
            listed = index.client.hget(keys.manifest_key(index.ns, name), "chunks")
        per_chunk = record.objects / max(int(listed or record.objects), 1)
        cached = min(record.objects, round(chunks * per_chunk))
        cached_bytes = int(cached * record.total_bytes / max(record.objects, 1))
        bytes_estimated = True
    generations = [
        {"generation": g, **store_traffic(index.generation_stats(name, g))}
        for g in range(
            max(1, record.generation - GENERATIONS_SHOWN + 1), record.generation + 1
        )
    ]
    return {
        "name": name,
        "source": record.source,
        "generation": record.generation,
        "created_at": record.created_at,
        "invalidated_at": record.invalidated_at,
        "objects_total": record.objects,
        "objects_cached": cached,
        "bytes_total": record.total_bytes,
        "bytes_cached": cached_bytes,
        "bytes_cached_estimated": bytes_estimated,
        **usage.totals(name).as_dict(),
        "jobs": _jobs(usage, name),
        "store": store_traffic(index.stats(name)),
        "generations": generations,
    }


def _jobs(usage: UsageReader, name: str) -> list[dict[str, Any]]:
    """The recent jobs' figures, each with the listing and generation it read."""
    jobs = usage.jobs(name)
    reads = usage.job_reads(name, list(jobs))
    return [
        {"job": job, **reads[job].as_dict(), **t.as_dict()} for job, t in jobs.items()
    ]


def node_rows(index: RedisIndex) -> list[dict[str, Any]]:
    """Per store: memory, entries and its store-traffic hit rate."""
    out = []
    now = time.time()
    datasets = index.datasets()
    stores = live_stores(index)
    per_pair = index.node_stats_many(datasets, list(stores))
    for node, info in sorted(stores.items()):
        hits = misses = evictions = 0
        for ds in datasets:
            s = per_pair[(ds, node)]
            hits, misses = hits + s.hits, misses + s.misses
            evictions += s.evictions
        out.append(
            {
                "node": node,
                "used_bytes": info.get("used_bytes", 0),
                "budget_bytes": info.get("budget_bytes", 0),
                "entries": info.get("entries", 0),
                "eviction": info.get("eviction"),
                "evictions": evictions,
                "hit_rate": hits / (hits + misses) if hits + misses else None,
                "age_s": now - float(info.get("ts", 0) or 0),
            }
        )
    return out


def _median(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered, mid = sorted(values), len(values) // 2
    return ordered[mid] if len(values) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _others(values: list[float], i: int, median: float) -> float:
    """What rank ``i`` is compared with: the other rank's value with two
    ranks (the median of both cannot be exceeded twice over), else the
    median of all."""
    return values[1 - i] if len(values) == 2 else median


def rank_rows(index: RedisIndex, usage: UsageReader, name: str) -> list[dict[str, Any]]:
    """One row per ``job/rank``: its wait percentiles (its own report) and what
    it delivered and how long it was blocked (its usage counters)."""
    reports = index.ranks(name)
    used: dict[str, RankUsage] = {f"{r.job}/{r.rank}": r for r in usage.ranks(name)}
    rows = []
    now = time.time()
    for key in sorted(set(reports) | set(used)):
        job, _, rank = key.rpartition("/")
        report, u = reports.get(key, {}), used.get(key)
        totals = u.totals.as_dict() if u else None
        own = int(report.get("hits", 0)) + int(report.get("misses", 0))
        rows.append(
            {
                "job": job,
                "rank": rank,
                "generation": report.get("generation"),
                "epoch": u.epoch if u and u.epoch is not None else report.get("epoch"),
                "wait_p50_ms": float(report.get("wait_p50_ms", 0.0)),
                "wait_p99_ms": float(report.get("wait_p99_ms", 0.0)),
                "samples": totals["samples"] if totals else own,
                "hit_rate": totals["hit_rate"]
                if totals
                else (int(report.get("hits", 0)) / own if own else None),
                "sample_ratio": totals["sample_ratio"] if totals else None,
                "blocked_s": totals["blocked_s"] if totals else None,
                "blocked_s_by_epoch": {
                    str(e): s for e, s in (u.blocked_s_by_epoch if u else {}).items()
                },
                "lost_samples": totals["lost_samples"] if totals else 0,
                # "lost": stopped without its final report (SIGKILL, OOM): up
                # to one flush interval of what it delivered is not counted.
                "state": u.state(now, RANK_SILENT_AFTER_S) if u else "running",
            }
        )
    # A straggler is the rank of a job that waited while that job's other
    # ranks did not (ranks of another job, cold while this one is warm, are
    # not its peers): by its p99 batch wait, or by the total time its loop
    # was blocked (a rank can be slow without a bad p99).
    by_job: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_job.setdefault(r["job"], []).append(r)
    for peers in by_job.values():
        _flag_stragglers(peers)
    return rows


def _flag_stragglers(peers: list[dict[str, Any]]) -> None:
    """Set ``straggler`` on each of one job's rank rows. Each comparison needs
    a minimum margin too: a p99 of a few dozen batches is one slow batch (an
    epoch's first), not a slow rank."""
    p99s = [r["wait_p99_ms"] for r in peers]
    blocks = [r["blocked_s"] or 0.0 for r in peers]
    median_p99, median_blocked = _median(p99s), _median([b for b in blocks if b])
    for i, r in enumerate(peers):
        p99, base_p99 = p99s[i], _others(p99s, i, median_p99)
        blocked, base_blocked = blocks[i], _others(blocks, i, median_blocked)
        r["straggler"] = bool(
            (
                base_p99
                and p99 > STRAGGLER_FACTOR * base_p99
                and p99 - base_p99 >= STRAGGLER_MIN_EXTRA_P99_MS
            )
            or (
                base_blocked
                and blocked > STRAGGLER_FACTOR * base_blocked
                and blocked - base_blocked >= STRAGGLER_MIN_EXTRA_S
            )
        )

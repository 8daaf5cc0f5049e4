"""Prometheus ``/metrics``: stable names, listed in :data:`METRICS` and docs/metrics.md.

Figures are read from Redis on each scrape (the dashboard keeps no state).
``shardcache_hits_total``, ``shardcache_misses_total`` and
``shardcache_hit_rate`` count samples the ranks delivered; the ``store_*``
ones count requests that reached a store. Counters carry ``_total`` in the
exposition, as Prometheus names them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shardcache.index import RedisIndex
from shardcache.usage import ORIGINS, UsageReader
from shardcache_server.overview import node_rows, rank_rows

__all__ = ["METRICS", "RedisCollector", "exposed_names"]

# name (as exposed) -> (type, labels, help). Renaming one breaks dashboards
# and alerts: add a new name instead, and keep docs/metrics.md in step.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    # Samples the ranks delivered (rank-reported; the headline figures).
    "shardcache_samples_total": (
        "counter",
        ("dataset", "origin"),
        "samples delivered to ranks, by origin (local node, local disk tier, peer store, source)",
    ),
    "shardcache_sample_bytes_total": (
        "counter",
        ("dataset", "origin"),
        "source-object bytes (listed sizes) of the samples delivered to ranks, by origin",
    ),
    "shardcache_hits_total": (
        "counter",
        ("dataset",),
        "samples delivered from the cache (origin local, disk or peer)",
    ),
    "shardcache_misses_total": (
        "counter",
        ("dataset",),
        "samples delivered from the source (origin source)",
    ),
    "shardcache_gets_saved_total": (
        "counter",
        ("dataset",),
        "samples delivered minus source reads: GETs the cache spared the source",
    ),
    "shardcache_hit_rate": (
        "gauge",
        ("dataset",),
        "share of delivered samples not read from the source (absent before any)",
    ),
    "shardcache_byte_hit_rate": (
        "gauge",
        ("dataset",),
        "share of delivered bytes not read from the source (absent before any)",
    ),
    "shardcache_samples_lost_total": (
        "counter",
        ("dataset",),
        "samples delivered but never reported: Redis was unreachable too long",
    ),
    "shardcache_samples_skipped_total": (
        "counter",
        ("dataset",),
        "samples replaced by another of their batch (on_error='skip'): their "
        "object could not be read or built",
    ),
    "shardcache_rank_unreported": (
        "gauge",
        ("dataset", "job", "rank"),
        "1 when a rank stopped without its final report (SIGKILL, OOM): up to "
        "one flush interval (1 s) of its samples is not counted",
    ),
    "shardcache_job_samples_total": (
        "counter",
        ("dataset", "job", "origin"),
        "samples delivered to one job's ranks, by origin (recent jobs)",
    ),
    "shardcache_job_hit_rate": (
        "gauge",
        ("dataset", "job"),
        "share of a job's delivered samples not read from the source",
    ),
    "shardcache_rank_blocked_seconds_total": (
        "counter",
        ("dataset", "job", "rank"),
        "time a rank's training loop was blocked waiting for data",
    ),
    "shardcache_rank_wait_p99_seconds": (
        "gauge",
        ("dataset", "job", "rank"),
        "p99 batch wait of a rank (its own report)",
    ),
    # Store traffic (requests that reached a store; not the headline).
    "shardcache_store_hits_total": (
        "counter",
        ("dataset",),
        "requests a store answered from its cache",
    ),
    "shardcache_store_misses_total": (
        "counter",
        ("dataset",),
        "requests a store could not answer from its cache",
    ),
    "shardcache_store_hit_rate": (
        "gauge",
        ("dataset",),
        "store hits / (store hits + store misses)",
    ),
    "shardcache_remote_reads_total": (
        "counter",
        ("dataset",),
        "GETs the stores sent to the source",
    ),
    "shardcache_bytes_read_total": (
        "counter",
        ("dataset",),
        "bytes the stores read from the source",
    ),
    "shardcache_evictions_total": ("counter", ("dataset",), "store evictions"),
    "shardcache_errors_total": ("counter", ("dataset",), "store fetch errors"),
    "shardcache_generation": ("gauge", ("dataset",), "current generation"),
    "shardcache_store_used_bytes": ("gauge", ("node",), "bytes cached per node"),
    "shardcache_store_budget_bytes": ("gauge", ("node",), "byte budget per node"),
}


def exposed_names() -> set[str]:
    """Every sample name ``/metrics`` can expose."""
    return set(METRICS)


def _family(name: str) -> Any:
    kind, labels, doc = METRICS[name]
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


class RedisCollector:
    """Reads the same figures as the page from Redis on every scrape."""

    def __init__(self, readers: Callable[[], tuple[RedisIndex, UsageReader]]):
        self._readers = readers

    def collect(self) -> Iterator[Any]:
        index, usage = self._readers()
        fam = {name: _family(name) for name in METRICS}

        def add(name: str, labels: list[str], value: float | None) -> None:
            if value is not None:
                fam[name].add_metric(labels, value)

        datasets = index.datasets()
        totals = usage.totals_many(datasets)
        for ds in datasets:
            t = totals[ds]
            for o in ORIGINS:
                add("shardcache_samples_total", [ds, o], getattr(t, f"samples_{o}"))
                add("shardcache_sample_bytes_total", [ds, o], getattr(t, f"bytes_{o}"))
            add("shardcache_hits_total", [ds], t.samples - t.samples_source)
            add("shardcache_misses_total", [ds], t.samples_source)
            add("shardcache_gets_saved_total", [ds], t.gets_saved)
            add("shardcache_hit_rate", [ds], t.hit_rate)
            add("shardcache_byte_hit_rate", [ds], t.byte_hit_rate)
            add("shardcache_samples_lost_total", [ds], t.lost_samples)
            add("shardcache_samples_skipped_total", [ds], t.skipped)
            for job, jt in usage.jobs(ds).items():
                for o in ORIGINS:
                    add(
                        "shardcache_job_samples_total",
                        [ds, job, o],
                        getattr(jt, f"samples_{o}"),
                    )
                add("shardcache_job_hit_rate", [ds, job], jt.hit_rate)
            for r in rank_rows(index, usage, ds):
                labels = [ds, r["job"], str(r["rank"])]
                add("shardcache_rank_blocked_seconds_total", labels, r["blocked_s"])
                add("shardcache_rank_wait_p99_seconds", labels, r["wait_p99_ms"] / 1e3)
                add("shardcache_rank_unreported", labels, float(r["state"] == "lost"))
            s = index.stats(ds)
            add("shardcache_store_hits_total", [ds], s.hits)
            add("shardcache_store_misses_total", [ds], s.misses)
            add(
                "shardcache_store_hit_rate",
                [ds],
                s.hit_rate if s.hits + s.misses else None,
            )
            add("shardcache_remote_reads_total", [ds], s.remote_reads)
            add("shardcache_bytes_read_total", [ds], s.bytes_read)
            add("shardcache_evictions_total", [ds], s.evictions)
            add("shardcache_errors_total", [ds], s.errors)
            record = index.dataset(ds)
            add("shardcache_generation", [ds], record.generation if record else 0)
        for n in node_rows(index):
            add("shardcache_store_used_bytes", [n["node"]], n["used_bytes"])
            add("shardcache_store_budget_bytes", [n["node"]], n["budget_bytes"])
        yield from fam.values()

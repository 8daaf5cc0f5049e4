"""The dashboard: a Starlette app that reads Redis only (works with Ray down).

Read-only with respect to the cache: it never writes index entries. Routes:
``/`` the page, ``/api/*`` the JSON it polls, ``/api/chart/{ds}.svg``,
``/metrics`` for Prometheus, ``/healthz`` for probes (Redis PING).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from shardcache import keys
from shardcache.errors import ConfigError, IndexUnavailable
from shardcache.index import HitStats, RedisIndex
from shardcache_server.charts import line_chart_svg

__all__ = ["create_app", "dataset_overview", "serve"]

DEFAULT_WINDOW_S = 3600  # the chart shows the last hour unless asked otherwise
MAX_WINDOW_S = 2 * 24 * 3600  # as far back as the series is kept
GENERATIONS_SHOWN = 5  # the cost of the last few version bumps
EXACT_BYTES_MAX_ENTRIES = 50_000  # above this, cached bytes are estimated per poll
_PAGE = (Path(__file__).parent / "static" / "dashboard.html").read_text


def dataset_overview(index: RedisIndex, name: str) -> dict[str, Any] | None:
    """Everything the page shows for one dataset, from Redis alone."""
    record = index.dataset(name)
    if record is None:
        return None
    stats = index.stats(name)
    cached = index.entry_count(name, record.generation)
    # Summing sizes reads every entry: fine for small datasets, too much on
    # every 5 s poll at millions of objects, where the mean size stands in.
    if cached <= EXACT_BYTES_MAX_ENTRIES:
        entries = index.entries(name, record.generation)
        cached_bytes = sum(int(e.get("size", 0)) for e in entries.values())
        bytes_estimated = False
    else:
        cached_bytes = int(cached * record.total_bytes / max(record.objects, 1))
        bytes_estimated = True
    served = stats.hits + stats.misses
    generations = [
        {"generation": g, **_counts(index.generation_stats(name, g))}
        for g in range(
            max(1, record.generation - GENERATIONS_SHOWN + 1), record.generation + 1
        )
    ]
    return {
        "generations": generations,
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
        "hits": stats.hits,
        "misses": stats.misses,
        "hit_rate": stats.hit_rate,
        "reads_served": served,
        "remote_reads": stats.remote_reads,
        "gets_saved": max(served - stats.remote_reads, 0),
        "errors": stats.errors,
        "evictions": stats.evictions,
    }


def _counts(s: HitStats) -> dict[str, Any]:
    return {
        "hits": s.hits,
        "misses": s.misses,
        "remote_reads": s.remote_reads,
        "hit_rate": s.hit_rate,
        "bytes_read": s.bytes_read,
    }


def _nodes(index: RedisIndex) -> list[dict[str, Any]]:
    out = []
    now = time.time()
    datasets = index.datasets()
    stores = index.stores()
    per_pair = index.node_stats_many(datasets, list(stores))
    for node, info in sorted(stores.items()):
        hits = misses = evictions = 0
        for ds in datasets:
            s = per_pair[(ds, node)]
            hits, misses, evictions = (
                hits + s.hits,
                misses + s.misses,
                evictions + s.evictions,
            )
        out.append(
            {
                "node": node,
                "used_bytes": info.get("used_bytes", 0),
                "budget_bytes": info.get("budget_bytes", 0),
                "entries": info.get("entries", 0),
                "eviction": info.get("eviction"),
                "evictions": evictions,
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "age_s": now - float(info.get("ts", 0) or 0),
            }
        )
    return out


def _ranks(index: RedisIndex, name: str) -> list[dict[str, Any]]:
    rows = []
    for key, report in sorted(index.ranks(name).items()):
        job, _, rank = key.rpartition("/")
        total = int(report.get("hits", 0)) + int(report.get("misses", 0))
        rows.append(
            {
                "job": job,
                "rank": rank,
                "generation": report.get("generation"),
                "wait_p50_ms": report.get("wait_p50_ms", 0.0),
                "wait_p99_ms": report.get("wait_p99_ms", 0.0),
                "hit_rate": int(report.get("hits", 0)) / total if total else 0.0,
                "remote_reads": report.get("remote_reads", 0),
                "epoch": report.get("epoch"),
            }
        )
    if rows:
        median_p99 = sorted(r["wait_p99_ms"] for r in rows)[
            (len(rows) - 1) // 2
        ]  # median_low
        for r in rows:  # a straggler waits much longer than the typical rank
            r["straggler"] = bool(median_p99 and r["wait_p99_ms"] > 2 * median_p99)
    return rows


class _RedisCollector:
    """Prometheus collector that reads the same figures from Redis on scrape."""

    def __init__(self, index_factory: Callable[[], RedisIndex]):
        self._index_factory = index_factory

    def collect(self) -> Iterator[Any]:
        index = self._index_factory()
        counters = {
            name: CounterMetricFamily(
                f"shardcache_{name}",
                f"shardcache {name.replace('_', ' ')}",
                labels=["dataset"],
            )
            for name in (
                "hits",
                "misses",
                "remote_reads",
                "bytes_read",
                "evictions",
                "errors",
            )
        }
        hit_rate = GaugeMetricFamily(
            "shardcache_hit_rate", "hits / (hits + misses)", labels=["dataset"]
        )
        generation = GaugeMetricFamily(
            "shardcache_generation", "current generation", labels=["dataset"]
        )
        used = GaugeMetricFamily(
            "shardcache_store_used_bytes", "bytes cached per node", labels=["node"]
        )
        budget = GaugeMetricFamily(
            "shardcache_store_budget_bytes", "budget per node", labels=["node"]
        )
        wait = GaugeMetricFamily(
            "shardcache_rank_wait_p99_seconds",
            "p99 batch wait",
            labels=["dataset", "job", "rank"],
        )
        for ds in index.datasets():
            s = index.stats(ds)
            for name, family in counters.items():
                family.add_metric([ds], getattr(s, name))
            hit_rate.add_metric([ds], s.hit_rate)
            record = index.dataset(ds)
            generation.add_metric([ds], record.generation if record else 0)
            for r in _ranks(index, ds):
                wait.add_metric(
                    [ds, r["job"], str(r["rank"])], float(r["wait_p99_ms"]) / 1000
                )
        for n in _nodes(index):
            used.add_metric([n["node"]], n["used_bytes"])
            budget.add_metric([n["node"]], n["budget_bytes"])
        yield from counters.values()
        yield from (hit_rate, generation, used, budget, wait)


def create_app(
    redis_url: str, namespace: str = keys.DEFAULT_NAMESPACE, token: str | None = None
) -> Starlette:
    """Build the ASGI app. Nothing connects until the first request.

    Args:
        redis_url: the index (credentials are never shown on any page).
        namespace: the deployment to show.
        token: when set, every route but ``/healthz`` needs ``Authorization: Bearer <token>``
            (or ``?token=`` for the page itself).
    """
    keys.validate_name("namespace", namespace)
    state: dict[str, RedisIndex] = {}

    def index() -> RedisIndex:
        if "index" not in state:
            state["index"] = RedisIndex.from_url(redis_url, namespace)
        return state["index"]

    def authorised(request: Request) -> bool:
        if not token:
            return True
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        given = given or request.query_params.get("token", "")
        return hmac.compare_digest(given.encode(), token.encode())

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            if not authorised(request):
                return PlainTextResponse(
                    "missing or wrong bearer token",
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            try:
                return handler(request)
            except IndexUnavailable as exc:
                return JSONResponse({"error": str(exc)}, status_code=503)

        return run

    def window(request: Request) -> int:
        try:
            value = int(request.query_params.get("window", DEFAULT_WINDOW_S))
        except ValueError:
            value = DEFAULT_WINDOW_S
        return min(max(value, 60), MAX_WINDOW_S)

    def page(request: Request) -> Response:
        return HTMLResponse(_PAGE())

    def overview(request: Request) -> Response:
        idx = index()
        datasets = [
            o for o in (dataset_overview(idx, ds) for ds in idx.datasets()) if o
        ]
        return JSONResponse(
            {
                "namespace": namespace,
                "datasets": datasets,
                "nodes": _nodes(idx),
                "ts": time.time(),
            }
        )

    def series(request: Request) -> Response:
        name = request.path_params["name"]
        rows = index().series(name, window(request))
        return JSONResponse(
            {
                "dataset": name,
                "points": [
                    {
                        "t": t,
                        "hits": s.hits,
                        "misses": s.misses,
                        "hit_rate": s.hit_rate,
                        "remote_reads": s.remote_reads,
                    }
                    for t, s in rows
                ],
            }
        )

    def chart(request: Request) -> Response:
        name = request.path_params["name"]
        rows = index().series(name, window(request))
        svg = line_chart_svg(
            [(t, s.hit_rate) for t, s in rows if s.hits + s.misses],
            title=f"{name}: hit rate, last {window(request) // 60} min",
        )
        return Response(svg, media_type="image/svg+xml")

    def ranks(request: Request) -> Response:
        return JSONResponse(
            {
                "dataset": request.path_params["name"],
                "ranks": _ranks(index(), request.path_params["name"]),
            }
        )

    def events(request: Request) -> Response:
        return JSONResponse({"events": index().events(100)})

    registry = CollectorRegistry()
    registry.register(_RedisCollector(index))

    def metrics(request: Request) -> Response:
        return Response(
            generate_latest(registry), media_type="text/plain; version=0.0.4"
        )

    async def healthz(request: Request) -> Response:
        try:
            with index().errors():
                index().client.ping()
        except IndexUnavailable:
            return PlainTextResponse("redis unreachable", status_code=503)
        return PlainTextResponse("ok")

    return Starlette(
        routes=[
            Route("/", guarded(page)),
            Route("/api/overview", guarded(overview)),
            Route("/api/series/{name}", guarded(series)),
            Route("/api/chart/{name}.svg", guarded(chart)),
            Route("/api/ranks/{name}", guarded(ranks)),
            Route("/api/events", guarded(events)),
            Route("/metrics", guarded(metrics)),
            Route("/healthz", healthz),
        ]
    )


def serve(
    *,
    redis_url: str | None,
    namespace: str,
    host: str,
    port: int,
    token: str | None,
    allow_no_token: bool = False,
) -> None:
    """Run the dashboard with uvicorn (blocking).

    Raises:
        ConfigError: binding beyond loopback without a token.
    """
    import uvicorn

    from shardcache.embedded import local_redis_url

    if (
        host not in ("127.0.0.1", "localhost", "::1")
        and not token
        and not allow_no_token
    ):
        raise ConfigError(
            f"refusing to serve the dashboard on {host} without a token; "
            "set SHARDCACHE_DASHBOARD_TOKEN or bind to 127.0.0.1."
        )
    app = create_app(redis_url or local_redis_url(), namespace, token)
    uvicorn.run(app, host=host, port=port, log_level="warning")

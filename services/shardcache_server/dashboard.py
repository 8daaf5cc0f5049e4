"""The dashboard: a Starlette app that reads Redis only (works with Ray down).

Read-only with respect to the cache: it never writes index entries. Routes:
``/`` the page, ``/api/*`` the JSON it polls, ``/api/chart/{ds}.svg`` (hit
rate over time, ``?job=`` for one job), ``/metrics`` for Prometheus
(``metrics.py``), ``/healthz`` for probes (Redis PING). The headline figures
are what the ranks delivered (``shardcache.usage``); the stores' counters are
shown apart, as store traffic (``overview.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from shardcache import keys
from shardcache.errors import ConfigError, IndexUnavailable
from shardcache.index import RedisIndex
from shardcache.usage import ORIGINS, UsageReader, UsageTotals
from shardcache_server.charts import line_chart_svg
from shardcache_server.dashboard_login import is_authorised, login, login_form
from shardcache_server.metrics import RedisCollector
from shardcache_server.overview import dataset_overview, node_rows, rank_rows

__all__ = ["create_app", "dataset_overview", "serve"]

DEFAULT_WINDOW_S = 3600  # the chart shows the last hour unless asked otherwise
MAX_WINDOW_S = 2 * 24 * 3600  # as far back as the series is kept
_PAGE = (Path(__file__).parent / "static" / "dashboard.html").read_text


def _point(t: int, u: UsageTotals) -> dict[str, Any]:
    return {
        "t": t,
        "samples": u.samples,
        "hit_rate": u.hit_rate,
        "byte_hit_rate": u.byte_hit_rate,
        **{f"samples_{o}": getattr(u, f"samples_{o}") for o in ORIGINS},
        "blocked_s": u.blocked_s,
    }


def create_app(
    redis_url: str,
    namespace: str = keys.DEFAULT_NAMESPACE,
    token: str | None = None,
    *,
    follow: Callable[[], str | None] | None = None,
) -> Starlette:
    """Build the ASGI app. Nothing connects until the first request.

    Args:
        redis_url: the index (credentials are never shown on any page).
        namespace: the deployment to show.
        token: when set, every route but ``/healthz`` and ``/login`` needs
            ``Authorization: Bearer <token>`` or the session cookie that the
            page's form gets from ``/login`` (``dashboard_login.py``).
        follow: where the index is now, asked when it cannot be reached: the
            embedded Redis comes back on another port after ``shardcache
            local stop`` and the next script, and the page follows it.
    """
    keys.validate_name("namespace", namespace)
    state: dict[str, Any] = {"url": redis_url}

    def index() -> RedisIndex:
        if "index" not in state:
            state["index"] = RedisIndex.from_url(state["url"], namespace)
        return state["index"]

    def usage() -> UsageReader:
        if "usage" not in state:
            state["usage"] = UsageReader(index().client, namespace, state["url"])
        return state["usage"]

    def moved() -> bool:
        """Whether the index moved (``follow``); if so, connect there next."""
        url = follow() if follow is not None else None
        if url is None or url == state["url"]:
            return False
        state.clear()
        state["url"] = url
        return True

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            if not is_authorised(request, token):
                if handler is page:  # a browser: the form, not a bare 401
                    return login_form(request)
                return PlainTextResponse(
                    "missing or wrong bearer token",
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            try:
                try:
                    return handler(request)
                except IndexUnavailable:
                    if not moved():
                        raise
                    return handler(request)
            except IndexUnavailable as exc:
                return JSONResponse({"error": str(exc)}, status_code=503)
            except ConfigError as exc:  # a bad ?job= or name in the request
                return JSONResponse({"error": str(exc)}, status_code=400)

        return run

    def window(request: Request) -> int:
        try:
            value = int(request.query_params.get("window", DEFAULT_WINDOW_S))
        except ValueError:
            value = DEFAULT_WINDOW_S
        return min(max(value, 60), MAX_WINDOW_S)

    def job_param(request: Request) -> str | None:
        job = request.query_params.get("job") or None
        return keys.validate_name("job", job) if job is not None else None

    def page(request: Request) -> Response:
        return HTMLResponse(_PAGE())

    def overview(request: Request) -> Response:
        idx, use = index(), usage()
        datasets = [
            o for o in (dataset_overview(idx, use, ds) for ds in idx.datasets()) if o
        ]
        return JSONResponse(
            {
                "namespace": namespace,
                "datasets": datasets,
                "nodes": node_rows(idx),
                "ts": time.time(),
            }
        )

    def series(request: Request) -> Response:
        """Delivered samples per 10 s (``points``, of one job with ``?job=``)
        and, for the dataset, store traffic per 10 s (``store_points``)."""
        name, job = request.path_params["name"], job_param(request)
        rows = usage().series(name, window(request), job=job)
        body: dict[str, Any] = {
            "dataset": name,
            "job": job,
            "points": [_point(t, u) for t, u in rows],
        }
        if job is None:
            body["store_points"] = [
                {
                    "t": t,
                    "hits": s.hits,
                    "misses": s.misses,
                    "hit_rate": s.hit_rate,
                    "remote_reads": s.remote_reads,
                }
                for t, s in index().series(name, window(request))
            ]
        return JSONResponse(body)

    def chart(request: Request) -> Response:
        name, job = request.path_params["name"], job_param(request)
        rows = usage().series(name, window(request), job=job)
        who = f"{name}, job {job}" if job else name
        svg = line_chart_svg(
            [(t, u.hit_rate) for t, u in rows if u.hit_rate is not None],
            title=f"{who}: hit rate of samples served, last {window(request) // 60} min",
        )
        return Response(svg, media_type="image/svg+xml")

    def ranks(request: Request) -> Response:
        name = request.path_params["name"]
        return JSONResponse(
            {"dataset": name, "ranks": rank_rows(index(), usage(), name)}
        )

    def events(request: Request) -> Response:
        return JSONResponse({"events": index().events(100)})

    registry = CollectorRegistry()
    registry.register(RedisCollector(lambda: (index(), usage())))

    def metrics(request: Request) -> Response:
        return Response(
            generate_latest(registry), media_type="text/plain; version=0.0.4"
        )

    def ping() -> None:
        with index().errors():
            index().client.ping()

    async def healthz(request: Request) -> Response:
        try:
            try:
                ping()
            except IndexUnavailable:
                if not moved():
                    raise
                ping()
        except IndexUnavailable:
            return PlainTextResponse("redis unreachable", status_code=503)
        return PlainTextResponse("ok")

    async def sign_in(request: Request) -> Response:
        return await login(request, token)

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
            Route("/login", sign_in, methods=["POST"]),
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
    """Run the dashboard with uvicorn (blocking). Without ``redis_url`` it
    shows the embedded cache, wherever its Redis runs now.

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
    from shardcache.embedded import running_redis_url

    follow = None if redis_url else running_redis_url
    app = create_app(redis_url or local_redis_url(), namespace, token, follow=follow)
    uvicorn.run(app, host=host, port=port, log_level="warning")

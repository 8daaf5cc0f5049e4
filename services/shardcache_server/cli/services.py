"""The commands that run something: ``demo``, ``dashboard``, ``stores``, ``selftest``
and ``local stop``."""

from __future__ import annotations

import typer

from shardcache_server.cli.options import (
    NamespaceOpt,
    RedisOpt,
    console,
    friendly_errors,
    running_index,
)

__all__ = ["dashboard", "demo", "local_stop", "selftest", "stores"]


def demo(
    source: str = typer.Option(None, help="real data URL instead of generated images"),
    images: int = typer.Option(2000, min=16, help="generated images"),
    epochs: int = typer.Option(3, min=1),
    ranks: int = typer.Option(2, min=1),
    batch_size: int = typer.Option(64, min=1),
    format: str = typer.Option(  # noqa: A002
        None,
        help="pack the generated images as 'tar' (WebDataset shards), or the "
        "format of --source (tar, parquet, hdf5, lmdb, npy)",
    ),
) -> None:
    """2-rank DDP training through DistributedCachedDataset on embedded defaults."""
    from shardcache_server.demo import run_demo

    with friendly_errors():
        ok = run_demo(
            source=source,
            images=images,
            epochs=epochs,
            ranks=ranks,
            batch_size=batch_size,
            console=console,
            fmt=format,
        )
    raise typer.Exit(0 if ok else 1)


def dashboard(
    redis_url: str = RedisOpt,
    namespace: str = NamespaceOpt,
    host: str = typer.Option("127.0.0.1", help="bind address; 127.0.0.1 by default"),
    port: int = typer.Option(8265 + 100, min=1, max=65535),
    token: str = typer.Option(
        None, envvar="SHARDCACHE_DASHBOARD_TOKEN", help="require this bearer token"
    ),
    allow_no_token: bool = typer.Option(
        False,
        envvar="SHARDCACHE_DASHBOARD_ALLOW_NO_TOKEN",
        help="serve beyond loopback without a token (behind a NetworkPolicy)",
    ),
) -> None:
    """Serve the hit-rate dashboard and /metrics (reads Redis only; exit 1 when
    nothing runs)."""
    from shardcache_server.dashboard import serve

    with friendly_errors():
        index = running_index(redis_url, namespace)
        serve(
            # None: the embedded cache's, followed across its restarts.
            redis_url=redis_url and index.url,
            namespace=namespace,
            host=host,
            port=port,
            token=token,
            allow_no_token=allow_no_token,
        )


def stores(
    ray_address: str = typer.Option(None, envvar="RAY_ADDRESS"),
    watch: bool = typer.Option(False, help="keep starting stores as nodes join"),
    interval_s: float = typer.Option(15.0, min=1.0),
) -> None:
    """Start one store actor per Ray node (the chart runs this with --watch)."""
    import time

    from shardcache.embedded import attach_ray
    from shardcache_server.cluster import ensure_stores
    from shardcache_server.settings import ServiceSettings

    with friendly_errors():
        settings = ServiceSettings()
        attach_ray(ray_address)
        while True:
            handles = ensure_stores(settings)
            console.print(
                f"{len(handles)} store(s) up in namespace {settings.namespace}"
            )
            if not watch:
                return
            time.sleep(interval_s)


def selftest(
    ray_address: str = typer.Option(None, envvar="RAY_ADDRESS"),
    dashboard_url: str = typer.Option(None, help="also GET <url>/healthz"),
    redis_url: str = RedisOpt,
    namespace: str = NamespaceOpt,
) -> None:
    """Installed-cache check (the chart's `helm test`): Redis, dashboard, warm and hit."""
    from shardcache_server.selftest import run_selftest

    with friendly_errors():
        run_selftest(
            ray_address=ray_address,
            dashboard_url=dashboard_url,
            redis_url=redis_url,
            namespace=namespace,
            console=console,
        )


def local_stop() -> None:
    """Stop the embedded Redis and Ray that shardcache started on this machine;
    returns once they have exited."""
    from shardcache.embedded import stop_local

    stopped = stop_local()
    console.print(
        "stopped: " + (", ".join(stopped) if stopped else "nothing was running")
    )

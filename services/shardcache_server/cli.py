"""The ``shardcache`` command line: warm, stats, invalidate, ls, demo, dashboard, local."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.table import Column, Table

from shardcache.errors import ShardCacheError, ShardUnavailable

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="shardcache: pull each remote object once, serve every DDP rank from its node.",
)
local_app = typer.Typer(
    help="The embedded local Redis and Ray that the SDK starts by default."
)
app.add_typer(local_app, name="local")
console = Console()
err_console = Console(stderr=True)

RedisOpt = typer.Option(
    None,
    "--redis-url",
    envvar="SHARDCACHE_REDIS_URL",
    help="Redis index URL; default: the embedded local Redis.",
)
NamespaceOpt = typer.Option(
    "default",
    "--namespace",
    envvar="SHARDCACHE_NAMESPACE",
    help="Deployment namespace (key prefix).",
)


@contextlib.contextmanager
def _friendly_errors() -> Iterator[None]:
    """Our errors print one clear line and exit 2, never a traceback."""
    try:
        yield
    except ShardCacheError as exc:
        err_console.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None


def _index(redis_url: str | None, namespace: str) -> Any:
    """The index of ``redis_url``, else of the embedded Redis, started if need be
    (for commands that write: ``warm``)."""
    from shardcache.embedded import local_redis_url
    from shardcache.index import RedisIndex

    return RedisIndex.from_url(redis_url or local_redis_url(), namespace)


def _running_index(redis_url: str | None, namespace: str) -> Any:
    """The index of ``redis_url``, else of the embedded Redis when it runs.

    Read-only commands never start a service: with nothing running there is
    nothing to show, and an empty table with exit 0 would read as "the cache
    is empty". They say so and exit 1.
    """
    from shardcache.embedded import running_redis_url, state_dir
    from shardcache.index import RedisIndex

    url = redis_url or running_redis_url()
    if url is None:
        err_console.print(
            "[yellow]nothing running:[/] the embedded cache is not running on this "
            f"machine (no live Redis recorded in {state_dir() / 'redis.json'}). "
            "Run a training script or `shardcache warm URL` to start it, or pass "
            "--redis-url (SHARDCACHE_REDIS_URL) to read an installed cache."
        )
        raise typer.Exit(1)
    return RedisIndex.from_url(url, namespace)


def _require_dataset(index: Any, name: str) -> None:
    """An unknown dataset name is an error (exit 2), never an empty result."""
    known = index.datasets()
    if name not in known:
        listed = ", ".join(sorted(known)) or "none"
        err_console.print(
            f"[red]error:[/] no dataset named {name!r} in namespace "
            f"{index.ns!r} (known: {listed}); see `shardcache ls`."
        )
        raise typer.Exit(2)


def _storage_options(endpoint_url: str | None, options: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep:
            raise typer.BadParameter(f"--storage-option must be KEY=VALUE, got {opt!r}")
        out[key] = value
    if endpoint_url:
        out.setdefault("client_kwargs", {})["endpoint_url"] = endpoint_url
    return out


def _format_options(options: list[str]) -> dict[str, Any]:
    import json

    out: dict[str, Any] = {}
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep:
            raise typer.BadParameter(f"--format-option must be KEY=VALUE, got {opt!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value  # a plain string
    return out


@app.command()
def warm(
    url: str = typer.Argument(
        None, help="fsspec prefix, glob or object URL (or --like NAME)"
    ),
    preprocess: str = typer.Option(
        None,
        help="the job's preprocess: raw, decode_image, decode_image_chw, or "
        "module:function; default: the job's default for the URL",
    ),
    target: str = typer.Option(None, help="the job's target, as module:function"),
    format: str = typer.Option(  # noqa: A002
        None, "--format", help="the job's format= (tar, parquet, hdf5, lmdb, npy)"
    ),
    format_option: list[str] = typer.Option(
        [], "--format-option", help="KEY=VALUE (JSON value) of the job's format_options"
    ),
    like: str = typer.Option(
        None, "--like", help="copy the spec a job registered dataset NAME with"
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="start a new generation if the spec differs from the cached one",
    ),
    name: str = typer.Option(None, help="dataset name; default derived from URL"),
    endpoint_url: str = typer.Option(None, help="S3 endpoint (e.g. a local emulator)"),
    storage_option: list[str] = typer.Option(
        [], "--storage-option", "-o", help="KEY=VALUE for fsspec"
    ),
    batch: int = typer.Option(8, min=1, help="chunks per store request"),
    chunk_samples: int = typer.Option(
        4096, min=1, help="objects per chunk (the first listing of a dataset fixes it)"
    ),
    steps: int = typer.Option(
        None,
        min=1,
        help="warm only the chunks of every rank's first STEPS batches",
    ),
    world_size: int = typer.Option(1, min=1, help="ranks of the job (with --steps)"),
    batch_size: int = typer.Option(1, min=1, help="per-rank batch (with --steps)"),
    seed: int = typer.Option(0, help="the job's dataset seed (with --steps)"),
    epoch: int = typer.Option(0, min=0, help="the epoch to warm (with --steps)"),
    shuffle: str = typer.Option(
        "shard", help="the job's shuffle: shard, global or none (with --steps)"
    ),
    rank_node: list[str] = typer.Option(
        [],
        "--rank-node",
        help="Ray node id of rank 0, 1, ... in order (default: sorted alive "
        "nodes in contiguous blocks of ranks)",
    ),
    redis_url: str = RedisOpt,
    namespace: str = NamespaceOpt,
    ray_address: str = typer.Option(None, envvar="RAY_ADDRESS"),
) -> None:
    """Pre-fill the cache: every chunk built once, spread over the nodes; with
    --steps K, exactly the chunks of each rank's first K batches, on its node."""
    from shardcache_server.warm import warm_dataset

    modes: dict[str, bool | str] = {"shard": True, "global": "global", "none": False}
    if shuffle not in modes:
        raise typer.BadParameter(
            f"--shuffle must be one of {list(modes)}, got {shuffle!r}"
        )
    with _friendly_errors():
        summary = warm_dataset(
            url,
            preprocess=preprocess,
            name=name,
            storage_options=_storage_options(endpoint_url, storage_option),
            redis_url=redis_url,
            namespace=namespace,
            ray_address=ray_address,
            batch=batch,
            chunk_samples=chunk_samples,
            console=console,
            steps=steps,
            world_size=world_size,
            batch_size=batch_size,
            seed=seed,
            epoch=epoch,
            shuffle=modes[shuffle],
            rank_nodes=rank_node or None,
            target=target,
            fmt=format,
            format_options=_format_options(format_option),
            like=like,
            force=force,
        )
    if steps is not None:
        console.print(
            f"first {steps} steps of {world_size} ranks: {summary['warmed_chunks']} "
            f"of {summary['chunks']} chunks ({summary['warmed_samples']} samples); "
            "rank nodes: "
            + ", ".join(f"{r}:{n[:8]}" for r, n in enumerate(summary["rank_nodes"]))
        )
    console.print(
        f"[green]warmed[/] {summary['dataset']}: {summary['objects']} objects, "
        f"{summary['fetched']} fetched, {summary['already_cached']} already cached, "
        f"{summary['bytes'] / 2**20:.1f} MiB in {summary['seconds']:.1f}s"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


@app.command()
def stats(
    name: str = typer.Argument(None, help="dataset; default: all"),
    by_job: bool = typer.Option(False, "--by-job", help="a row per recent job"),
    redis_url: str = RedisOpt,
    namespace: str = NamespaceOpt,
) -> None:
    """Hit rate of the samples ranks delivered (local/peer/source), GETs saved,
    and the stores' own traffic apart."""
    from shardcache.usage import ORIGINS, UsageReader

    with _friendly_errors():
        index = _running_index(redis_url, namespace)
        if name:
            _require_dataset(index, name)
        usage = UsageReader(index.client, namespace, index.url)
        names = [name] if name else index.datasets()
        served = Table(
            Column("dataset", no_wrap=True),
            "job" if by_job else "gen",
            Column("samples", no_wrap=True),
            Column("hit rate", no_wrap=True),
            Column("by bytes", no_wrap=True),
            Column("local", no_wrap=True),
            Column("peer", no_wrap=True),
            Column("source", no_wrap=True),
            Column("GETs saved", min_width=5),
            Column("blocked s", min_width=7),
            title="Samples delivered to ranks (rank-reported; origins by samples)",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            collapse_padding=True,
        )
        lost: list[str] = []
        store = Table(
            Column("dataset", no_wrap=True),
            "hits",
            "misses",
            Column("hit rate", no_wrap=True),
            "GETs to source",
            "MiB read",
            "errors",
            "evictions",
            title="Store traffic (requests that reached a store)",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            collapse_padding=True,
        )
        for ds in names:
            record, s = index.dataset(ds), index.stats(ds)
            rows = [(str(record.generation if record else "-"), usage.totals(ds))]
            if by_job:
                rows = list(usage.jobs(ds).items())
            for label, t in rows:
                f = t.as_dict()
                served.add_row(
                    ds,
                    label,
                    str(f["samples"]),
                    _pct(f["hit_rate"]),
                    _pct(f["byte_hit_rate"]),
                    *(_pct(f["sample_ratio"][o]) for o in ORIGINS),
                    str(f["gets_saved"]),
                    f"{f['blocked_s']:.1f}",
                )
                if f["skipped"]:
                    lost.append(
                        f"{ds} {label}: {f['skipped']} samples skipped "
                        "(on_error='skip'): their objects could not be read or built"
                    )
                if f["lost_samples"]:
                    lost.append(
                        f"{ds} {label}: {f['lost_samples']} samples served while "
                        "Redis was unreachable too long were never reported"
                    )
            store.add_row(
                ds,
                str(s.hits),
                str(s.misses),
                _pct(s.hit_rate if s.hits + s.misses else None),
                str(s.remote_reads),
                f"{s.bytes_read / 2**20:.1f}",
                str(s.errors),
                str(s.evictions),
            )
    console.print(served)
    for line in lost:
        console.print(f"[yellow]lost:[/] {line}")
    console.print(store)


@app.command()
def invalidate(
    name: str, redis_url: str = RedisOpt, namespace: str = NamespaceOpt
) -> None:
    """Start a new generation: every store drops the dataset, readers re-fetch.
    Exit 1 when nothing runs, 2 for an unknown name."""
    with _friendly_errors():
        index = _running_index(redis_url, namespace)
        _require_dataset(index, name)
        generation = index.invalidate(name, "cli invalidate")
    if generation == 0:
        err_console.print(
            f"[red]error:[/] no dataset named {name!r}; see `shardcache ls`."
        )
        raise typer.Exit(2)
    console.print(f"{name}: now generation {generation}")


@app.command("ls")
def list_datasets(redis_url: str = RedisOpt, namespace: str = NamespaceOpt) -> None:
    """Datasets, generations and cached bytes per node (exit 1 when nothing runs)."""
    with _friendly_errors():
        index = _running_index(redis_url, namespace)
        table = Table(
            "dataset", "generation", "objects", "source MiB", "cached MiB per node"
        )
        stores = index.stores()
        for ds in index.datasets():
            record = index.dataset(ds)
            if record is None:
                continue
            per_node = {
                n[:8]: info.get("bytes_by_dataset", {}).get(ds, 0)
                for n, info in stores.items()
            }
            cached = (
                ", ".join(f"{n}: {b / 2**20:.1f}" for n, b in per_node.items() if b)
                or "-"
            )
            table.add_row(
                ds,
                str(record.generation),
                str(record.objects),
                f"{record.total_bytes / 2**20:.1f}",
                cached,
            )
    console.print(table)


@app.command()
def verify(
    name: str,
    repair: bool = typer.Option(
        False, "--repair", help="drop and rebuild (once) chunks failing their checksum"
    ),
    redis_url: str = RedisOpt,
    namespace: str = NamespaceOpt,
    ray_address: str = typer.Option(None, envvar="RAY_ADDRESS"),
) -> None:
    """Check that the index and the stores agree for a dataset and that every
    cached chunk's contents match its checksum (exit 1 if not, or when nothing
    runs; 2 for an unknown name)."""
    from shardcache.embedded import attach_ray
    from shardcache_server.cluster import alive_nodes, store_for_node
    from shardcache_server.verify import check_agreement, check_contents

    with _friendly_errors():
        index = _running_index(redis_url, namespace)
        _require_dataset(index, name)
        try:
            attach_ray(ray_address, may_start=False)
        except ShardUnavailable as exc:
            if ray_address:
                raise
            err_console.print(f"[yellow]nothing running:[/] {exc}")
            raise typer.Exit(1) from None
        handles = {
            n: h
            for n in alive_nodes()
            if (h := store_for_node(namespace, n)) is not None
        }
        corrupt, checked, repaired = check_contents(handles, name, repair)
        problems = check_agreement(index, handles, name)
    for p in problems:
        console.print(f"[red]mismatch:[/] {p}")
    for p in corrupt:
        console.print(f"[red]corrupt:[/] {p}")
    for p in repaired:
        console.print(f"[green]repaired:[/] {p}")
    hint = "" if repair or not corrupt else " (run with --repair to rebuild them)"
    console.print(
        f"{name}: {len(problems)} mismatch(es) across {len(handles)} store(s); "
        f"{len(corrupt)} corrupt chunk(s) of {checked} checked{hint}"
        + (f", {len(repaired)} repaired" if repair else "")
    )
    raise typer.Exit(1 if problems or corrupt else 0)


@app.command()
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

    with _friendly_errors():
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


@app.command()
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

    with _friendly_errors():
        index = _running_index(redis_url, namespace)
        serve(
            redis_url=index.url,
            namespace=namespace,
            host=host,
            port=port,
            token=token,
            allow_no_token=allow_no_token,
        )


@app.command()
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

    with _friendly_errors():
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


@app.command()
def selftest(
    ray_address: str = typer.Option(None, envvar="RAY_ADDRESS"),
    dashboard_url: str = typer.Option(None, help="also GET <url>/healthz"),
    redis_url: str = RedisOpt,
    namespace: str = NamespaceOpt,
) -> None:
    """Installed-cache check (the chart's `helm test`): Redis, dashboard, warm and hit."""
    from shardcache_server.selftest import run_selftest

    with _friendly_errors():
        run_selftest(
            ray_address=ray_address,
            dashboard_url=dashboard_url,
            redis_url=redis_url,
            namespace=namespace,
            console=console,
        )


@local_app.command("stop")
def local_stop() -> None:
    """Stop the embedded Redis and Ray that shardcache started on this machine;
    returns once they have exited."""
    from shardcache.embedded import stop_local

    stopped = stop_local()
    console.print(
        "stopped: " + (", ".join(stopped) if stopped else "nothing was running")
    )


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())


if __name__ == "__main__":  # python -m shardcache_server.cli
    app()

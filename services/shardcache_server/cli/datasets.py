"""The per-dataset commands: ``stats``, ``ls``, ``invalidate`` and ``verify``."""

from __future__ import annotations

from typing import Any

import typer
from rich import box
from rich.table import Column, Table

from shardcache.errors import ShardUnavailable
from shardcache_server.cli.options import (
    NamespaceOpt,
    RedisOpt,
    console,
    err_console,
    friendly_errors,
    print_table,
    require_dataset,
    running_index,
)
from shardcache_server.overview import live_stores

__all__ = ["invalidate", "list_datasets", "stats", "verify"]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def stats(
    name: str = typer.Argument(None, help="dataset; default: all"),
    by_job: bool = typer.Option(False, "--by-job", help="a row per recent job"),
    job: str = typer.Option(
        None, "--job", help="one job: what it read (listing, generation) and got"
    ),
    redis_url: str = RedisOpt,
    namespace: str = NamespaceOpt,
) -> None:
    """Hit rate of the samples ranks delivered (local/peer/source), GETs saved,
    and the stores' own traffic apart. With --by-job or --job, each job's
    record: the listing digest and cache generation it read. Exit 2 for an
    unknown dataset, or a job that read none."""
    from shardcache.keys import validate_name
    from shardcache.usage import ORIGINS, UsageReader

    with friendly_errors():
        index = running_index(redis_url, namespace)
        if name:
            require_dataset(index, name)
        usage = UsageReader(index.client, namespace, index.url)
        names = [name] if name else index.datasets()
        if job is not None:
            validate_name("--job", job)
            names = usage.datasets_of_job(names, job)
            if not names:
                where = f"dataset {name!r}" if name else "any dataset"
                err_console.print(
                    f"[red]error:[/] job {job!r} did not report reading {where}; see "
                    "`shardcache stats --by-job` for recent jobs."
                )
                raise typer.Exit(2)
        served = Table(
            Column("dataset", no_wrap=True),
            Column("job" if by_job or job else "gen", no_wrap=True),
            Column("samples", no_wrap=True),
            # Headers may wrap: four origins fit 80 columns with the figures whole.
            Column("hit rate", min_width=6),
            Column("by bytes", min_width=6),
            Column("local", no_wrap=True),
            Column("disk", no_wrap=True),
            Column("peer", no_wrap=True),
            Column("source", no_wrap=True),
            Column("GETs saved", min_width=5),
            Column("blocked s", min_width=7),
            title="Samples delivered to ranks (rank-reported; origins by samples)",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            collapse_padding=True,
        )
        lost: list[str] = []  # delivered while Redis was down, never reported
        skipped: list[str] = []  # on_error='skip': replaced, not delivered
        read: list[str] = []
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
            if job is not None:
                rows = [(job, usage.job_totals(ds, job))]
            elif by_job:
                rows = list(usage.jobs(ds).items())
            if job is not None or by_job:
                for j, r in usage.job_reads(ds, [j for j, _ in rows]).items():
                    read.append(
                        f"{ds} job {j}: listing {r.listing or '-'}, generation "
                        f"{'-' if r.generation is None else r.generation}"
                    )
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
                    skipped.append(
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
    print_table(served)
    for line in read:
        console.print(f"read: {line}", soft_wrap=True)
    for line in skipped:
        console.print(f"[yellow]skipped:[/] {line}")
    for line in lost:
        console.print(f"[yellow]lost:[/] {line}")
    print_table(store)


def invalidate(
    name: str, redis_url: str = RedisOpt, namespace: str = NamespaceOpt
) -> None:
    """Start a new generation: every store drops the dataset, readers re-fetch.
    Exit 1 when nothing runs, 2 for an unknown name."""
    with friendly_errors():
        index = running_index(redis_url, namespace)
        require_dataset(index, name)
        generation = index.invalidate(name, "cli invalidate")
    if generation == 0:
        err_console.print(
            f"[red]error:[/] no dataset named {name!r}; see `shardcache ls`."
        )
        raise typer.Exit(2)
    console.print(f"{name}: now generation {generation}")


def list_datasets(redis_url: str = RedisOpt, namespace: str = NamespaceOpt) -> None:
    """Datasets, generations and cached bytes per node, in memory and on the
    disk tier (exit 1 when nothing runs)."""
    with friendly_errors():
        index = running_index(redis_url, namespace)
        names = index.datasets()
        table = Table(
            # Never cut: the name is what `stats` and `invalidate` take.
            Column("dataset", no_wrap=True, min_width=max(map(len, names), default=7)),
            "generation",
            "objects",
            "source MiB",
            "memory MiB, per node",
            "disk MiB, per node",
        )
        stores = live_stores(index)  # a gone node's memory is not the cache's
        for ds in names:
            record = index.dataset(ds)
            if record is None:
                continue
            table.add_row(
                ds,
                str(record.generation),
                str(record.objects),
                f"{record.total_bytes / 2**20:.1f}",
                _per_node(stores, "bytes_by_dataset", ds),
                _per_node(stores, "disk_bytes_by_dataset", ds),
            )
    print_table(table)


def _per_node(stores: dict[str, dict[str, Any]], field: str, ds: str) -> str:
    """``node: MiB`` of ``ds`` for every store that reports some, else ``-``."""
    per_node = {n[:8]: info.get(field, {}).get(ds, 0) for n, info in stores.items()}
    return ", ".join(f"{n}: {b / 2**20:.1f}" for n, b in per_node.items() if b) or "-"


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

    with friendly_errors():
        index = running_index(redis_url, namespace)
        require_dataset(index, name)
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

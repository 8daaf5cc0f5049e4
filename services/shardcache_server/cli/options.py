"""What every subcommand shares: the consoles, the --redis-url and --namespace options,
one-line errors, and finding the index a command reads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from shardcache.errors import IndexUnavailable, ShardCacheError, ShardUnavailable

__all__ = [
    "NamespaceOpt",
    "RedisOpt",
    "console",
    "err_console",
    "friendly_errors",
    "print_table",
    "require_dataset",
    "running_index",
]

console = Console()
err_console = Console(stderr=True)
_UNBOUNDED = 10_000  # columns: wide enough to measure any table's natural width


def print_table(table: Table) -> None:
    """Print ``table`` whole. Rich fits a table to the terminal by cutting
    its cells ("sour…", "2…"), which would hide the figures; a table wider
    than the terminal is printed at its own width instead, and the terminal
    wraps its lines."""
    need = Measurement.get(console, console.options.update_width(_UNBOUNDED), table)
    if need.maximum <= console.width:
        console.print(table)
        return
    Console(
        width=need.maximum,
        file=console.file,
        color_system=console.color_system,
        force_terminal=console.is_terminal,
    ).print(table)

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
def friendly_errors() -> Iterator[None]:
    """Our errors print one clear line, never a traceback. Exit 1 where the
    cache cannot be reached (Redis or Ray: as when nothing runs), 2 for
    anything else (a bad argument, an unknown name, a source error)."""
    try:
        yield
    except ShardCacheError as exc:
        err_console.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}")
        unreachable = isinstance(exc, IndexUnavailable | ShardUnavailable)
        raise typer.Exit(1 if unreachable else 2) from None


def running_index(redis_url: str | None, namespace: str) -> Any:
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


def require_dataset(index: Any, name: str) -> None:
    """An unknown dataset name is an error (exit 2), never an empty result."""
    known = index.datasets()
    if name not in known:
        listed = ", ".join(sorted(known)) or "none"
        err_console.print(
            f"[red]error:[/] no dataset named {name!r} in namespace "
            f"{index.ns!r} (known: {listed}); see `shardcache ls`."
        )
        raise typer.Exit(2)

"""The ``shardcache`` app: every subcommand under its name, in the order ``--help`` lists them."""

from __future__ import annotations

import sys

import typer

from shardcache_server.cli.datasets import invalidate, list_datasets, stats, verify
from shardcache_server.cli.services import (
    dashboard,
    demo,
    local_stop,
    selftest,
    stores,
)
from shardcache_server.cli.warm import warm

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="shardcache: pull each remote object once, serve every DDP rank from its node.",
)
local_app = typer.Typer(
    help="The embedded local Redis and Ray that the SDK starts by default."
)
app.add_typer(local_app, name="local")

app.command()(warm)
app.command()(stats)
app.command()(invalidate)
app.command("ls")(list_datasets)
app.command()(verify)
app.command()(demo)
app.command()(dashboard)
app.command()(stores)
app.command()(selftest)
local_app.command("stop")(local_stop)


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())

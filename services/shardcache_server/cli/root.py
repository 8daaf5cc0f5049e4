"""The ``shardcache`` app: every subcommand under its name, in the order ``--help`` lists them."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

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


def _short(command: Callable[..., Any]) -> str:
    """The command list's line: the docstring's first paragraph as one
    line (the terminal wraps it), not cut where the source's lines end."""
    first = inspect.getdoc(command) or ""
    return " ".join(first.split("\n\n", 1)[0].split())


for name, command in (
    ("warm", warm),
    ("stats", stats),
    ("invalidate", invalidate),
    ("ls", list_datasets),
    ("verify", verify),
    ("demo", demo),
    ("dashboard", dashboard),
    ("stores", stores),
    ("selftest", selftest),
):
    app.command(name, short_help=_short(command))(command)
local_app.command("stop", short_help=_short(local_stop))(local_stop)


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())

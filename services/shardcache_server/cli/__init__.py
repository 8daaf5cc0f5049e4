"""The ``shardcache`` command line: warm, stats, invalidate, ls, demo, dashboard, local.

The package: ``root`` (the app and the list of its subcommands), ``options``
(what every subcommand shares: the consoles, ``--redis-url``/``--namespace``,
one-line errors, finding the index), and the subcommands by concept:
``warm``, ``datasets`` (stats, ls, invalidate, verify) and ``services``
(demo, dashboard, stores, selftest, local stop).
"""

from shardcache_server.cli.root import app, main

__all__ = ["app", "main"]

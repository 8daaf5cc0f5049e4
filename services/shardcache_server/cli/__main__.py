"""``python -m shardcache_server.cli``: the ``shardcache`` command."""

from shardcache_server.cli.root import app

app()

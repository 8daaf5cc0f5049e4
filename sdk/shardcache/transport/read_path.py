"""Which transport this process reads the cache through (``open_client``).

1. ``endpoint`` (``SHARDCACHE_ENDPOINT``) set, or the chart's mount path
   ``/var/run/shardcache/endpoint.sock`` present: this node's endpoint
   (``unix.py``). A configured socket that is missing raises
   :class:`EndpointUnavailable` naming the node and the path; there is no
   fallback to Ray.
2. Else ``allow_remote`` (``SHARDCACHE_ALLOW_REMOTE``): stream from a cache
   worker on another node (``flight.py``, Arrow Flight).
3. Else ``node_name`` (``SHARDCACHE_NODE_NAME``, which the chart's pod
   snippet sets from the downward API) set: :class:`EndpointUnavailable`.
4. Else the Ray path (``direct.py``): a Ray node, or the embedded defaults.

The dataset, sampler and reader code are the same on every path; only the
transport differs.
"""

from __future__ import annotations

import os
from typing import Any

from shardcache.config import ClientConfig
from shardcache.errors import ConfigError
from shardcache.transport.direct import CacheClient
from shardcache.transport.flight import FlightClient
from shardcache.transport.unix import EndpointClient, endpoint_unavailable
from shardcache.transport.wire import DEFAULT_SOCKET

__all__ = ["open_client"]


def open_client(config: ClientConfig) -> Any:
    """The client for this process's read path (see the module docstring).

    Raises:
        EndpointUnavailable: an endpoint is configured (or the pod says which
            node it is on) but no socket is reachable, and remote reads are off.
        ConfigError: ``allow_remote`` without ``remote_url``.
    """
    path = config.endpoint or (
        DEFAULT_SOCKET if os.path.exists(DEFAULT_SOCKET) else None
    )
    if path is not None and os.path.exists(path):
        return EndpointClient(config, path)
    if config.allow_remote:
        if not config.remote_url:
            raise ConfigError(
                "allow_remote=True needs the cache workers' streaming address: set "
                "SHARDCACHE_REMOTE_URL (grpc+tls://<release>-shardcache-flight.<ns>.svc:8815)."
            )
        return FlightClient(config)
    if path is not None:
        raise endpoint_unavailable(config, path, "no such socket")
    if config.node_name:
        raise endpoint_unavailable(
            config, DEFAULT_SOCKET, "SHARDCACHE_ENDPOINT not set and no socket mounted"
        )
    return CacheClient(config)

"""Which transport this process reads the cache through (``open_client``).

1. ``endpoint`` (``SHARDCACHE_ENDPOINT``) set, or the chart's mount path
   ``/var/run/shardcache/endpoint.sock`` present: this node's endpoint
   (``unix.py``). A configured socket that is missing raises
   :class:`EndpointUnavailable` naming the node and the path; there is no
   fallback to Ray.
2. Else ``allow_remote`` (``SHARDCACHE_ALLOW_REMOTE``): stream from a cache
   worker on another node: ``tcp://`` / ``tls://`` URLs over the TCP stream
   (``stream.py``), ``grpc://`` ones over Arrow Flight (``flight.py``).
3. Else ``node_name`` (``SHARDCACHE_NODE_NAME``, which the chart's pod
   snippet sets from the downward API) set: :class:`EndpointUnavailable`.
4. Else the Ray path (``direct.py``): a Ray node, or the embedded defaults.

The dataset, sampler and reader code are the same on every path; only the
transport differs. ``open_for_this_process`` is ``open_client`` plus the two
checks that depend on the process asking: a forked DataLoader worker cannot
read through Ray, and ``from_dataset`` needs Ray to ship its Dataset.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from shardcache.config import ClientConfig
from shardcache.errors import ConfigError
from shardcache.transport.direct import CacheClient
from shardcache.transport.flight import FlightClient
from shardcache.transport.stream import StreamClient, is_stream_url
from shardcache.transport.unix import EndpointClient, endpoint_unavailable
from shardcache.transport.wire import DEFAULT_SOCKET

__all__ = ["open_client", "open_for_this_process"]


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
                "SHARDCACHE_REMOTE_URL (tls://<release>-shardcache-flight.<ns>.svc:8816)."
            )
        if is_stream_url(config.remote_url):
            return StreamClient(config)
        return FlightClient(config)
    if path is not None:
        raise endpoint_unavailable(config, path, "no such socket")
    if config.node_name:
        raise endpoint_unavailable(
            config, DEFAULT_SOCKET, "SHARDCACHE_ENDPOINT not set and no socket mounted"
        )
    return CacheClient(config)


def _ray_inherited_by_fork() -> bool:
    """In a process that is not the one that built the dataset: is Ray's
    connection inherited (fork) rather than absent (spawn)?"""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def open_for_this_process(
    config: ClientConfig, *, forked: bool = False, ships_objects: bool = False
) -> Any:
    """This process's cache client (``open_client``), checked for what it must do.

    Raises:
        ConfigError: a forked DataLoader worker would read through Ray, which
            cannot be used after fork; or a ``from_dataset`` Dataset object
            would have to travel to the stores on a path without Ray.
    """
    client = open_client(config)
    if ships_objects and not client.needs_ray:
        raise ConfigError(
            "from_dataset ships the Dataset object to the cache workers through "
            "Ray, so it needs a process on a Ray node (Ray Train, or torchrun on "
            "the cache's Ray nodes); pods reading through the node-local endpoint "
            "or remotely can read packed files (format=) instead."
        )
    if forked and client.needs_ray and _ray_inherited_by_fork():
        raise ConfigError(
            "this DataLoader worker was forked from a process connected to "
            "Ray, and Ray cannot be used after fork (its calls would hang). "
            "Pass multiprocessing_context='spawn' (or 'forkserver') to the "
            "DataLoader, or iterate ds.loader(batch_size) in the rank."
        )
    return client

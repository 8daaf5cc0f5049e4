"""The node-local endpoint: serves training pods that are not Ray nodes.

``service.py`` answers requests (the same calls a Ray rank makes), ``shm.py``
owns the chunk files handed over, and the transports only move replies:
``unix.py`` (this node's ranks, descriptors over a Unix socket), and for
other nodes' ranks ``stream.py`` (the chunk files' bytes over TCP or TLS,
``sendfile``) and ``flight.py`` (Arrow Flight). ``__main__.py`` runs them:
``python -m shardcache_server.endpoint``. The rank's side is
``shardcache.transport``.
"""

from __future__ import annotations

from shardcache_server.endpoint.service import Endpoint, EndpointSettings
from shardcache_server.endpoint.shm import ShmFiles
from shardcache_server.endpoint.unix import serve_unix

__all__ = ["Endpoint", "EndpointSettings", "ShmFiles", "serve_unix"]

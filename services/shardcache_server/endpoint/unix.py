"""The endpoint on a Unix socket: frames in, replies and read-only descriptors out.

Ranks on this node connect to the socket on a ``hostPath``; each frame is
one request (``shardcache.transport.wire``), answered by the endpoint, and
the chunk files of the reply travel as descriptors (``SCM_RIGHTS``).
"""

from __future__ import annotations

import os
import socketserver
from pathlib import Path

from shardcache.transport.wire import recv_frame, send_frame
from shardcache_server.endpoint.service import Endpoint, opened

__all__ = ["serve_unix"]


class _Handler(socketserver.BaseRequestHandler):
    server: _UnixServer

    def handle(self) -> None:
        sock = self.request
        while True:
            try:
                message, fds = recv_frame(sock)
            except (EOFError, OSError, ValueError):
                return
            for fd in fds:  # ranks send none; never keep what a peer pushed
                os.close(fd)
            reply, files = self.server.endpoint.handle(message)
            try:
                with opened(files) as fds:
                    send_frame(sock, reply, fds)
            except OSError:
                return


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, endpoint: Endpoint):
        self.endpoint = endpoint
        super().__init__(path, _Handler)


def serve_unix(endpoint: Endpoint) -> _UnixServer:
    """Bind the endpoint's socket (replacing a stale one) and return the server;
    call ``serve_forever()`` on it."""
    path = Path(endpoint.settings.endpoint_socket)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a socket left by a previous pod
    server = _UnixServer(str(path), endpoint)
    os.chmod(path, endpoint.settings.endpoint_socket_mode)
    return server

"""The endpoint's operations over plain TCP (or TLS), for ranks on other nodes.

The same requests as the Unix socket (``wire.py`` frames of JSON), but a
reply's chunk files cannot travel as descriptors across nodes: their bytes
follow the reply frame, which lists their sizes (``"sizes"``), sent with
``sendfile`` from the file the endpoint wrote, so the server copies nothing
in user space. This is the cross-node path chosen over Arrow Flight by
measurement: Flight's client copies each message out of gRPC's slices and
pays HTTP/2's bookkeeping, 3-5x a socket's CPU per byte (BENCHMARKS.md,
"Flight against loopback TCP"); here the rank ``recv_into``s one aligned
buffer per chunk and views the columns in it.

The first frame of a connection must carry ``"token"`` equal to the
endpoint's streaming token (compared in constant time); anything else is
answered with a :class:`ConfigError` and the connection is closed before
any request reaches the endpoint. With a certificate and key the port
speaks TLS (the handshake runs in the connection's own thread). The client
is ``shardcache.transport.stream``.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import socket
import socketserver
import ssl
from typing import Any

from shardcache.errors import ConfigError
from shardcache.transport.wire import error_reply, recv_plain_frame, send_frame
from shardcache_server.endpoint.service import Endpoint, Files, opened

__all__ = ["serve_stream"]

log = logging.getLogger(__name__)


class _Handler(socketserver.BaseRequestHandler):
    server: _StreamServer

    def handle(self) -> None:
        sock = self.request
        try:
            if self.server.tls is not None:
                sock = self.server.tls.wrap_socket(sock, server_side=True)
            if not self._authenticated(sock):
                return
            while True:
                message = recv_plain_frame(sock)
                message.pop("token", None)
                reply, files = self.server.endpoint.handle(message)
                _send(sock, reply, files)
        except (EOFError, OSError, ValueError):
            return  # the peer went away, or sent what is not a frame

    def _authenticated(self, sock: Any) -> bool:
        first = recv_plain_frame(sock)
        token = str(first.pop("token", "") or "").encode()
        if not hmac.compare_digest(token, self.server.token):
            send_frame(
                sock,
                error_reply(
                    ConfigError(
                        "the cache worker's stream port refused this pod: missing or "
                        "wrong token. Set SHARDCACHE_REMOTE_TOKEN to the chart's "
                        "streaming token (Secret <release>-shardcache-flight-token)."
                    )
                ),
            )
            return False
        reply, files = self.server.endpoint.handle(first)
        _send(sock, reply, files)
        return "error" not in reply


def _send(sock: Any, reply: dict[str, Any], files: Files) -> None:
    """The reply frame with the files' sizes, then each file's bytes."""
    with opened(files) as fds:
        sizes = [os.fstat(fd).st_size for fd in fds]
        send_frame(sock, {**reply, "sizes": sizes})
        for fd, size in zip(fds, sizes, strict=True):
            # A plain socket sends from the page cache (sendfile); a TLS one
            # falls back to reading the file through a buffer.
            with os.fdopen(fd, "rb", closefd=False) as f:
                sock.sendfile(f, 0, size)


class _StreamServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    address_family = socket.AF_INET6

    def __init__(
        self,
        port: int,
        endpoint: Endpoint,
        token: str,
        tls: ssl.SSLContext | None,
    ):
        self.endpoint = endpoint
        self.token = token.encode()
        self.tls = tls
        super().__init__(("", port), _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            # one port for IPv4 and IPv6 callers (dual-stack pods)
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def serve_stream(endpoint: Endpoint) -> _StreamServer:
    """The TCP stream server of ``endpoint.settings`` (bound; call ``serve_forever()``).

    Raises:
        ConfigError: no token, or only one of certificate and key.
    """
    s = endpoint.settings
    token, files = s.streaming_credentials("stream_port")
    tls = None
    if files is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(*files)
    try:
        return _StreamServer(s.stream_port, endpoint, token, tls)
    except OSError as exc:
        if exc.errno != errno.EAFNOSUPPORT:
            raise
        # a kernel without IPv6 (ipv6.disable=1): IPv4 only
        return _StreamServerV4(s.stream_port, endpoint, token, tls)


class _StreamServerV4(_StreamServer):
    address_family = socket.AF_INET

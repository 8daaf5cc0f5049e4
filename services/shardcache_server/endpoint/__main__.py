"""Run the node-local endpoint until SIGTERM: ``python -m shardcache_server.endpoint``.

The Unix socket always; for other nodes' ranks the TCP stream when
``stream_port`` is set and Arrow Flight when ``flight_port`` is.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

from shardcache_server.endpoint.service import Endpoint, EndpointSettings
from shardcache_server.endpoint.unix import serve_unix

__all__ = ["main"]

log = logging.getLogger("shardcache_server.endpoint")


def main() -> None:
    """Run the endpoint until SIGTERM: Unix socket, and the stream and Flight
    ports when configured."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = EndpointSettings()
    endpoint = Endpoint(settings)
    endpoint.start()
    flight_server = None
    if settings.flight_port:
        # pyarrow is loaded only when another node's ranks are served
        from shardcache_server.endpoint.flight import serve_flight

        flight_server = serve_flight(endpoint)
        threading.Thread(target=flight_server.serve, daemon=True).start()
    stream_server = None
    if settings.stream_port:
        from shardcache_server.endpoint.stream import serve_stream

        stream_server = serve_stream(endpoint)
        threading.Thread(target=stream_server.serve_forever, daemon=True).start()
    server = serve_unix(endpoint)

    def stop(*_: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    log.info(
        "shardcache endpoint on %s (node %s, stream port %s, flight port %s)",
        settings.endpoint_socket,
        settings.node_name or "?",
        settings.stream_port or "off",
        settings.flight_port or "off",
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
        Path(settings.endpoint_socket).unlink(missing_ok=True)
        if flight_server is not None:
            flight_server.shutdown()
        if stream_server is not None:
            stream_server.shutdown()
        endpoint.files.clear()


if __name__ == "__main__":
    main()

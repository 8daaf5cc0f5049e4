"""How a process reaches the cache: one module per transport, and the choice among them.

* ``base.py``: the ``Transport`` protocol (where the cut is) and chunk ``Status``.
* ``direct.py``: ``CacheClient``, a Ray process reading its node's store.
* ``proxy.py``: ``ProxyClient``, the requests both cache-worker transports send.
* ``unix.py``: ``EndpointClient``, this node's endpoint over a Unix socket.
* ``stream.py``: ``StreamClient``, another node's cache worker over a TCP (TLS)
  stream: ``EndpointClient`` with the chunk bytes after each reply frame.
* ``flight.py``: ``FlightClient``, another node's cache worker over Arrow Flight.
* ``wire.py``: the endpoint's frames, errors and callables-by-name.
* ``read_path.py``: ``open_client(config)``, which of them this process uses.

Nothing is imported here: importing one module of the package loads no other client.
"""

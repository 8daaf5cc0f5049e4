"""A fork waits for this process's other threads' TLS handshakes
(``fork_guard``): a DataLoader worker forked while the usage flusher was in
a TLS handshake hung in its own first TLS call (a CI run of the ``tls://``
stream). Real TLS connections, real forks."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time

import pytest

from shardcache import fork_guard
from shardcache.fork_guard import io_call
from tests.helpers import self_signed_certificate

FORKS = 300  # about 1 in 100 hung without the guard


def _tls_server(cert, key) -> int:
    """A TLS echo server on loopback: its port."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)

    def answer(conn: socket.socket) -> None:
        try:
            with context.wrap_socket(conn, server_side=True) as tls:
                while data := tls.recv(64):
                    tls.sendall(data)
        except OSError:
            pass

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def _connect(context: ssl.SSLContext, port: int, guarded: bool) -> ssl.SSLSocket:
    """A handshake, marked as ``StreamClient._connect`` marks it when ``guarded``."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    if not guarded:
        return context.wrap_socket(raw, server_hostname="127.0.0.1")
    with io_call():
        return context.wrap_socket(raw, server_hostname="127.0.0.1")


def _client_context(cert) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def _wait(pid: int, timeout_s: float) -> bool:
    """Whether the child ended within ``timeout_s`` (killed if not)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return True
        time.sleep(0.005)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return False


def test_fork_guard_children_forked_beside_tls_calls_never_hang(tmp_path):
    cert, key = self_signed_certificate(tmp_path / "c.crt", tmp_path / "c.key")
    port = _tls_server(cert, key)
    context = _client_context(cert)  # one per client, made when it is built
    stop = threading.Event()

    def background() -> None:
        # The flusher's or a look-ahead's connection: a handshake, then
        # requests on it (unmarked: a fork must not wait for replies).
        while not stop.is_set():
            with _connect(context, port, guarded=True) as tls:
                for _ in range(5):
                    tls.sendall(b"request")
                    tls.recv(64)

    threads = [threading.Thread(target=background, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    hung = 0
    try:
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:  # a forked worker builds its own client and connects
                try:
                    with _connect(_client_context(cert), port, guarded=True) as tls:
                        tls.sendall(b"x")
                        tls.recv(64)
                finally:
                    os._exit(0)
            hung += not _wait(pid, 5.0)
    finally:
        stop.set()
    assert hung == 0


def _call_in_flight() -> threading.Event:
    """A thread inside ``io_call`` until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def call() -> None:
        with io_call():
            started.set()
            release.wait(30)

    threading.Thread(target=call, daemon=True).start()
    started.wait(5)
    return release


def test_fork_guard_a_fork_waits_for_a_call_in_flight_then_blocks_none_after():
    release = _call_in_flight()
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        with io_call():  # a child starts with nothing in flight
            pass
        os._exit(0)
    waited = time.monotonic() - t0
    assert _wait(pid, 10)
    assert waited >= 0.25  # the fork waited for the call
    with io_call():  # and the parent's calls go on after it
        pass


def test_fork_guard_a_stuck_call_delays_one_fork_by_the_bound_only(monkeypatch):
    monkeypatch.setattr(fork_guard, "FORK_WAIT_S", 0.2)
    release = _call_in_flight()
    waited = []
    for _ in range(2):
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        waited.append(time.monotonic() - t0)
        assert _wait(pid, 10)
    release.set()
    # The first fork waited the bound; the next did not wait again for the
    # same stuck call (a DataLoader forks its workers one after another).
    assert 0.15 <= waited[0] < 5 and waited[1] < 0.1


@pytest.fixture(autouse=True)
def _nothing_left_in_flight():
    yield
    deadline = time.monotonic() + 5  # a released call's thread is ending
    while fork_guard._active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fork_guard._active == 0

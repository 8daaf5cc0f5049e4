"""Forks wait for this process's other threads' TLS handshakes.

A DataLoader forks its workers from the training loop while this process's
own threads may be opening a ``tls://`` stream connection to a remote cache
worker (the usage flusher's, or a look-ahead's: each thread has its own
connection). A child forked while one of them is inside an OpenSSL
handshake inherits OpenSSL's locks as that thread held them, and the
child's own first TLS call waits on them forever: about 1 fork in 100 hung
in a loop of forks beside a thread making TLS connections, and a CI run saw
a DataLoader worker of the ``tls://`` stream hang until its 120 s timeout.

``io_call()`` marks such a handshake; a fork (through
``os.register_at_fork``, so also ``multiprocessing``'s) waits until none is
in flight and lets no new one start until the fork is done. Only the
handshake is marked, never a request's wait for its reply (which may be a
cold chunk's build): a fork must not wait for the cache. The wait is
bounded by ``FORK_WAIT_S`` (a handshake to a host that does not answer),
and once a fork gave up, the next ones do not wait again for the same
stuck calls. Not covered: gRPC's own threads (Arrow Flight's ``grpc+tls``;
read it with spawned workers) and ``rediss://`` on the Ray path, whose
forked workers are refused anyway.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FORK_WAIT_S", "io_call"]

FORK_WAIT_S = 10.0  # longest a fork waits for other threads' handshakes

_cond = threading.Condition()
_active = 0  # calls in flight, over all threads
_started = 0  # calls ever started: tells new calls from stuck ones
_gave_up_at = -1  # _started when a fork last stopped waiting
_forking = False


@contextmanager
def io_call() -> Iterator[None]:
    """Run the body (a TLS handshake) as one call that a fork waits for.

    >>> with io_call():
    ...     pass
    """
    global _active, _started
    with _cond:
        # A thread cannot be forking and calling at once: the wait ends
        # when the forking thread's after-fork hook clears the flag.
        while _forking:
            _cond.wait()
        _active += 1
        _started += 1
    try:
        yield
    finally:
        with _cond:
            _active -= 1
            if _active == 0:
                _cond.notify_all()


def _before_fork() -> None:
    global _forking, _gave_up_at
    with _cond:
        _forking = True
        if _started == _gave_up_at:
            return  # only the calls an earlier fork gave up on: no new wait
        deadline = time.monotonic() + FORK_WAIT_S
        while _active and (left := deadline - time.monotonic()) > 0:
            _cond.wait(left)
        if _active:
            _gave_up_at = _started


def _after_fork_in_parent() -> None:
    global _forking
    with _cond:
        _forking = False
        _cond.notify_all()


def _after_fork_in_child() -> None:
    # The parent's threads are not in the child: nothing is in flight here.
    global _cond, _active, _forking, _gave_up_at
    _cond, _active, _forking, _gave_up_at = threading.Condition(), 0, False, -1


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)

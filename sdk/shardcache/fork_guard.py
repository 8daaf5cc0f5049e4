"""Forks wait for the network calls of this process's other threads.

A DataLoader forks its workers from the training loop while this process's
own threads may be talking to the cache: the usage flusher's heartbeat, a
look-ahead resolve, a background rank report. A child forked while one of
them is inside OpenSSL (a TLS handshake to a remote cache worker) inherits
OpenSSL's locks as that thread held them, and the child's first TLS call
waits on them forever: about 1 fork in 100 hung in a loop of forks beside a
thread making TLS connections, and a CI run saw a DataLoader worker of the
``tls://`` stream hang until its 120 s timeout. The same holds for any
library lock held at the fork (redis-py's pool, gRPC).

``io_call()`` marks a call to the cache's network; a fork (through
``os.register_at_fork``, so also ``multiprocessing``'s) waits until none is
in flight and lets no new one start until the fork is done. The wait is
bounded by ``FORK_WAIT_S``: a call stuck past it (an unreachable server
that has not yet timed out) must not stop the training loop from starting
its workers; the fork then goes ahead as it would without this guard.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FORK_WAIT_S", "io_call"]

FORK_WAIT_S = 30.0  # longest a fork waits for other threads' calls to end

_cond = threading.Condition()
_active = 0  # calls in flight, over all threads
_forking = False
_depth = threading.local()  # nested calls of one thread count once


@contextmanager
def io_call() -> Iterator[None]:
    """Run the body as one network call that a fork waits for.

    >>> with io_call():
    ...     pass
    """
    global _active
    depth = getattr(_depth, "n", 0)
    if depth == 0:
        with _cond:
            # A thread cannot be forking and calling at once: the wait ends
            # when the forking thread's after-fork hook clears the flag.
            while _forking:
                _cond.wait()
            _active += 1
    _depth.n = depth + 1
    try:
        yield
    finally:
        _depth.n = depth
        if depth == 0:
            with _cond:
                _active = max(_active - 1, 0)  # 0 in a child forked inside the call
                if _active == 0:
                    _cond.notify_all()


def _before_fork() -> None:
    global _forking
    own = 1 if getattr(_depth, "n", 0) else 0  # a fork from inside a call
    with _cond:
        _forking = True
        deadline = time.monotonic() + FORK_WAIT_S
        while _active > own and (left := deadline - time.monotonic()) > 0:
            _cond.wait(left)


def _after_fork_in_parent() -> None:
    global _forking
    with _cond:
        _forking = False
        _cond.notify_all()


def _after_fork_in_child() -> None:
    # The parent's threads are not in the child: nothing is in flight here.
    global _cond, _active, _forking, _depth
    _cond, _active, _forking = threading.Condition(), 0, False
    _depth = threading.local()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)

"""A pool of daemon threads for work the process must not wait for at exit.

``ThreadPoolExecutor`` joins its threads when the interpreter shuts down,
after running every item still queued. For the look-ahead that is every
chunk build the rank asked for ahead of the loop: a script that stops
after a few batches on a cold cache (a quick check, a ``break``, Ctrl-C)
then sat at exit until the stores had built them all (100 k objects from
S3: 100 s after a first batch at 2.7 s). The builds do not need the
process: the stores run and keep them whether or not anybody waits. So the
look-ahead runs on daemon threads, which the interpreter abandons at exit.

A daemon thread must not be inside Ray when Ray shuts down (the process
then dies of SIGSEGV in Ray's core worker): a pool thread waits on Ray in
short slices (:func:`in_pool`, ``transport/direct.py``), and at exit,
before Ray's own exit hook, :data:`EXITING` is set and the busy threads are
given a moment to leave (:class:`Abandoned`).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["EXITING", "Abandoned", "DaemonPool", "in_pool"]

EXITING = threading.Event()  # the process is exiting: pool threads stop waiting
LEAVE_S = 2.0  # the most the exit hook waits for busy pool threads to leave

_local = threading.local()
_pools: weakref.WeakSet[DaemonPool] = weakref.WeakSet()


class Abandoned(Exception):
    """Raised in a pool thread waiting on Ray when the process exits."""


def in_pool() -> bool:
    """This thread is a :class:`DaemonPool`'s (its waits must be interruptible)."""
    return getattr(_local, "pool", False)


def _leave() -> None:
    """At exit, before Ray's hook (atexit runs last registered first): stop
    the pools' waits and let their busy threads return."""
    EXITING.set()
    deadline = time.monotonic() + LEAVE_S
    for pool in list(_pools):
        pool.shutdown(wait=False, cancel_futures=True)  # idle threads end now
        for thread in pool.threads():
            thread.join(max(0.0, deadline - time.monotonic()))


class DaemonPool:
    """``submit(fn, *args) -> Future`` on up to ``threads`` daemon threads.

    >>> pool = DaemonPool(2, "doc")
    >>> pool.submit(sum, [1, 2]).result()
    3
    >>> pool.shutdown()
    """

    def __init__(self, threads: int, name: str):
        self._threads: list[threading.Thread] = []
        self._size, self._name = threads, name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False
        self._running: set[threading.Thread] = set()
        _pools.add(self)
        # Last registered runs first: after Ray's hook (registered when ray
        # is imported), whichever pool came first.
        atexit.unregister(_leave)
        atexit.register(_leave)

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return list(self._threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("submit after shutdown")
            self._queue.put((future, fn, args))
            if self._idle == 0 and len(self._threads) < self._size:
                # The thread holds the pool weakly (as ThreadPoolExecutor's
                # do): a pool dropped without shutdown() wakes its threads
                # with sentinels and they end, instead of waiting forever.
                size, work = self._size, self._queue
                ref = weakref.ref(self, lambda _: [work.put(None) for _ in range(size)])
                thread = threading.Thread(
                    target=_work,
                    args=(ref, work),
                    name=f"{self._name}-{len(self._threads)}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """As ``ThreadPoolExecutor.shutdown``: queued items cancelled with
        ``cancel_futures``, running ones awaited with ``wait``."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()


def _work(ref: weakref.ref[DaemonPool], work: queue.SimpleQueue[Any]) -> None:
    _local.pool = True
    me = threading.current_thread()
    while True:
        pool = ref()
        if pool is None:
            return
        with pool._lock:
            pool._idle += 1
        del pool  # not held while waiting: the pool may be dropped meanwhile
        item = work.get()
        pool = ref()
        if item is None or pool is None:
            return
        with pool._lock:
            pool._idle -= 1
            pool._running.add(me)
        future, fn, args = item
        del item
        try:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # the caller's future carries it
                    future.set_exception(exc)
        finally:
            with pool._lock:
                pool._running.discard(me)
            del pool, future, fn, args

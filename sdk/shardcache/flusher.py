"""Reports without ceremony: counts reach Redis with no ``close()`` call.

One flusher per process (a rank, or a DataLoader worker it spawned) owns a
daemon thread that flushes every live :class:`~shardcache.usage.UsageReporter`
each ``FLUSH_INTERVAL_S`` (and writes a heartbeat every ``HEARTBEAT_S`` while
the process lives, so a rank in a long step is not taken for dead), and an
exit hook that runs the registered final reports (a rank's last report) and
flushes once more, within ``EXIT_DEADLINE_S``: an unreachable Redis never
holds up the end of a script or a DataLoader worker. An owner collected
before the process ends (a dataset built inside ``main()``, which the cyclic
GC may take once ``main`` returns) hands its reporter and last report over
with :func:`retire`, so its counts are written all the same.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardcache.usage import FLUSH_INTERVAL_S, HEARTBEAT_S

if TYPE_CHECKING:
    from shardcache.usage import UsageReporter

__all__ = ["EXIT_DEADLINE_S", "at_exit", "keep_flushed", "retire"]

log = logging.getLogger("shardcache")

# The most the exit hook may take, all reporters together: a final report to
# a Redis that is down would otherwise retry for minutes (redis-py's default
# retries x the connect timeout), and a DataLoader worker's parent gives it
# only 5 s before it SIGTERMs it.
EXIT_DEADLINE_S = 3.0


class _Flusher:
    """One per process: flushes every live reporter each ``FLUSH_INTERVAL_S``
    on a daemon thread, and runs the exit callbacks once when the process
    ends.

    The exit hook is a ``multiprocessing.util.Finalize``: it runs from
    ``atexit`` in a script (also after an uncaught exception) and from the
    exit of a ``multiprocessing`` child, where ``atexit`` never runs
    (DataLoader workers end through ``os._exit``). A SIGKILLed process
    loses at most one interval of counts.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.reporters: weakref.WeakSet[UsageReporter] = weakref.WeakSet()
        self.finals: dict[tuple[int, str], weakref.WeakMethod[Callable[[], None]]] = {}
        self.lock = threading.Lock()
        # Reporters whose owner was collected, each with the owner's last
        # report (retire()): written by the thread or the exit hook.
        self.retired: deque[tuple[UsageReporter, Callable[[], bool]]] = deque()
        self.drainer: threading.Thread | None = None
        # Those it closed: the exit hook does not close them again.
        self.drained: weakref.WeakSet[UsageReporter] = weakref.WeakSet()
        self.stop = threading.Event()
        self.done = False
        self.thread = threading.Thread(
            target=self._loop, name="shardcache-usage-flush", daemon=True
        )
        self.thread.start()
        multiprocessing.util.Finalize(None, self.at_exit, exitpriority=100)
        _exit_on_sigterm(self)

    def live(self) -> list[UsageReporter]:
        with self.lock:  # WeakSet iteration is not safe against a concurrent add
            return list(self.reporters)

    def _loop(self) -> None:
        beat_at = time.monotonic()
        while not self.stop.wait(FLUSH_INTERVAL_S):
            beat = time.monotonic() >= beat_at
            if beat:
                beat_at = time.monotonic() + HEARTBEAT_S
            for reporter in self.live():
                try:
                    if reporter.unflushed_samples or reporter.has_rank_counts:
                        reporter.flush()
                    elif beat:
                        reporter.heartbeat()
                except Exception as exc:  # the thread must outlive one bad flush
                    log.warning("shardcache: usage flush failed: %s", exc)
            busy = self.drainer is not None and self.drainer.is_alive()
            if self.retired and not busy and not self.stop.is_set():
                # On a thread of its own: a collected owner's Redis may be
                # gone, and its retries must not hold up the live flushes.
                drainer = threading.Thread(
                    target=self._drain, name="shardcache-retired", daemon=True
                )
                drainer.start()
                self.drainer = drainer  # started: the exit hook may join it

    def _drain(self) -> None:
        """The last reports and flushes of collected owners (retire())."""
        while True:
            try:
                reporter, last = self.retired.popleft()
            except IndexError:
                return
            try:
                if last():
                    reporter.close()
            except Exception as exc:  # as at exit: never kill the thread
                log.warning("shardcache: final report failed: %s", exc)
            with self.lock:  # WeakSet add vs the exit hook's iteration
                self.drained.add(reporter)

    def at_exit(self) -> None:
        """Final reports and flushes, bounded by ``EXIT_DEADLINE_S``."""
        with self.lock:
            if self.done:
                return
            # What lives now is held until reported: once done is set, an
            # owner the GC takes meanwhile is no longer retired (retire()).
            finals = [m for ref in self.finals.values() if (m := ref()) is not None]
            live = list(self.reporters)
            self.done = True
            self.finals.clear()
        self.stop.set()
        worker = threading.Thread(
            target=self._finish,
            args=(finals, live),
            name="shardcache-exit",
            daemon=True,
        )
        worker.start()
        worker.join(EXIT_DEADLINE_S)
        if worker.is_alive():
            log.warning(
                "shardcache: the final usage report did not reach Redis within "
                "%.0f s; up to one flush interval of samples is not counted",
                EXIT_DEADLINE_S,
            )

    def _finish(
        self, finals: list[Callable[[], None]], live: list[UsageReporter]
    ) -> None:
        for fn in finals:
            try:
                fn()
            except Exception as exc:  # never mask the script's own exit
                log.warning("shardcache: final report failed: %s", exc)
        self._drain()
        drainer = self.drainer
        if drainer is not None:  # what it took before the exit, written
            drainer.join()  # (at_exit bounds the whole of _finish)
        with self.lock:
            live = [r for r in live if r not in self.drained]
        for reporter in live:
            try:
                reporter.close()
            except Exception as exc:
                log.warning("shardcache: final usage flush failed: %s", exc)


_flusher: _Flusher | None = None


def _process_flusher() -> _Flusher:
    global _flusher
    if _flusher is None or _flusher.pid != os.getpid():  # new, or forked
        _flusher = _Flusher()
    return _flusher


def keep_flushed(reporter: UsageReporter) -> None:
    """Flush ``reporter`` in the background and at this process's exit."""
    flusher = _process_flusher()
    with flusher.lock:
        flusher.reporters.add(reporter)


def at_exit(method: Callable[[], None]) -> None:
    """Call the bound ``method`` when this process exits, if its object lives.

    Held weakly (a dataset that is garbage-collected is not kept alive), and
    once per object and method however often it is registered.
    """
    flusher = _process_flusher()
    owner = getattr(method, "__self__", None)
    key = (id(owner), getattr(method, "__name__", ""))
    with flusher.lock:
        flusher.finals[key] = weakref.WeakMethod(method)  # type: ignore[arg-type]


def retire(reporter: UsageReporter, last: Callable[[], bool], pid: int) -> None:
    """Run ``last()`` soon, and close ``reporter`` if it returns true: their
    owner, made in process ``pid``, was collected.

    Called from a ``weakref.finalize`` callback, which the cyclic GC may run
    on any thread while that thread holds any lock: hence no lock and no I/O
    here, only one atomic ``deque.append``; the flusher's thread (within
    ``FLUSH_INTERVAL_S``) or the exit hook does the writing. Dropped in a
    process other than ``pid`` (a forked child's copy of its parent's owner:
    the child's own flusher must not end the parent's report), and after the
    exit hook ran (whatever lived then it held and reported).
    """
    flusher = _flusher
    if pid != os.getpid():
        return
    if flusher is not None and flusher.pid == pid and not flusher.done:
        flusher.retired.append((reporter, last))


def _exit_on_sigterm(flusher: _Flusher) -> None:
    """Report before a SIGTERM ends the process, when nobody else handles it
    (torchrun SIGTERMs the other ranks when one fails; Kubernetes SIGTERMs a
    pod before killing it): run the bounded exit hook, then die of the
    signal as before. The hook runs on its own thread, so a lock the
    interrupted code holds delays it at most ``EXIT_DEADLINE_S``. Left alone
    when the process already has a handler (Ray's drivers turn SIGTERM into
    ``SystemExit``, a trainer may have its own), or off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def _terminated(signum: int, frame: object) -> None:
        flusher.at_exit()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, _terminated)

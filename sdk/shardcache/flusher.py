"""Reports without ceremony: counts reach Redis with no ``close()`` call.

One flusher per process (a rank, or a DataLoader worker it spawned) owns a
daemon thread that flushes every live :class:`~shardcache.usage.UsageReporter`
each ``FLUSH_INTERVAL_S``, and an exit hook that runs the registered final
reports (a rank's last report) and flushes once more.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardcache.usage import FLUSH_INTERVAL_S

if TYPE_CHECKING:
    from shardcache.usage import UsageReporter

__all__ = ["at_exit", "keep_flushed"]

log = logging.getLogger("shardcache")


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
        self.finals: list[weakref.WeakMethod[Callable[[], None]]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._loop, name="shardcache-usage-flush", daemon=True
        )
        self.thread.start()
        multiprocessing.util.Finalize(None, self.at_exit, exitpriority=100)
        _exit_on_sigterm()

    def _loop(self) -> None:
        while not self.stop.wait(FLUSH_INTERVAL_S):
            for reporter in list(self.reporters):
                if reporter.unflushed_samples or reporter.has_rank_counts:
                    reporter.flush()

    def at_exit(self) -> None:
        self.stop.set()
        with self.lock:
            finals, self.finals = self.finals, []
        for ref in finals:
            fn = ref()
            if fn is not None:
                try:
                    fn()
                except Exception as exc:  # never mask the script's own exit
                    log.warning("shardcache: final report failed: %s", exc)
        for reporter in list(self.reporters):
            reporter.close()


_flusher: _Flusher | None = None


def _process_flusher() -> _Flusher:
    global _flusher
    if _flusher is None or _flusher.pid != os.getpid():  # new, or forked
        _flusher = _Flusher()
    return _flusher


def keep_flushed(reporter: UsageReporter) -> None:
    """Flush ``reporter`` in the background and at this process's exit."""
    _process_flusher().reporters.add(reporter)


def at_exit(method: Callable[[], None]) -> None:
    """Call the bound ``method`` when this process exits, if its object lives.

    Held weakly: a dataset that is garbage-collected is not kept alive.
    """
    flusher = _process_flusher()
    with flusher.lock:
        flusher.finals.append(weakref.WeakMethod(method))  # type: ignore[arg-type]


def _exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` when nobody else handles it, so the
    exit hooks run: torchrun SIGTERMs the other ranks when one fails, and
    Kubernetes SIGTERMs a pod before killing it. Raising (rather than
    flushing inside the handler) unwinds the interrupted code first, so no
    lock it held is taken twice. Left alone when the process already has a
    handler (Ray workers, a trainer's own), or off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def _terminated(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one kills
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminated)

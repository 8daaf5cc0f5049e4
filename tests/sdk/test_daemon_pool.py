"""The look-ahead's daemon pool: work runs, a dropped pool's threads end, and
shutdown cancels what is queued."""

from __future__ import annotations

import gc
import threading
import time

from shardcache.daemon_pool import DaemonPool, in_pool


def test_work_runs_on_pool_threads_and_errors_reach_the_future() -> None:
    pool = DaemonPool(2, "t")
    assert pool.submit(in_pool).result(5) is True
    assert in_pool() is False
    failed = pool.submit(lambda: 1 / 0)
    assert isinstance(failed.exception(5), ZeroDivisionError)
    pool.shutdown()


def test_a_pool_dropped_without_shutdown_lets_its_threads_end() -> None:
    pool = DaemonPool(3, "dropped")
    for _ in range(3):
        pool.submit(time.sleep, 0.05)
    threads = pool.threads()
    assert threads
    del pool
    gc.collect()
    for thread in threads:
        thread.join(5)
    assert not any(t.is_alive() for t in threads)


def test_shutdown_cancels_what_is_queued() -> None:
    pool = DaemonPool(1, "queued")
    gate = threading.Event()
    running = pool.submit(gate.wait, 5)
    queued = [pool.submit(time.sleep, 0) for _ in range(3)]
    time.sleep(0.1)
    gate.set()
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result(5) is True
    assert all(f.cancelled() or f.done() for f in queued)

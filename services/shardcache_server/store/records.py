"""This store's writes to the index: entries, releases and events.

Ownership rule: every index write of the store goes through here, in a
thread pool off the event loop, and never raises; a write (or any index
call elsewhere) that fails sets ``dirty``, and upkeep re-records what the
table holds once Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardcache.errors import BackendError
from shardcache_server.index import ClusterIndex

__all__ = ["IndexRecords"]


class IndexRecords:
    """The store's link to the index and the pool that writes to it.

    Args:
        node_id: the Ray node this store serves (named in every event).
        me: ``node_id/incarnation``, the owner name this store claims under.
        workers: threads that write (writes are small and many).
    """

    def __init__(self, node_id: str, me: str, workers: int):
        self.node_id = node_id
        self.me = me
        # Set when the store starts (on its event loop); None before.
        self.index: ClusterIndex | None = None
        self.dirty = False  # what the index says may lag what the table holds
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="index-writes")

    def write(self, write: Callable[[ClusterIndex], Any]) -> None:
        """Run ``write`` in the pool; a failure marks the index dirty."""
        if self.index is None:
            return
        index = self.index

        def run() -> None:
            try:
                write(index)
            except BackendError:
                self.dirty = True

        self._pool.submit(run)

    def event(self, kind: str, dataset: str, **detail: Any) -> None:
        self.write(
            lambda idx: idx.push_event(kind, dataset, node=self.node_id, **detail)
        )

    async def release(self, dataset: str, generation: int, chunks: list[str]) -> None:
        """Give up this store's claims on ``chunks`` (best effort, awaited)."""
        if self.index is None:
            return
        with contextlib.suppress(BackendError):
            await asyncio.to_thread(
                self.index.release, dataset, generation, chunks, self.me
            )

    def close(self) -> None:
        self._pool.shutdown(wait=False)

"""A large S3 listing's sub-prefixes listed by other processes, so its parse uses more than one core.

A listing's CPU is the parse of its pages, ~15 us per key (BENCHMARKS.md,
"Listing"): 10 M keys are ~150 s of CPU in one process, whatever the
number of requests in flight, because the listing's threads share one
interpreter. The listing task (``listing._list_task``) therefore sends
groups of ``GROUP_PREFIXES`` sub-prefixes to Ray tasks, spread over the
cluster; each lists its group with an S3 client of its own (the same
retries and shared request budget as the listing) and returns one column
writer per sub-prefix, which the listing puts in that sub-prefix's slot:
the manifest's order is the keys' order, whichever group ends first. A
listing with fewer than two groups of sub-prefixes stays in one process
(a task costs more than it saves there), and so does a flat prefix, whose
pages are one chain of continuation tokens.

The tasks take no CPU resource (``num_cpus=0``, as the store's builds):
a cluster whose CPUs a Ray Train job has reserved would otherwise never
schedule them and the listing would wait for good; ``IN_FLIGHT`` bounds
how many run at once instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shardcache.manifest import ManifestWriter
from shardcache_server.budget import budget_from_spec
from shardcache_server.objects import Accept, list_prefixes

__all__ = ["GROUP_PREFIXES", "IN_FLIGHT", "FanOut"]

GROUP_PREFIXES = 8  # sub-prefixes per task (10 pages each at 10,000 keys)
IN_FLIGHT = 16  # tasks listing at once, at most one per CPU of the cluster


def _list_group(
    options: dict[str, Any],
    bucket: str,
    subs: list[str],
    accept: Accept,
    url: str,
    budget: dict[str, Any] | None,
) -> tuple[list[ManifestWriter], int]:
    return list_prefixes(options, bucket, subs, accept, url, budget_from_spec(budget))


class FanOut:
    """Lists groups of sub-prefixes in Ray tasks (``objects.list_source``'s ``fan_out``).

    Args:
        options: the source's storage options (each task opens its own client).
        budget: the source's request budget as plain values
            (``listing.listing_budget``), or ``None``.
        group: sub-prefixes per task. Defaults to ``GROUP_PREFIXES``.
    """

    def __init__(
        self,
        options: dict[str, Any],
        budget: dict[str, Any] | None,
        group: int = GROUP_PREFIXES,
    ):
        import ray

        self.group = group
        self._options, self._budget = dict(options), budget
        self._task = ray.remote(_list_group).options(
            num_cpus=0, max_retries=0, scheduling_strategy="SPREAD"
        )
        self._slots: asyncio.Semaphore | None = None

    async def list(
        self, bucket: str, subs: list[str], accept: Accept, url: str
    ) -> tuple[list[ManifestWriter], int]:
        """One writer per sub-prefix of ``subs`` (in order) and the keys seen.

        Raises:
            SourceNotFound, RemoteFetchError: as the listing in this process would.
        """
        import ray

        from shardcache.errors import ShardCacheError

        if self._slots is None:  # made on the listing's own event loop
            # Asked of the cluster only by a listing that sends groups out:
            # every store listing builds a FanOut, local files included.
            cpus = int(ray.cluster_resources().get("CPU", 1))
            self._slots = asyncio.Semaphore(max(1, min(IN_FLIGHT, cpus)))
        async with self._slots:
            ref = self._task.remote(
                self._options, bucket, subs, accept, url, self._budget
            )
            try:
                return await ref
            except ray.exceptions.RayTaskError as exc:
                # The listing's own errors (SourceNotFound, RemoteFetchError)
                # reach the store as themselves, not wrapped by Ray.
                if isinstance(exc.cause, ShardCacheError):
                    raise exc.cause from None
                raise

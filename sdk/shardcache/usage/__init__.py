"""What the ranks delivered, counted by the ranks: the figures behind the hit rate.

A store only sees the requests that reach it. A warm batch is served from
views the rank already holds and never reaches a store, so store-side
counters (``ClusterIndex.flush_stats``, the ``stats:*`` keys) cannot say what
the training job got. The headline figures (hit rate, GETs saved, hit rate
over time per dataset and per job) come from here instead; the stores'
counters stay what they are, *store traffic*, and are shown as such. The two
are never added together, so a read that passes through a store is counted
once in each view and twice in none.

The package, one side each: ``totals`` (the figures and the origins they are
split by), ``report`` (what each rank process counts and writes, the
:class:`UsageReporter`) and ``read`` (reading them back for ``stats()``, the
CLI and the dashboard, the :class:`UsageReader`).
"""

from shardcache.usage.read import JOBS_SHOWN, RANKS_SHOWN, JobRead, UsageReader
from shardcache.usage.report import (
    APPLY_SCRIPT,
    FLUSH_INTERVAL_S,
    HEARTBEAT_S,
    MAX_BACKOFF_S,
    MAX_PENDING_FLUSHES,
    UsageReporter,
)
from shardcache.usage.totals import ORIGINS, RankUsage, UsageTotals

__all__ = [
    "APPLY_SCRIPT",
    "FLUSH_INTERVAL_S",
    "HEARTBEAT_S",
    "JOBS_SHOWN",
    "JobRead",
    "MAX_BACKOFF_S",
    "MAX_PENDING_FLUSHES",
    "ORIGINS",
    "RANKS_SHOWN",
    "RankUsage",
    "UsageReader",
    "UsageReporter",
    "UsageTotals",
]

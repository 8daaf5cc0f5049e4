"""Reading what the ranks reported back, for ``ds.stats()``, the CLI, /metrics and the dashboard."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from shardcache import keys
from shardcache.index import SERIES_BUCKET_S, map_redis_errors
from shardcache.usage.totals import WAIT_EPOCH_FIELD, RankUsage, UsageTotals

__all__ = ["JOBS_SHOWN", "RANKS_SHOWN", "JobRead", "UsageReader"]

JOBS_SHOWN = 5  # most recent jobs listed per dataset
RANKS_SHOWN = 512  # most recent ranks listed per dataset


@dataclass(frozen=True)
class JobRead:
    """What one job read of one dataset: the listing digest and the cache
    generation of its latest reported batch (the run's data record).

    >>> JobRead.from_hash({"listing": "ab12", "generation": "3"})
    JobRead(listing='ab12', generation=3)
    >>> JobRead.from_hash({}).listing is None
    True
    """

    listing: str | None
    generation: int | None

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> JobRead:
        gen = raw.get("generation")
        return cls(raw.get("listing") or None, int(gen) if gen else None)

    def as_dict(self) -> dict[str, str | int | None]:
        return {"listing": self.listing, "generation": self.generation}


class UsageReader:
    """Reads the rank-reported figures; every method is one round trip.

    Args:
        client: a connected ``redis.Redis`` with ``decode_responses=True``.
        namespace: the deployment namespace. Defaults to ``"default"``.
        redis_url: named (redacted) in error messages. Defaults to ``""``.
    """

    def __init__(
        self,
        client: redis.Redis,
        namespace: str = keys.DEFAULT_NAMESPACE,
        redis_url: str = "",
    ):
        self.client = client
        self.ns = keys.validate_name("namespace", namespace)
        self._url = redis_url

    def totals(self, dataset: str) -> UsageTotals:
        """Everything the ranks reported for ``dataset``.

        Raises:
            IndexUnavailable: Redis is unreachable.
        """
        with map_redis_errors(self._url):
            return UsageTotals.from_hash(
                self.client.hgetall(keys.usage_key(self.ns, dataset))
            )

    def totals_many(self, datasets: Sequence[str]) -> dict[str, UsageTotals]:
        pipe = self.client.pipeline(transaction=False)
        for ds in datasets:
            pipe.hgetall(keys.usage_key(self.ns, ds))
        with map_redis_errors(self._url):
            rows = pipe.execute() if datasets else []
        return {
            ds: UsageTotals.from_hash(r) for ds, r in zip(datasets, rows, strict=True)
        }

    def job_totals(self, dataset: str, job: str) -> UsageTotals:
        """What every process of one job (ranks and their DataLoader workers)
        reported for ``dataset``.

        Raises:
            IndexUnavailable: Redis is unreachable.
        """
        with map_redis_errors(self._url):
            return UsageTotals.from_hash(
                self.client.hgetall(keys.usage_job_key(self.ns, dataset, job))
            )

    def job_reads(self, dataset: str, jobs: Sequence[str]) -> dict[str, JobRead]:
        """The listing and generation each of ``jobs`` read of ``dataset`` (one
        pipeline); a job that reported nothing reads ``JobRead(None, None)``.

        Raises:
            IndexUnavailable: Redis is unreachable.
        """
        pipe = self.client.pipeline(transaction=False)
        for job in jobs:
            pipe.hmget(
                keys.usage_job_key(self.ns, dataset, job), "listing", "generation"
            )
        with map_redis_errors(self._url):
            rows = pipe.execute() if jobs else []
        return {
            job: JobRead.from_hash({"listing": r[0] or "", "generation": r[1] or ""})
            for job, r in zip(jobs, rows, strict=True)
        }

    def datasets_of_job(self, datasets: Sequence[str], job: str) -> list[str]:
        """Those of ``datasets`` that ``job`` reported reading (one pipeline).

        Raises:
            IndexUnavailable: Redis is unreachable.
        """
        pipe = self.client.pipeline(transaction=False)
        for ds in datasets:
            pipe.exists(keys.usage_job_key(self.ns, ds, job))
        with map_redis_errors(self._url):
            found = pipe.execute() if datasets else []
        return [ds for ds, n in zip(datasets, found, strict=True) if n]

    def jobs(self, dataset: str, limit: int = JOBS_SHOWN) -> dict[str, UsageTotals]:
        """The ``limit`` most recently reporting jobs and their totals, newest first."""
        with map_redis_errors(self._url):
            names = self.client.zrevrange(
                keys.usage_jobs_key(self.ns, dataset), 0, limit - 1
            )
            pipe = self.client.pipeline(transaction=False)
            for job in names:
                pipe.hgetall(keys.usage_job_key(self.ns, dataset, job))
            rows = pipe.execute() if names else []
        return {
            job: UsageTotals.from_hash(r) for job, r in zip(names, rows, strict=True)
        }

    def series(
        self,
        dataset: str,
        window_s: int = 3600,
        *,
        job: str | None = None,
        now: float | None = None,
    ) -> list[tuple[int, UsageTotals]]:
        """Totals per 10 s bucket over the last ``window_s``, oldest first (one
        pipeline); of one ``job`` when given."""
        end = int((time.time() if now is None else now) // SERIES_BUCKET_S)
        end *= SERIES_BUCKET_S
        buckets = range(end - window_s + SERIES_BUCKET_S, end + 1, SERIES_BUCKET_S)
        pipe = self.client.pipeline(transaction=False)
        for b in buckets:
            pipe.hgetall(
                keys.usage_series_key(self.ns, dataset, b)
                if job is None
                else keys.usage_job_series_key(self.ns, dataset, job, b)
            )
        with map_redis_errors(self._url):
            rows = pipe.execute()
        return [
            (b, UsageTotals.from_hash(r))
            for b, r in zip(buckets, rows, strict=True)
            if r
        ]

    def ranks(self, dataset: str, limit: int = RANKS_SHOWN) -> list[RankUsage]:
        """The ``limit`` most recently reporting ranks, sorted by job and rank."""
        with map_redis_errors(self._url):
            members = self.client.zrevrange(
                keys.usage_ranks_key(self.ns, dataset), 0, limit - 1
            )
            pipe = self.client.pipeline(transaction=False)
            for m in members:
                pipe.hgetall(keys.usage_rank_key(self.ns, dataset, m))
            rows = pipe.execute() if members else []
        out = []
        for member, raw in zip(members, rows, strict=True):
            job, _, rank = member.rpartition("/")
            per_epoch = {
                int(f.removeprefix(WAIT_EPOCH_FIELD)): int(v) / 1e6
                for f, v in raw.items()
                if f.startswith(WAIT_EPOCH_FIELD)
            }
            out.append(
                RankUsage(
                    job=job,
                    rank=rank,
                    totals=UsageTotals.from_hash(raw),
                    blocked_s_by_epoch=dict(sorted(per_epoch.items())),
                    epoch=int(raw["epoch"]) if raw.get("epoch") else None,
                    ts=float(raw.get("ts") or 0),
                    ended=float(raw.get("ended") or 0),
                )
            )
        return sorted(
            out, key=lambda r: (r.job, int(r.rank) if r.rank.isdigit() else 0)
        )

"""The figures the ranks report: samples and bytes by origin, blocked time, per rank.

Origins, split as Fluid defines them for Alluxio:

* ``local``: from the rank's own node (views the rank holds, or its node's store)
* ``disk``: from its node's disk tier (the rank mapped the chunk file and read
  only the rows it needed; the chunk was not in memory)
* ``peer``: from another node's store
* ``source``: read from the origin (S3, GCS, ...): one GET

The field names here are the Redis hash fields both the reporter writes and
the reader reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["ORIGIN_FIELDS", "ORIGINS", "WAIT_EPOCH_FIELD", "RankUsage", "UsageTotals"]

ORIGINS = ("local", "disk", "peer", "source")
ORIGIN_FIELDS = {o: (f"samples_{o}", f"bytes_{o}") for o in ORIGINS}
WAIT_EPOCH_FIELD = "wait_us:e"  # per-epoch blocked time lives in the rank hash only


@dataclass(frozen=True)
class UsageTotals:
    """Samples the ranks delivered and their source-object bytes (listed
    sizes, not decoded tensors), by origin, plus blocked time.

    >>> t = UsageTotals(samples_local=2000, samples_source=1000)
    >>> round(t.hit_rate, 3), t.gets_saved
    (0.667, 2000)
    """

    samples_local: int = 0
    samples_disk: int = 0
    samples_peer: int = 0
    samples_source: int = 0
    bytes_local: int = 0
    bytes_disk: int = 0
    bytes_peer: int = 0
    bytes_source: int = 0
    wait_us: int = 0
    waits: int = 0
    lost_samples: int = 0
    lost_bytes: int = 0
    skipped: int = 0  # samples replaced because their object could not be built

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> UsageTotals:
        return cls(**{f.name: int(raw.get(f.name) or 0) for f in fields(cls)})

    @property
    def samples(self) -> int:
        return sum(getattr(self, f"samples_{o}") for o in ORIGINS)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f"bytes_{o}") for o in ORIGINS)

    @property
    def source_reads(self) -> int:
        """Samples read from the origin: one GET each."""
        return self.samples_source

    @property
    def gets_saved(self) -> int:
        """Samples served minus source reads: the GETs the cache spared the source."""
        return self.samples - self.samples_source

    @property
    def hit_rate(self) -> float | None:
        """Share of samples not read from the source; ``None`` before any."""
        return self.gets_saved / self.samples if self.samples else None

    @property
    def byte_hit_rate(self) -> float | None:
        n = self.nbytes
        return (n - self.bytes_source) / n if n else None

    @property
    def blocked_s(self) -> float:
        """Seconds the training loop waited for data."""
        return self.wait_us / 1e6

    def as_dict(self) -> dict[str, Any]:
        """The figures every view shows (dashboard, /metrics, CLI, ``ds.stats()``)."""
        by_samples = {o: getattr(self, f"samples_{o}") for o in ORIGINS}
        by_bytes = {o: getattr(self, f"bytes_{o}") for o in ORIGINS}
        return {
            "samples": self.samples,
            "bytes": self.nbytes,
            "samples_by_origin": by_samples,
            "bytes_by_origin": by_bytes,
            "sample_ratio": {
                o: n / self.samples if self.samples else None
                for o, n in by_samples.items()
            },
            "byte_ratio": {
                o: n / self.nbytes if self.nbytes else None for o, n in by_bytes.items()
            },
            "hit_rate": self.hit_rate,
            "byte_hit_rate": self.byte_hit_rate,
            "source_reads": self.source_reads,
            "gets_saved": self.gets_saved,
            "blocked_s": self.blocked_s,
            "lost_samples": self.lost_samples,
            "lost_bytes": self.lost_bytes,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class RankUsage:
    """One rank's totals and the time it was blocked in each epoch."""

    job: str
    rank: str
    totals: UsageTotals
    blocked_s_by_epoch: dict[int, float] = field(default_factory=dict)
    epoch: int | None = None
    ts: float = 0.0
    ended: float = 0.0  # when its last process exited after a final flush

    def state(self, now: float, silent_after_s: float) -> str:
        """``"ended"`` (final report written), ``"running"`` (reported within
        ``silent_after_s``), or ``"lost"``: it stopped without a final report
        (SIGKILL, OOM), so up to one flush interval of samples is missing."""
        if self.ended and self.ended >= self.ts:
            return "ended"
        return "running" if now - self.ts <= silent_after_s else "lost"

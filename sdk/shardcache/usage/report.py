"""What one rank process counts of the samples it delivered, and how it writes them to Redis.

Contract for the rank (``DistributedCachedDataset``), one reporter per process
(a forked DataLoader worker gets a fresh one by itself)::

    reporter = UsageReporter(redis_client_factory, namespace, dataset, job, rank,
                             redis_url=redis_url)
    # On the training path, in memory only (no I/O; measured ~0.8 us a call):
    reporter.served(origin, samples, nbytes)  # per batch and origin, in __getitems__
    reporter.waited(seconds, epoch)           # per batch, beside WaitRecorder.record
    reporter.reading(digest, generation)      # per batch: the listing and generation read
    # Once per process (a spawned DataLoader worker included):
    keep_flushed(reporter)  # shardcache.flusher: a daemon thread flushes it every
    # FLUSH_INTERVAL_S and the process's exit (normal, or after an uncaught
    # exception) once more: no close() is needed for the numbers to be right.
    reporter.flush()   # one round trip; False when Redis is down (kept, retried)
    reporter.close()   # final flush; returns the samples it could not report

Expose it as ``DistributedCachedDataset.usage_reporter`` (a property); the
end-to-end test (tests/services/test_usage_e2e.py) runs once that exists.
Store replies map to origins as: a held view or ``"hit"`` is ``local``,
``"remote-hit"`` is ``peer``, ``"fetched"`` and ``"uncached"`` are ``source``,
``"disk"`` and ``"disk-read"`` are ``disk``;
count a sample when it is delivered (in ``__getitems__``), not when a
prefetch resolves it. ``ds.stats()["cluster"]`` is
``UsageReader(client, ns).totals(name).as_dict()``.

Failures: a flush that fails keeps its counts (one batch per attempt, at most
``max_pending_flushes`` of them; attempts back off to ``MAX_BACKOFF_S``) and
sends them with the next one. Past that bound the oldest batch is dropped and
its samples are added to ``lost_samples``/``lost_bytes``, which are written
once Redis answers again. A reply lost after Redis applied a flush is harmless:
each batch carries a sequence number and Redis applies it once.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from shardcache import keys
from shardcache.errors import ConfigError, IndexUnavailable
from shardcache.index import SERIES_BUCKET_S, SERIES_TTL_S, map_redis_errors
from shardcache.usage.totals import ORIGIN_FIELDS, ORIGINS, WAIT_EPOCH_FIELD

__all__ = [
    "APPLY_SCRIPT",
    "FLUSH_INTERVAL_S",
    "HEARTBEAT_S",
    "MAX_BACKOFF_S",
    "MAX_PENDING_FLUSHES",
    "UsageReporter",
]

FLUSH_INTERVAL_S = 1.0  # how often the rank's background thread calls flush()
HEARTBEAT_S = 10.0  # a live process with nothing to flush still says so this often
MAX_PENDING_FLUSHES = 900  # failed batches kept: 7.5 h at the 30 s backoff
MAX_BACKOFF_S = 30.0  # retry interval cap while Redis is unreachable

# One call applies every pending batch of one reporter, atomically. Public:
# the cache endpoint runs the same script for pods that reach Redis through it.
# KEYS[1] reporter seq key, KEYS[2] dataset totals, KEYS[3] job totals,
# KEYS[4] rank hash, KEYS[5] jobs zset, KEYS[6] ranks zset,
# KEYS[7..] dataset bucket, job bucket, dataset bucket, job bucket, ...
# ARGV[1] JSON {ts, ttl, job, member, listing?, generation?, batches: [{seq,
#   totals, rank, buckets: [[key index, counters]], epoch?}]}; counters are
#   {field: "integer"}. listing/generation: what the process read last, set on
#   the job's hash and the rank's (the run's data record).
# A batch whose seq is not above the stored one was applied already (its
# reply was lost) and is skipped. Returns how many batches were applied.
APPLY_SCRIPT = """
local doc = cjson.decode(ARGV[1])
local done = tonumber(redis.call('GET', KEYS[1]) or '0')
local applied = 0
for _, b in ipairs(doc.batches) do
  local seq = tonumber(b.seq)
  if seq > done then
    for f, n in pairs(b.totals) do
      redis.call('HINCRBY', KEYS[2], f, n)
      redis.call('HINCRBY', KEYS[3], f, n)
      redis.call('HINCRBY', KEYS[4], f, n)
    end
    for f, n in pairs(b.rank) do redis.call('HINCRBY', KEYS[4], f, n) end
    for _, pair in ipairs(b.buckets) do
      local i = tonumber(pair[1])
      for f, n in pairs(pair[2]) do
        redis.call('HINCRBY', KEYS[i], f, n)
        redis.call('HINCRBY', KEYS[i + 1], f, n)
      end
      redis.call('EXPIRE', KEYS[i], doc.ttl)
      redis.call('EXPIRE', KEYS[i + 1], doc.ttl)
    end
    if b.epoch then redis.call('HSET', KEYS[4], 'epoch', b.epoch) end
    done = seq
    applied = applied + 1
  end
end
redis.call('SET', KEYS[1], done, 'EX', doc.ttl)
if doc.listing then
  redis.call('HSET', KEYS[3], 'listing', doc.listing, 'generation', doc.generation)
  redis.call('HSET', KEYS[4], 'listing', doc.listing, 'generation', doc.generation)
end
redis.call('HSET', KEYS[4], 'ts', doc.ts)
redis.call('ZADD', KEYS[5], doc.ts, doc.job)
redis.call('ZADD', KEYS[6], doc.ts, doc.member)
return applied
"""


@dataclass
class _Batch:
    """Counts cut at one flush attempt; resent unchanged until Redis confirms."""

    seq: int
    buckets: dict[int, dict[str, int]]
    rank: dict[str, int]
    lost: dict[str, int]
    epoch: int | None

    def totals(self) -> dict[str, int]:
        out = dict(self.lost)
        for counts in self.buckets.values():
            for f, n in counts.items():
                out[f] = out.get(f, 0) + n
        return out


class UsageReporter:
    """Counts what one rank delivered, in memory, and flushes it in one round trip.

    Args:
        redis_client_factory: returns a ``redis.Redis`` (``decode_responses=True``);
            called lazily by the first :meth:`flush`, never on the training path.
        namespace: the deployment namespace (key prefix).
        dataset: the dataset name.
        job: the job id (``TORCHELASTIC_RUN_ID`` or the dataset's ``job``).
        rank: the global rank.
        redis_url: named (redacted) in error messages. Defaults to ``""``.
        max_pending_flushes: failed batches kept for retry before the oldest is
            counted as lost. Defaults to ``MAX_PENDING_FLUSHES``.
        clock: wall clock for the 10 s buckets (tests replay epochs with it).
            Defaults to ``time.time``.
        owns_rank: this process is the rank itself (not one of its DataLoader
            workers): its ``close()`` marks the rank's report final. Defaults
            to ``True``.

    Raises:
        ConfigError: a name is not key-safe, rank < 0, or max_pending_flushes < 1.

    >>> r = UsageReporter(lambda: None, "default", "images", "job1", 0)
    >>> r.served("local", 64, 65536); r.waited(0.002, epoch=1)
    >>> r.unflushed_samples
    64
    """

    def __init__(
        self,
        redis_client_factory: Callable[[], redis.Redis],
        namespace: str,
        dataset: str,
        job: str,
        rank: int,
        *,
        redis_url: str = "",
        max_pending_flushes: int = MAX_PENDING_FLUSHES,
        clock: Callable[[], float] = time.time,
        owns_rank: bool = True,
    ):
        self.ns = keys.validate_name("namespace", namespace)
        self.dataset = keys.validate_name("dataset", dataset)
        self.job = keys.validate_name("job", job)
        if not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"rank must be an int >= 0, got {rank!r}.")
        if max_pending_flushes < 1:
            raise ConfigError(
                f"max_pending_flushes must be >= 1, got {max_pending_flushes}."
            )
        self.rank = rank
        self._factory = redis_client_factory
        self._url = redis_url
        self._max_pending = max_pending_flushes
        self._clock = clock
        self._member = f"{job}/{rank}"
        # Only the rank's own process marks its report final: a DataLoader
        # worker reports under the rank's name but ends long before the rank.
        self.owns_rank = owns_rank
        self._new_process_state()
        # A forked child must not resend the parent's counts.
        ref = weakref.WeakMethod(self._new_process_state)
        os.register_at_fork(after_in_child=lambda: (m := ref()) and m())

    def _new_process_state(self) -> None:
        self._lock = threading.Lock()  # served/waited vs the flush thread
        self._flush_lock = threading.Lock()  # flush vs close
        self._buckets: dict[int, dict[str, int]] = {}
        self._rank_only: dict[str, int] = {}
        self._lost: dict[str, int] = {}  # dropped, to be reported by the next batch
        self._epoch: int | None = None
        # The listing digest and generation the last batch read: the job's
        # record of what it trained on ("" until the first batch).
        self.listing, self.generation = "", 0
        self._pending: deque[_Batch] = deque()
        self._seq = 0
        self._id = uuid.uuid4().hex[:16]  # this reporter's seq namespace in Redis
        self._client: redis.Redis | None = None
        self._script: Any = None
        self._retry_at = 0.0
        self._failures = 0
        self.failed_flushes = 0
        self.lost_samples = 0
        self.last_error: str | None = None

    # -- training path: memory only ---------------------------------------------
    def served(self, origin: str, samples: int, nbytes: int) -> None:
        """Count ``samples`` (``nbytes`` in all) delivered from ``origin``.

        Raises:
            ConfigError: ``origin`` is not one of ``ORIGINS``.
        """
        names = ORIGIN_FIELDS.get(origin)
        if names is None:
            raise ConfigError(
                f"origin must be one of {', '.join(map(repr, ORIGINS))}, got {origin!r}."
            )
        bucket = int(self._clock()) // SERIES_BUCKET_S * SERIES_BUCKET_S
        with self._lock:
            counts = self._buckets.setdefault(bucket, {})
            counts[names[0]] = counts.get(names[0], 0) + samples
            counts[names[1]] = counts.get(names[1], 0) + nbytes

    def skipped(self, samples: int) -> None:
        """Count samples replaced under ``on_error="skip"`` (not delivered)."""
        bucket = int(self._clock()) // SERIES_BUCKET_S * SERIES_BUCKET_S
        with self._lock:
            counts = self._buckets.setdefault(bucket, {})
            counts["skipped"] = counts.get("skipped", 0) + samples

    def waited(self, seconds: float, epoch: int) -> None:
        """Count time the training loop was blocked waiting for a batch."""
        us = max(int(seconds * 1e6 + 0.5), 0)
        bucket = int(self._clock()) // SERIES_BUCKET_S * SERIES_BUCKET_S
        per_epoch = f"{WAIT_EPOCH_FIELD}{epoch}"
        with self._lock:
            counts = self._buckets.setdefault(bucket, {})
            counts["wait_us"] = counts.get("wait_us", 0) + us
            counts["waits"] = counts.get("waits", 0) + 1
            self._rank_only[per_epoch] = self._rank_only.get(per_epoch, 0) + us
            self._epoch = epoch

    def reading(self, listing: str, generation: int) -> None:
        """Record the listing digest and generation the batch just delivered
        was read from (written with the next flush; two attribute stores)."""
        self.listing, self.generation = listing, generation

    @property
    def last_epoch(self) -> int | None:
        """The epoch of the last wait counted (``None`` before the first)."""
        return self._epoch

    @property
    def unflushed_samples(self) -> int:
        """Samples counted here and not yet confirmed written to Redis."""
        with self._lock:
            current = sum(
                c.get(ORIGIN_FIELDS[o][0], 0)
                for c in self._buckets.values()
                for o in ORIGINS
            )
        pending = sum(
            b.totals().get(ORIGIN_FIELDS[o][0], 0)
            for b in list(self._pending)
            for o in ORIGINS
        )
        return current + pending

    @property
    def has_rank_counts(self) -> bool:
        """Per-epoch wait time not yet written (no samples to go with it)."""
        with self._lock:
            return bool(self._rank_only)

    # -- background thread --------------------------------------------------------
    def flush(self, *, force: bool = False) -> bool:
        """Write everything counted so far in one round trip.

        Returns ``True`` when Redis confirmed it all, ``False`` when Redis is
        unreachable (counts are kept and retried with backoff; see the module
        docstring for the bound). ``force`` ignores the backoff.
        """
        with self._flush_lock:
            if not force and self._pending and time.monotonic() < self._retry_at:
                return False
            self._cut()
            if not self._pending:
                return True
            batches = list(self._pending)
            try:
                self._send(batches)
            except IndexUnavailable as exc:
                self._failures += 1
                self.failed_flushes += 1
                self.last_error = str(exc)
                backoff = min(FLUSH_INTERVAL_S * 2**self._failures, MAX_BACKOFF_S)
                self._retry_at = time.monotonic() + backoff * random.uniform(0.5, 1.0)
                self._drop_oldest()
                return False
            for _ in batches:
                self._pending.popleft()
            self._failures, self._retry_at, self.last_error = 0, 0.0, None
            return True

    def close(self) -> int:
        """Flush one last time and mark this process's report final; returns
        the samples that could not be reported."""
        if self.flush(force=True):
            if self.owns_rank:
                self._mark_ended()
            return 0
        dropped = self._lost.get("lost_samples", 0)
        carried = sum(b.lost.get("lost_samples", 0) for b in self._pending)
        return self.unflushed_samples + dropped + carried

    def _mark_ended(self) -> None:
        """Stamp the rank's hash: its reports are complete as of now (a later
        flush by another process of the rank moves ``ts`` past it again)."""
        self._hset("ended")

    def heartbeat(self) -> None:
        """Say this process is alive with nothing to flush (a long step, an
        evaluation, a checkpoint): the dashboard tells a quiet rank from a
        dead one by this."""
        self._hset("ts")

    def _hset(self, field: str) -> None:
        try:
            with map_redis_errors(self._url):
                self._connect().hset(
                    keys.usage_rank_key(self.ns, self.dataset, self._member),
                    field,
                    repr(self._clock()),
                )
        except IndexUnavailable as exc:
            self.last_error = str(exc)

    def _connect(self) -> redis.Redis:
        """The Redis client, made on first use (never on the training path)."""
        if self._client is None:
            self._client = self._factory()
            self._script = self._client.register_script(APPLY_SCRIPT)
        return self._client

    def _cut(self) -> None:
        """Move the current counts into a new pending batch (caller holds _flush_lock)."""
        with self._lock:
            if not (self._buckets or self._rank_only or any(self._lost.values())):
                return
            buckets, self._buckets = self._buckets, {}
            rank_only, self._rank_only = self._rank_only, {}
            epoch = self._epoch
        self._seq += 1
        lost, self._lost = self._lost, {}
        self._pending.append(_Batch(self._seq, buckets, rank_only, lost, epoch))

    def _drop_oldest(self) -> None:
        """Past the bound, the oldest batch goes; the next batch reports it as lost."""
        while len(self._pending) > self._max_pending:
            dropped = self._pending.popleft().totals()
            samples = sum(dropped.get(ORIGIN_FIELDS[o][0], 0) for o in ORIGINS)
            nbytes = sum(dropped.get(ORIGIN_FIELDS[o][1], 0) for o in ORIGINS)
            for f, n in (
                ("lost_samples", samples + dropped.get("lost_samples", 0)),
                ("lost_bytes", nbytes + dropped.get("lost_bytes", 0)),
            ):
                self._lost[f] = self._lost.get(f, 0) + n
            self.lost_samples += samples

    def _send(self, batches: Sequence[_Batch]) -> None:
        with map_redis_errors(self._url):
            self._connect()
            bucket_keys: list[str] = []
            index: dict[int, int] = {}
            docs = []
            for b in batches:
                pairs = []
                for t, counts in sorted(b.buckets.items()):
                    if t not in index:
                        index[t] = 7 + len(bucket_keys)
                        bucket_keys += [
                            keys.usage_series_key(self.ns, self.dataset, t),
                            keys.usage_job_series_key(
                                self.ns, self.dataset, self.job, t
                            ),
                        ]
                    pairs.append([index[t], _strs(counts)])
                doc: dict[str, Any] = {
                    "seq": b.seq,
                    "totals": _strs(b.totals()),
                    "rank": _strs(b.rank),
                    "buckets": pairs,
                }
                if b.epoch is not None:
                    doc["epoch"] = b.epoch
                docs.append(doc)
            record: dict[str, Any] = {}
            if self.listing:
                record = {"listing": self.listing, "generation": str(self.generation)}
            self._script(
                keys=[
                    keys.usage_seq_key(self.ns, self.dataset, self._id),
                    keys.usage_key(self.ns, self.dataset),
                    keys.usage_job_key(self.ns, self.dataset, self.job),
                    keys.usage_rank_key(self.ns, self.dataset, self._member),
                    keys.usage_jobs_key(self.ns, self.dataset),
                    keys.usage_ranks_key(self.ns, self.dataset),
                    *bucket_keys,
                ],
                args=[
                    json.dumps(
                        {
                            "ts": repr(self._clock()),
                            "ttl": SERIES_TTL_S,
                            "job": self.job,
                            "member": self._member,
                            **record,
                            "batches": docs,
                        }
                    )
                ],
            )


def _strs(counts: Mapping[str, int]) -> dict[str, str]:
    # Integers go to Lua as strings: a Lua number past 1e14 prints as 1e+14,
    # which HINCRBY refuses.
    return {f: str(int(n)) for f, n in counts.items() if n}

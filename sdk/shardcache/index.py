"""The Redis index: what is cached, where, and under which version.

Every value is JSON or a plain field; nothing read from Redis is unpickled.
Multi-key updates are Lua scripts so that a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from shardcache import keys
from shardcache.errors import ConfigError, IndexUnavailable
from shardcache.redaction import redact_url

__all__ = ["DatasetRecord", "HitStats", "RedisIndex", "connect_redis"]

EVENTS_KEPT = 500  # the dashboard shows recent events; older ones are trimmed
SERIES_BUCKET_S = 10  # resolution of the hit-rate time series
SERIES_TTL_S = 2 * 24 * 3600  # two days of history
_CHUNK = 1000  # paths per HMGET/HDEL so one call never blocks Redis for long
COUNTERS = (
    "hits",
    "misses",
    "remote_reads",
    "bytes_read",
    "bytes_served",
    "fetch_ms_total",
    "evictions",
    "errors",
    "uncached",
)


@contextlib.contextmanager
def map_redis_errors(url: str) -> Iterator[None]:
    """Turn redis-py exceptions into :class:`IndexUnavailable` with the fix."""
    try:
        yield
    except (
        redis.AuthenticationError,
        redis.exceptions.AuthenticationWrongNumberOfArgsError,
    ) as exc:
        raise IndexUnavailable(
            f"Redis at {redact_url(url)} refused the credentials. Put the password in "
            "the URL (redis://:PASSWORD@host:port) or set SHARDCACHE_REDIS_URL."
        ) from exc
    except redis.exceptions.NoPermissionError as exc:
        raise IndexUnavailable(
            f"the Redis user in {redact_url(url)} may not use this namespace's keys "
            f"({exc}). Grant the ACL user ~shardcache:NAMESPACE:* and "
            "&shardcache:NAMESPACE:*, or set SHARDCACHE_NAMESPACE to the one it owns."
        ) from exc
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise IndexUnavailable(
                f"Redis at {redact_url(url)} needs a password. Put it in the URL "
                "(redis://:PASSWORD@host:port) or set SHARDCACHE_REDIS_URL."
            ) from exc
        raise IndexUnavailable(
            f"Redis at {redact_url(url)} answered an error: {exc}"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise IndexUnavailable(
            f"cannot reach Redis at {redact_url(url)} ({type(exc).__name__}). Check that "
            "it runs and that SHARDCACHE_REDIS_URL points at it."
        ) from exc


def connect_redis(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """Open and PING a Redis client for ``url``.

    Raises:
        ConfigError: the URL cannot be parsed.
        IndexUnavailable: Redis is unreachable or refuses the credentials.
    """
    try:
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
            decode_responses=True,
        )
    except ValueError as exc:
        raise ConfigError(
            f"redis_url {redact_url(url)!r} is not a valid Redis URL: {exc}"
        ) from exc
    with map_redis_errors(url):
        client.ping()
    return client


@dataclass(frozen=True)
class DatasetRecord:
    name: str
    source: str
    fingerprint: str
    generation: int
    created_at: float
    invalidated_at: float | None
    objects: int
    total_bytes: int


@dataclass(frozen=True)
class HitStats:
    hits: int = 0
    misses: int = 0
    remote_reads: int = 0
    bytes_read: int = 0
    bytes_served: int = 0
    fetch_ms_total: int = 0
    evictions: int = 0
    errors: int = 0
    uncached: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> HitStats:
        return cls(**{k: int(float(raw.get(k, 0) or 0)) for k in COUNTERS})


@dataclass
class StatsDelta:
    """Counters accumulated in memory and flushed in one pipeline."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, amount: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + amount


# KEYS[1] dataset hash, KEYS[2] datasets set, KEYS[3] events list, KEYS[4] channel
# ARGV[1] name, ARGV[2] source, ARGV[3] fingerprint, ARGV[4] now,
# ARGV[5] objects, ARGV[6] total bytes, ARGV[7] key prefix for old generations
# Returns {generation, 'changed:<old fingerprint>' if this call started it, else ''}
_REGISTER = """
local gen = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
local fp = redis.call('HGET', KEYS[1], 'fingerprint')
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'source', ARGV[2], 'objects', ARGV[5], 'total_bytes', ARGV[6])
if gen == 0 then
  redis.call('HSET', KEYS[1], 'generation', 1, 'fingerprint', ARGV[3], 'created_at', ARGV[4])
  return {1, ''}
end
if fp ~= ARGV[3] then
  gen = redis.call('HINCRBY', KEYS[1], 'generation', 1)
  redis.call('HSET', KEYS[1], 'fingerprint', ARGV[3], 'invalidated_at', ARGV[4])
  redis.call('UNLINK', ARGV[7] .. ':entries:' .. ARGV[1] .. ':v' .. (gen - 1),
                       ARGV[7] .. ':owners:' .. ARGV[1] .. ':v' .. (gen - 1))
  local ev = cjson.encode({ts=tonumber(ARGV[4]), kind='invalidate', dataset=ARGV[1],
                           generation=gen, reason='preprocess fingerprint changed'})
  redis.call('LPUSH', KEYS[3], ev)
  redis.call('LTRIM', KEYS[3], 0, EVENTS_CAP)
  redis.call('PUBLISH', KEYS[4], cjson.encode({dataset=ARGV[1], generation=gen}))
  return {gen, 'changed:' .. (fp or '')}
end
return {gen, ''}
""".replace("EVENTS_CAP", str(EVENTS_KEPT - 1))

# KEYS[1] dataset hash, KEYS[2] events list, KEYS[3] channel
# ARGV[1] name, ARGV[2] now, ARGV[3] reason, ARGV[4] key prefix
_INVALIDATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local gen = redis.call('HINCRBY', KEYS[1], 'generation', 1)
redis.call('HSET', KEYS[1], 'invalidated_at', ARGV[2])
redis.call('UNLINK', ARGV[4] .. ':entries:' .. ARGV[1] .. ':v' .. (gen - 1),
                     ARGV[4] .. ':owners:' .. ARGV[1] .. ':v' .. (gen - 1))
local ev = cjson.encode({ts=tonumber(ARGV[2]), kind='invalidate', dataset=ARGV[1],
                         generation=gen, reason=ARGV[3]})
redis.call('LPUSH', KEYS[2], ev)
redis.call('LTRIM', KEYS[2], 0, EVENTS_CAP)
redis.call('PUBLISH', KEYS[3], cjson.encode({dataset=ARGV[1], generation=gen}))
return gen
""".replace("EVENTS_CAP", str(EVENTS_KEPT - 1))

# KEYS[1] owners hash; ARGV[1] claimant, ARGV[2..] paths. Returns each owner.
_CLAIM = """
local out = {}
for i = 2, #ARGV do
  redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[1])
  out[#out + 1] = redis.call('HGET', KEYS[1], ARGV[i])
end
return out
"""

# KEYS[1] owners hash; ARGV[1] expected owner, ARGV[2] new owner, ARGV[3..] paths.
# Returns the owner of each path afterwards.
_CAS = """
local out = {}
for i = 3, #ARGV do
  local cur = redis.call('HGET', KEYS[1], ARGV[i])
  if cur == ARGV[1] or cur == false then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[2])
    cur = ARGV[2]
  end
  out[#out + 1] = cur
end
return out
"""

# KEYS[1] owners hash, KEYS[2] entries hash; ARGV[1] owner, ARGV[2..] paths
_RELEASE = """
local n = 0
for i = 2, #ARGV do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
"""

# Drop entries whose recorded ETag differs from the listing's, atomically, so
# ranks refreshing at once cannot delete an entry another store just recorded
# for the new version. The owner's claim stays: that store still holds the old
# chunk, whose unchanged rows it copies into the rebuilt one, so the rebuild
# must happen there (a rank on another node forwards to it). Dropping the
# claim let the first asker anywhere rebuild the whole chunk from the source.
# KEYS[1] entries hash; ARGV: path1, etag1, path2, etag2, ...
# Returns the paths dropped.
_DROP_CHANGED = """
local changed = {}
for i = 1, #ARGV, 2 do
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  if raw then
    local ok, entry = pcall(cjson.decode, raw)
    if not ok or type(entry) ~= 'table' or tostring(entry['etag']) ~= ARGV[i + 1] then
      redis.call('HDEL', KEYS[1], ARGV[i])
      changed[#changed + 1] = ARGV[i]
    end
  end
end
return changed
"""


# KEYS[1] manifest hash; ARGV[1] expected owner ('' = none), ARGV[2] claimant.
# Returns the owner afterwards: the claimant when the expected owner still
# held it (or nobody did), else whoever won.
_CLAIM_MANIFEST = """
local cur = redis.call('HGET', KEYS[1], 'owner')
if cur == false or cur == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2])
  return ARGV[2]
end
return cur
"""


class RedisIndex:
    """Typed access to one deployment's keys in Redis.

    Args:
        client: a connected ``redis.Redis`` with ``decode_responses=True``.
        url: the URL it came from, used (redacted) in error messages.
        namespace: the deployment namespace. Defaults to ``"default"``.
    """

    def __init__(
        self, client: redis.Redis, url: str, namespace: str = keys.DEFAULT_NAMESPACE
    ):
        self.client = client
        self.url = url
        self.ns = keys.validate_name("namespace", namespace)
        self._register = client.register_script(_REGISTER)
        self._invalidate = client.register_script(_INVALIDATE)
        self._claim = client.register_script(_CLAIM)
        self._cas = client.register_script(_CAS)
        self._release = client.register_script(_RELEASE)
        self._drop_changed = client.register_script(_DROP_CHANGED)
        self._claim_manifest = client.register_script(_CLAIM_MANIFEST)

    @classmethod
    def from_url(cls, url: str, namespace: str = keys.DEFAULT_NAMESPACE) -> RedisIndex:
        return cls(connect_redis(url), url, namespace)

    def errors(self) -> contextlib.AbstractContextManager[None]:
        return map_redis_errors(self.url)

    # -- datasets -------------------------------------------------------------
    def register(
        self, name: str, source: str, fp: str, objects: int, total_bytes: int
    ) -> int:
        """Create or refresh a dataset; a new fingerprint starts a new generation."""
        return self.register_change(name, source, fp, objects, total_bytes)[0]

    def register_change(
        self, name: str, source: str, fp: str, objects: int, total_bytes: int
    ) -> tuple[int, str | None]:
        """:meth:`register`, plus the fingerprint this call replaced when it
        started a new generation (``None`` when it did not): decided in the
        same script, so of ranks registering a new fingerprint at once, one
        learns it and reports it."""
        with self.errors():
            generation, changed = self._register(
                keys=[
                    keys.dataset_key(self.ns, name),
                    keys.datasets_key(self.ns),
                    keys.events_key(self.ns),
                    keys.invalidation_channel(self.ns),
                ],
                args=[
                    name,
                    source,
                    fp,
                    time.time(),
                    objects,
                    total_bytes,
                    keys.prefix(self.ns),
                ],
            )
        previous = str(changed)
        if not previous.startswith("changed:"):
            return int(generation), None
        return int(generation), previous.removeprefix("changed:")

    def generation(self, name: str) -> int:
        """The current generation, or 0 when the dataset is unknown."""
        with self.errors():
            raw = self.client.hget(keys.dataset_key(self.ns, name), "generation")
        return int(raw) if raw else 0

    def invalidate(self, name: str, reason: str = "explicit invalidate") -> int:
        """Atomically start a new generation; returns it (0 if the dataset is unknown).

        Once this returns, readers request the new generation and stores refuse
        older ones, so nothing cached before the call is served after it.
        """
        with self.errors():
            return int(
                self._invalidate(
                    keys=[
                        keys.dataset_key(self.ns, name),
                        keys.events_key(self.ns),
                        keys.invalidation_channel(self.ns),
                    ],
                    args=[name, time.time(), reason, keys.prefix(self.ns)],
                )
            )

    def datasets(self) -> list[str]:
        with self.errors():
            return sorted(self.client.smembers(keys.datasets_key(self.ns)))

    def dataset(self, name: str) -> DatasetRecord | None:
        with self.errors():
            raw = self.client.hgetall(keys.dataset_key(self.ns, name))
        if not raw or "generation" not in raw:
            return None
        try:
            return DatasetRecord(
                name=name,
                source=raw.get("source", ""),
                fingerprint=raw.get("fingerprint", ""),
                generation=int(raw["generation"]),
                created_at=float(raw.get("created_at", 0)),
                invalidated_at=float(raw["invalidated_at"])
                if raw.get("invalidated_at")
                else None,
                objects=int(raw.get("objects", 0)),
                total_bytes=int(raw.get("total_bytes", 0)),
            )
        except ValueError:
            return None  # written by someone else in a shape we do not know

    # -- the published listing --------------------------------------------------
    def manifest_record(self, name: str) -> dict[str, str]:
        """Who holds the dataset's published manifest: owner, digest, refresh, ..."""
        with self.errors():
            return dict(self.client.hgetall(keys.manifest_key(self.ns, name)))

    def claim_manifest(self, name: str, expected: str, me: str) -> str:
        """Become the lister if ``expected`` (or nobody) holds it; returns the holder."""
        with self.errors():
            return str(
                self._claim_manifest(
                    keys=[keys.manifest_key(self.ns, name)], args=[expected, me]
                )
            )

    def publish_manifest(self, name: str, me: str, **fields: Any) -> None:
        """Record the listing ``me`` published (digest, refresh round, counts)."""
        with self.errors():
            self.client.hset(
                keys.manifest_key(self.ns, name),
                mapping={"owner": me, **{k: str(v) for k, v in fields.items()}},
            )

    # -- entries and owners ---------------------------------------------------
    def entries(
        self, name: str, generation: int, paths: Iterable[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Parsed entries; malformed JSON from a foreign writer is skipped."""
        key = keys.entries_key(self.ns, name, generation)
        with self.errors():
            if paths is None:
                raw = self.client.hgetall(key)
            else:
                plist = list(paths)
                raw = {}
                for i in range(0, len(plist), _CHUNK):
                    chunk = plist[i : i + _CHUNK]
                    raw.update(
                        {
                            p: v
                            for p, v in zip(
                                chunk, self.client.hmget(key, chunk), strict=False
                            )
                            if v
                        }
                    )
        out: dict[str, dict[str, Any]] = {}
        for path, value in raw.items():
            try:
                entry = json.loads(value)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out[path] = entry
        return out

    def invalidate_changed(
        self, name: str, generation: int, current: Mapping[str, str]
    ) -> list[str]:
        """Drop entries whose recorded ETag differs from ``current`` (path -> etag).

        Claims stay with their owners (see ``_DROP_CHANGED``). Returns the
        paths dropped. Stores are told the new ETags, so a store
        evicts only values of the old version, never one it fetched after.
        """
        ekey = keys.entries_key(self.ns, name, generation)
        items = list(current.items())
        changed: list[str] = []
        with self.errors():
            for i in range(0, len(items), _CHUNK):
                argv = [x for pair in items[i : i + _CHUNK] for x in pair]
                changed += self._drop_changed(keys=[ekey], args=argv)
        if changed:
            pipe = self.client.pipeline(transaction=True)
            pipe.publish(
                keys.invalidation_channel(self.ns),
                json.dumps(
                    {
                        "dataset": name,
                        "generation": generation,
                        "paths": changed,
                        "etags": {p: current[p] for p in changed},
                    }
                ),
            )
            self._event(
                pipe,
                "changed",
                name,
                generation=generation,
                count=len(changed),
                example=changed[0],
            )
            with self.errors():
                pipe.execute()
        return changed

    def claim_owners(
        self, name: str, generation: int, paths: list[str], me: str
    ) -> list[str]:
        """Claim every unowned path for ``me``; return each path's owner."""
        with self.errors():
            return list(
                self._claim(
                    keys=[keys.owners_key(self.ns, name, generation)], args=[me, *paths]
                )
            )

    def take_over(
        self, name: str, generation: int, paths: Sequence[str], expected: str, me: str
    ) -> list[str]:
        """Move ownership of ``paths`` from a dead ``expected`` owner (or none) to
        ``me``, in one round trip per chunk; returns each path's owner after."""
        owners: list[str] = []
        with self.errors():
            for i in range(0, len(paths), _CHUNK):
                owners += self._cas(
                    keys=[keys.owners_key(self.ns, name, generation)],
                    args=[expected, me, *paths[i : i + _CHUNK]],
                )
        return [str(o) for o in owners]

    def release(self, name: str, generation: int, paths: list[str], me: str) -> int:
        """Forget entries and claims ``me`` holds (eviction, failed fetch)."""
        if not paths:
            return 0
        with self.errors():
            return int(
                self._release(
                    keys=[
                        keys.owners_key(self.ns, name, generation),
                        keys.entries_key(self.ns, name, generation),
                    ],
                    args=[me, *paths],
                )
            )

    def release_predecessors(self, node_id: str, me: str) -> int:
        """Forget every entry an earlier store on ``node_id`` held: it died with
        its cache, so the index must stop pointing at it. Compare-and-set per
        path, so an entry a live store re-claimed meanwhile stays. Returns how
        many entries were dropped."""
        dropped = 0
        for name in self.datasets():
            generation = self.generation(name)
            if generation <= 0:
                continue
            by_owner: dict[str, list[str]] = {}
            with self.errors():
                owners = self.client.hscan_iter(
                    keys.owners_key(self.ns, name, generation), count=1000
                )
                for path, owner in owners:
                    if owner.split("/", 1)[0] == node_id and owner != me:
                        by_owner.setdefault(owner, []).append(path)
            for owner, paths in by_owner.items():
                for i in range(0, len(paths), _CHUNK):
                    dropped += self.release(
                        name, generation, paths[i : i + _CHUNK], owner
                    )
        return dropped

    def record_entries(
        self, name: str, generation: int, entries: Mapping[str, dict[str, Any]]
    ) -> None:
        if not entries:
            return
        with self.errors():
            self.client.hset(
                keys.entries_key(self.ns, name, generation),
                mapping={p: json.dumps(e) for p, e in entries.items()},
            )

    def owners(self, name: str, generation: int) -> dict[str, str]:
        with self.errors():
            return dict(self.client.hgetall(keys.owners_key(self.ns, name, generation)))

    # -- stats, stores, events ------------------------------------------------
    def flush_stats(
        self,
        per_key: Mapping[tuple[str, int], Mapping[str, int]],
        node_id: str,
        now: float | None = None,
    ) -> None:
        """Add counters, keyed by ``(dataset, generation)``, in one round trip."""
        bucket = int((now or time.time()) // SERIES_BUCKET_S * SERIES_BUCKET_S)
        pipe = self.client.pipeline(transaction=False)
        for (ds, generation), counts in per_key.items():
            targets = (
                keys.stats_key(self.ns, ds),
                keys.stats_node_key(self.ns, ds, node_id),
                keys.stats_generation_key(self.ns, ds, generation),
                keys.stats_series_key(self.ns, ds, bucket),
            )
            for key in targets:
                for name, amount in counts.items():
                    if amount:
                        pipe.hincrby(key, name, amount)
            pipe.expire(keys.stats_series_key(self.ns, ds, bucket), SERIES_TTL_S)
        with self.errors():
            pipe.execute()

    def generation_stats(self, name: str, generation: int) -> HitStats:
        """Counters of one generation: what a version bump cost."""
        with self.errors():
            return HitStats.from_hash(
                self.client.hgetall(
                    keys.stats_generation_key(self.ns, name, generation)
                )
            )

    def stats(self, name: str) -> HitStats:
        with self.errors():
            return HitStats.from_hash(
                self.client.hgetall(keys.stats_key(self.ns, name))
            )

    def entry_count(self, name: str, generation: int) -> int:
        """How many objects of ``generation`` are cached (one ``HLEN``)."""
        with self.errors():
            return int(self.client.hlen(keys.entries_key(self.ns, name, generation)))

    def node_stats_many(
        self, names: Sequence[str], node_ids: Sequence[str]
    ) -> dict[tuple[str, str], HitStats]:
        """Counters of every (dataset, node) pair in one pipelined round trip."""
        pairs = [(n, node) for n in names for node in node_ids]
        pipe = self.client.pipeline(transaction=False)
        for n, node in pairs:
            pipe.hgetall(keys.stats_node_key(self.ns, n, node))
        with self.errors():
            raw = pipe.execute()
        return {pair: HitStats.from_hash(h) for pair, h in zip(pairs, raw, strict=True)}

    def node_stats(self, name: str, node_id: str) -> HitStats:
        with self.errors():
            return HitStats.from_hash(
                self.client.hgetall(keys.stats_node_key(self.ns, name, node_id))
            )

    def series(
        self, name: str, window_s: int = 3600, now: float | None = None
    ) -> list[tuple[int, HitStats]]:
        """Counters per time bucket over the last ``window_s`` seconds, oldest first."""
        end = int((now or time.time()) // SERIES_BUCKET_S * SERIES_BUCKET_S)
        buckets = list(
            range(end - window_s + SERIES_BUCKET_S, end + 1, SERIES_BUCKET_S)
        )
        pipe = self.client.pipeline(transaction=False)
        for b in buckets:
            pipe.hgetall(keys.stats_series_key(self.ns, name, b))
        with self.errors():
            rows = pipe.execute()
        return [
            (b, HitStats.from_hash(r)) for b, r in zip(buckets, rows, strict=False) if r
        ]

    def record_rank(
        self, name: str, job: str, rank: int, report: Mapping[str, Any]
    ) -> None:
        with self.errors():
            self.client.hset(
                keys.ranks_key(self.ns, name), f"{job}/{rank}", json.dumps(report)
            )

    def ranks(self, name: str) -> dict[str, dict[str, Any]]:
        with self.errors():
            raw = self.client.hgetall(keys.ranks_key(self.ns, name))
        out = {}
        for k, v in raw.items():
            with contextlib.suppress(ValueError):
                out[k] = json.loads(v)
        return out

    def heartbeat(self, node_id: str, info: Mapping[str, Any]) -> None:
        with self.errors():
            self.client.hset(keys.stores_key(self.ns), node_id, json.dumps(dict(info)))

    def stores(self) -> dict[str, dict[str, Any]]:
        with self.errors():
            raw = self.client.hgetall(keys.stores_key(self.ns))
        out = {}
        for k, v in raw.items():
            with contextlib.suppress(ValueError):
                out[k] = json.loads(v)
        return out

    def push_event(self, kind: str, dataset: str, **detail: Any) -> None:
        pipe = self.client.pipeline(transaction=False)
        self._event(pipe, kind, dataset, **detail)
        with self.errors():
            pipe.execute()

    def events(self, limit: int = 50) -> list[dict[str, Any]]:
        with self.errors():
            raw = self.client.lrange(keys.events_key(self.ns), 0, limit - 1)
        out = []
        for v in raw:
            with contextlib.suppress(ValueError):
                out.append(json.loads(v))
        return out

    def _event(self, pipe: Any, kind: str, dataset: str, **detail: Any) -> None:
        event = {"ts": time.time(), "kind": kind, "dataset": dataset, **detail}
        pipe.lpush(keys.events_key(self.ns), json.dumps(event))
        pipe.ltrim(keys.events_key(self.ns), 0, EVENTS_KEPT - 1)

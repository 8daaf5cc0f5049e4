"""The Redis index: what is cached, where, and under which version.

This is the part ranks use; the stores' claims and writes are the cluster
side's ``ClusterIndex`` (``shardcache_server.index``), which extends it.

Every value is JSON or a plain field; nothing read from Redis is unpickled.
Multi-key updates are Lua scripts so that a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import redis

from shardcache import keys
from shardcache.errors import ConfigError, IndexUnavailable
from shardcache.redaction import redact_url

__all__ = ["DatasetRecord", "HitStats", "RedisIndex", "connect_redis"]

EVENTS_KEPT = 500  # the dashboard shows recent events; older ones are trimmed
SERIES_BUCKET_S = 10  # resolution of the hit-rate time series
SERIES_TTL_S = 2 * 24 * 3600  # two days of history
# The ranks of a job call ds.invalidate() at the same point of their loop,
# seconds apart: their calls make one generation within this window.
INVALIDATE_CALL_TTL_S = 3600
PATHS_PER_CALL = 1000  # paths per HMGET/HDEL so one call never blocks Redis for long
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

# KEYS[1] dataset hash, KEYS[2] events list, KEYS[3] channel,
# KEYS[4] (optional) the call's key: the generation it made, for its other ranks
# ARGV[1] name, ARGV[2] now, ARGV[3] reason, ARGV[4] key prefix, ARGV[5] call TTL s,
# ARGV[6] the generation the caller reads (a call made before it is not its own)
_INVALIDATE = """
if KEYS[4] then
  local made = redis.call('GET', KEYS[4])
  if made and tonumber(made) >= tonumber(ARGV[6]) then return tonumber(made) end
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local gen = redis.call('HINCRBY', KEYS[1], 'generation', 1)
if KEYS[4] then redis.call('SET', KEYS[4], gen, 'EX', ARGV[5]) end
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


class RedisIndex:
    """Typed access to one deployment's keys in Redis, as a rank uses them.

    Ranks register datasets, read generations and entries, invalidate and
    report; what only stores do (claims, ownership, listing claims, entry and
    stats writes) is ``shardcache_server.index.ClusterIndex``, a subclass.

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

    @classmethod
    def from_url(cls, url: str, namespace: str = keys.DEFAULT_NAMESPACE) -> Self:
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

    def invalidate(
        self,
        name: str,
        reason: str = "explicit invalidate",
        call: str = "",
        reading: int = 0,
    ) -> int:
        """Atomically start a new generation; returns it (0 if the dataset is unknown).

        Once this returns, readers request the new generation and stores refuse
        older ones, so nothing cached before the call is served after it.
        ``call`` names one logical call made by several ranks
        (``job/restart/epoch/n``): the first starts the generation, the others
        get the same one, unless they already read a later one (``reading``).
        """
        ids = [
            keys.dataset_key(self.ns, name),
            keys.events_key(self.ns),
            keys.invalidation_channel(self.ns),
        ]
        if call:
            ids.append(keys.invalidated_key(self.ns, name, call))
        args = [name, time.time(), reason, keys.prefix(self.ns)]
        args += [INVALIDATE_CALL_TTL_S, reading]
        with self.errors():
            return int(self._invalidate(keys=ids, args=args))

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

    # -- entries ----------------------------------------------------------------
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
                for i in range(0, len(plist), PATHS_PER_CALL):
                    chunk = plist[i : i + PATHS_PER_CALL]
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

    # -- stats, ranks, stores, events (read) ------------------------------------
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

    def stores(self) -> dict[str, dict[str, Any]]:
        with self.errors():
            raw = self.client.hgetall(keys.stores_key(self.ns))
        out = {}
        for k, v in raw.items():
            with contextlib.suppress(ValueError):
                out[k] = json.loads(v)
        return out

    def events(self, limit: int = 50) -> list[dict[str, Any]]:
        with self.errors():
            raw = self.client.lrange(keys.events_key(self.ns), 0, limit - 1)
        out = []
        for v in raw:
            with contextlib.suppress(ValueError):
                out.append(json.loads(v))
        return out

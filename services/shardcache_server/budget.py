"""A cluster-wide request budget for the object source: a token bucket in Redis.

Every store draws from the same bucket per source bucket/prefix, so many nodes
never hammer a throttled source at once. The rate adapts (AIMD): a 503
SlowDown halves it, every granted request adds back a little, up to the
configured ceiling.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shardcache import keys
from shardcache.errors import BackendError
from shardcache.index import RedisIndex

__all__ = ["RequestBudget", "budget_from_spec"]

MIN_RATE_FRACTION = 0.05  # never throttle below 5% of the configured rate
RECOVERY_FRACTION = 0.01  # each granted request restores 1% of the ceiling

# KEYS[1] bucket hash {tokens, ts_ms, rate}
# ARGV[1] ceiling rate (req/s), ARGV[2] burst, ARGV[3] "take" | "throttled"
# Returns milliseconds to wait before asking again (0: granted).
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ceiling = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local rate = tonumber(redis.call('HGET', KEYS[1], 'rate') or ceiling)
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or burst)
local ts = tonumber(redis.call('HGET', KEYS[1], 'ts_ms') or now)
if ARGV[3] == 'throttled' then
  rate = math.max(ceiling * %(min)s, rate / 2)
  redis.call('HSET', KEYS[1], 'rate', rate)
  return 0
end
tokens = math.min(burst, tokens + (now - ts) * rate / 1000)
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  rate = math.min(ceiling, rate + ceiling * %(rec)s)
else
  wait = math.ceil((1 - tokens) * 1000 / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts_ms', now, 'rate', rate)
redis.call('PEXPIRE', KEYS[1], 3600000)
return wait
""".replace("%(min)s", repr(MIN_RATE_FRACTION)).replace(
    "%(rec)s", repr(RECOVERY_FRACTION)
)


class RequestBudget:
    """Shared per-source token bucket.

    Args:
        index: the deployment's Redis index.
        rate: ceiling in requests per second for one source bucket.
        burst: tokens a quiet bucket accumulates.
    """

    def __init__(self, index: RedisIndex, rate: float, burst: int):
        self.index, self.rate, self.burst = index, rate, max(1, burst)
        self._take = index.client.register_script(_TAKE)
        self.skipped = 0  # grants given without Redis (it was down)

    def key(self, url: str) -> str:
        source = url.split("://", 1)[-1].split("/", 1)[0]
        return keys.budget_key(self.index.ns, source)

    def _grant(self, url: str) -> int:
        """Take a token: 0, or the milliseconds to wait before asking again."""
        try:
            return int(
                self._take(keys=[self.key(url)], args=[self.rate, self.burst, "take"])
            )
        except Exception as exc:  # Redis down: never block fetching on the budget
            if type(exc).__module__.split(".")[0] != "redis" and not isinstance(
                exc, BackendError
            ):
                raise
            self.skipped += 1
            return 0

    async def acquire(self, url: str) -> None:
        """Wait until the source of ``url`` has a token for one request."""
        while (wait_ms := await asyncio.to_thread(self._grant, url)) > 0:
            await asyncio.sleep(wait_ms / 1000)

    def acquire_blocking(self, url: str) -> None:
        """:meth:`acquire` for a synchronous reader (fsspec's ``cat_ranges``)."""
        while (wait_ms := self._grant(url)) > 0:
            time.sleep(wait_ms / 1000)

    async def throttled(self, url: str) -> None:
        """The source answered 503 SlowDown: halve the shared rate."""
        try:
            await asyncio.to_thread(
                self._take,
                keys=[self.key(url)],
                args=[self.rate, self.burst, "throttled"],
            )
        except Exception as exc:  # best effort, as above
            if type(exc).__module__.split(".")[0] != "redis":
                raise

    def current_rate(self, url: str) -> float:
        raw = self.index.client.hget(self.key(url), "rate")
        return float(raw) if raw is not None else self.rate


def budget_from_spec(spec: dict[str, Any] | None) -> RequestBudget | None:
    """The budget a listing task was handed as plain values
    (``listing.listing_budget``), or ``None`` when the source has none."""
    if spec is None:
        return None
    index = RedisIndex.from_url(spec["redis_url"], spec["namespace"])
    return RequestBudget(index, spec["rate"], spec["burst"])

"""The cluster-wide request budget: a token bucket in Redis shared by every store."""

from __future__ import annotations

import asyncio
import uuid

from shardcache.decoders import raw_bytes
from shardcache_server.budget import RequestBudget
from shardcache_server.emulator import FaultPlan
from shardcache_server.settings import ServiceSettings
from shardcache_server.store import CacheShard

from helpers import local_build, register_dataset

RATE, BURST = 20.0, 5


def _shards(redis_url, ns, **settings):
    cfg = ServiceSettings(
        redis_url=redis_url,
        namespace=ns,
        source_rps=RATE,
        source_burst=BURST,
        backoff_s=0.01,
        **settings,
    )
    return [
        CacheShard(
            cfg,
            node,
            put=lambda v: v,
            get=lambda v: v,
            peer=lambda n: None,
            build=local_build(cfg),
        )  # fmt: skip
        for node in ("a", "b")
    ]


def test_budget_caps_requests_per_second_across_two_stores(
    s3, s3fs_client, bucket, redis_url
):
    s3fs_client.pipe({f"{bucket}/d/{i:03d}": b"x" * 64 for i in range(40)})
    ns = f"t{uuid.uuid4().hex[:8]}"
    _, spec, items = register_dataset(s3, f"s3://{bucket}/d/", redis_url, ns)
    s3.reset_counts()

    async def scenario():
        a, b = _shards(redis_url, ns)
        for shard in (a, b):
            await shard.install(spec, raw_bytes)
        # Two "nodes" each fetch half, concurrently, forwarded=True so both fetch.
        await asyncio.gather(
            a.get("ds", 1, items[:20], forwarded=True),
            b.get("ds", 1, items[20:], forwarded=True),
        )
        for shard in (a, b):
            await shard.close()

    asyncio.run(scenario())
    times = sorted(s3.get_times)
    assert len(times) == 40
    # Counted at the server: after the initial burst, GETs arrive at no more than
    # the shared rate (both stores together). Without the budget all 40 land in
    # ~0.1 s, i.e. at hundreds per second. The first GETs of each store wait on
    # their new connection, so the steady rate is measured after the burst.
    steady = times[2 * BURST :]
    observed_rate = (len(steady) - 1) / (steady[-1] - steady[0])
    assert observed_rate <= RATE * 1.15, observed_rate


def test_budget_halves_rate_on_503_slowdown(s3, s3fs_client, bucket, redis_url):
    s3fs_client.pipe({f"{bucket}/d/{i:03d}": b"y" * 64 for i in range(10)})
    ns = f"t{uuid.uuid4().hex[:8]}"
    index, spec, items = register_dataset(s3, f"s3://{bucket}/d/", redis_url, ns)
    s3.set_faults(FaultPlan(error_rate=0.6, error_status=503, seed=3))

    async def scenario():
        (a, _b) = _shards(redis_url, ns, fetch_retries=8)
        await a.install(spec, raw_bytes)
        out = await a.get("ds", 1, items)
        await a.close()
        return out

    out = asyncio.run(scenario())
    assert all(r[0] == "fetched" for r in out)
    rate = RequestBudget(index, RATE, BURST).current_rate(f"s3://{bucket}/d/000")
    assert rate < RATE  # throttled by the SlowDowns, shared through Redis

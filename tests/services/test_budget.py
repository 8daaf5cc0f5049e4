"""The cluster-wide request budget: a token bucket in Redis shared by every store."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from shardcache.decoders import raw_bytes
from shardcache.errors import RemoteFetchError
from shardcache.index import RedisIndex
from shardcache_server.budget import RequestBudget
from shardcache_server.emulator import FaultPlan
from shardcache_server.fetch import Fetcher
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


@pytest.mark.parametrize(
    ("fault", "is_throttle"),
    [
        (FaultPlan(error_rate=1.0, error_status=503), True),
        (FaultPlan(error_rate=1.0, error_status=500), False),
        # botocore names the URL of a dropped connection in its message, so
        # "503" is in the text: counting it halved the cluster's rate.
        (FaultPlan(reset_rate=1.0), False),
    ],
    ids=["slowdown-503", "internal-500", "dropped"],
)
def test_fetcher_halves_the_budget_only_when_s3_answers_503(
    s3, s3fs_client, bucket, redis_url, fault, is_throttle
):
    url = f"s3://{bucket}/d/part-00503"
    s3fs_client.pipe(url, b"z" * 64)
    index = RedisIndex.from_url(redis_url, f"t{uuid.uuid4().hex[:8]}")
    budget = RequestBudget(index, RATE, BURST)
    s3.set_faults(fault)
    fetcher = Fetcher(
        "s3", s3.storage_options(), concurrency=1, retries=0, backoff_s=0.01,
        backoff_max_s=0.01, timeout_s=10, budget=budget,
    )  # fmt: skip

    with pytest.raises(RemoteFetchError, match="part-00503"):
        asyncio.run(fetcher.fetch(url, 64, ""))
    assert (budget.current_rate(url) < RATE) is is_throttle


def test_a_fetcher_keeps_its_concurrency_in_flight_past_botocores_pool(
    s3, s3fs_client, bucket
):
    """A store's ``fetch_concurrency`` (32 by default) is what it keeps in
    flight. botocore pools 10 connections per client unless told, and the
    GETs past 10 waited for one: a cold first batch of ~5,700 objects at
    0.3 s a GET took 151 s instead of ~50."""
    names = [f"{bucket}/wide/{i:03d}" for i in range(48)]
    s3fs_client.pipe({name: b"w" * 32 for name in names})
    s3.set_faults(FaultPlan(latency_s=0.5))  # every GET holds its connection
    s3.reset_counts()
    fetcher = Fetcher(
        "s3", s3.storage_options(), concurrency=24, retries=0, backoff_s=0.01,
        backoff_max_s=0.01, timeout_s=30,
    )  # fmt: skip

    async def fetch_all() -> list[bytes]:
        return await asyncio.gather(
            *(fetcher.fetch(f"s3://{n}", 32, "") for n in names)
        )

    assert asyncio.run(fetch_all()) == [b"w" * 32] * len(names)
    assert s3.most_in_flight == 24

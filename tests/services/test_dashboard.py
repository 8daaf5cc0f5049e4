"""Dashboard API, page, /metrics and `shardcache stats` against a real Redis, filled
by the real store code path and by UsageReporter as two ranks report."""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time
import uuid

import pytest
import redis as redis_py
from starlette.testclient import TestClient

from shardcache.decoders import raw_bytes
from shardcache.index import RedisIndex
from shardcache.usage import UsageReader, UsageReporter
from shardcache_server.dashboard import create_app
from shardcache_server.index import ClusterIndex
from shardcache_server.settings import ServiceSettings

from helpers import local_shard, register_dataset


@pytest.fixture
def filled(s3, s3fs_client, bucket, redis_url):
    """A namespace whose stats were written by a real CacheShard: 8 misses then 16 hits."""
    s3fs_client.pipe({f"{bucket}/d/{i}.bin": bytes([i]) * 64 for i in range(8)})
    ns = f"t{uuid.uuid4().hex[:8]}"
    index, spec, items = register_dataset(
        s3, f"s3://{bucket}/d/", redis_url, ns, name="images"
    )
    gen = spec["generation"]
    cfg = ServiceSettings(redis_url=redis_url, namespace=ns, stats_flush_s=0.05)

    async def run():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        for _ in range(3):
            await shard.get("images", gen, items)
        await asyncio.sleep(0.3)
        await shard.close()

    asyncio.run(run())
    index.record_rank(
        "images",
        "job1",
        0,
        {
            "hits": 16,
            "misses": 8,
            "wait_p50_ms": 1.0,
            "wait_p99_ms": 2.0,
            "generation": 1,
        },
    )
    index.record_rank(
        "images",
        "job1",
        1,
        {
            "hits": 16,
            "misses": 8,
            "wait_p50_ms": 1.1,
            "wait_p99_ms": 150.0,
            "generation": 1,
        },
    )
    return ns, index


def test_dashboard_overview_shows_store_counters_as_store_traffic(filled, redis_url):
    ns, index = filled
    client = TestClient(create_app(redis_url, ns))
    body = client.get("/api/overview").json()
    (ds,) = body["datasets"]
    store = ds["store"]
    assert (store["hits"], store["misses"], store["remote_reads"]) == (16, 8, 8)
    assert store["hit_rate"] == pytest.approx(16 / 24)
    # No rank reported what it delivered: the headline says so, not 0% or 67%.
    assert ds["hit_rate"] is None and ds["samples"] == 0 and ds["gets_saved"] == 0
    assert ds["objects_cached"] == 8
    assert (
        ds["generations"][-1]["generation"] == 1
        and ds["generations"][-1]["remote_reads"] == 8
    )
    assert body["nodes"][0]["node"] == "node-a" and body["nodes"][0]["entries"] == 8
    assert (
        redis_url.split("@")[0].split(":")[-1] not in client.get("/api/overview").text
    )


def test_dashboard_counts_cached_objects_not_chunks(
    s3, s3fs_client, bucket, redis_url, monkeypatch
):
    import shardcache_server.overview as overview

    # 8 objects in 2 chunks of 4, both cached: "8 / 8", as the ranks read them.
    s3fs_client.pipe({f"{bucket}/c/{i}.bin": bytes([i]) * 64 for i in range(8)})
    ns = f"t{uuid.uuid4().hex[:8]}"
    index, spec, items = register_dataset(
        s3, f"s3://{bucket}/c/", redis_url, ns, name="chunked", chunk_samples=4
    )
    assert len(items) == 2
    cfg = ServiceSettings(redis_url=redis_url, namespace=ns, stats_flush_s=0.05)

    async def run():
        shard = local_shard(cfg)
        await shard.install(spec, raw_bytes)
        await shard.get("chunked", spec["generation"], items[:1])
        await asyncio.sleep(0.3)
        await shard.close()

    asyncio.run(run())
    (ds,) = (
        TestClient(create_app(redis_url, ns)).get("/api/overview").json()["datasets"]
    )
    assert (ds["objects_cached"], ds["objects_total"]) == (4, 8)
    assert ds["bytes_cached"] == 4 * 64
    monkeypatch.setattr(overview, "EXACT_BYTES_MAX_ENTRIES", 0)  # the estimate
    (ds,) = (
        TestClient(create_app(redis_url, ns)).get("/api/overview").json()["datasets"]
    )
    assert (ds["objects_cached"], ds["bytes_cached"]) == (4, 4 * 64)


def test_dashboard_estimates_cached_bytes_past_the_exact_limit(
    filled, redis_url, monkeypatch
):
    import shardcache_server.overview as overview

    ns, index = filled
    exact = TestClient(create_app(redis_url, ns)).get("/api/overview").json()
    monkeypatch.setattr(overview, "EXACT_BYTES_MAX_ENTRIES", 0)
    (ds,) = (
        TestClient(create_app(redis_url, ns)).get("/api/overview").json()["datasets"]
    )
    record = index.dataset("images")
    assert ds["bytes_cached_estimated"] and ds["objects_cached"] == 8
    assert ds["bytes_cached"] == 8 * record.total_bytes // record.objects
    assert not exact["datasets"][0]["bytes_cached_estimated"]


def test_dashboard_series_chart_ranks_events_metrics(filled, redis_url):
    ns, index = filled
    client = TestClient(create_app(redis_url, ns))
    body = client.get("/api/series/images?window=600").json()
    assert body["points"] == []  # no rank reported yet
    assert sum(p["hits"] for p in body["store_points"]) == 16
    svg = client.get("/api/chart/images.svg").text
    assert svg.startswith("<svg") and "<polyline" in svg or "no data" in svg
    ranks = client.get("/api/ranks/images").json()["ranks"]
    assert [r["straggler"] for r in ranks] == [False, True]
    index.invalidate("images")
    kinds = [e["kind"] for e in client.get("/api/events").json()["events"]]
    assert kinds[0] == "invalidate" and "store_start" in kinds
    metrics = client.get("/metrics").text
    assert 'shardcache_store_hits_total{dataset="images"} 16.0' in metrics
    assert 'shardcache_hits_total{dataset="images"} 0.0' in metrics
    # A hit rate of no samples is absent, not 0.
    assert 'shardcache_hit_rate{dataset="images"}' not in metrics
    assert client.get("/api/series/images?job=a:b").status_code == 400


def test_dashboard_bearer_token_required_when_set(filled, redis_url):
    ns, _ = filled
    client = TestClient(create_app(redis_url, ns, token="s3cret"))
    assert client.get("/api/overview").status_code == 401
    assert (
        client.get(
            "/api/overview", headers={"Authorization": "Bearer s3cret"}
        ).status_code
        == 200
    )
    assert client.get("/healthz").status_code == 200
    # Never from a URL: history and proxy logs keep it.
    assert client.get("/api/overview?token=s3cret").status_code == 401
    bookmark = client.get("/?token=s3cret")
    assert bookmark.status_code == 401 and "<form" in bookmark.text
    assert "no longer read from the URL" in bookmark.text
    assert "s3cret" not in bookmark.text
    wrong = client.post("/login", data={"token": "guess"}, follow_redirects=False)
    assert wrong.status_code == 401 and "Wrong token" in wrong.text
    assert not client.cookies
    right = client.post("/login", data={"token": "s3cret"}, follow_redirects=False)
    assert right.status_code == 303
    cookie = right.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "s3cret" not in cookie  # an HMAC of the token, not the token
    assert client.get("/api/overview").status_code == 200  # the cookie rides along
    assert client.get("/").status_code == 200
    other = TestClient(create_app(redis_url, ns, token="another"))
    other.cookies = client.cookies
    assert other.get("/api/overview").status_code == 401


def test_dashboard_redis_down_is_503_not_traceback():
    client = TestClient(create_app("redis://:pw@127.0.0.1:1/0", "x"))
    resp = client.get("/api/overview")
    assert resp.status_code == 503 and "cannot reach Redis" in resp.json()["error"]
    assert "pw" not in resp.text
    assert client.get("/healthz").status_code == 503


def test_dashboard_follows_the_embedded_redis_to_its_new_port(filled, redis_url):
    # `shardcache local stop`, then the next script: the embedded Redis runs
    # on another port, and a dashboard started before shows it, not a 503.
    ns, _ = filled
    now = {"url": "redis://:pw@127.0.0.1:1/0"}  # the old one, gone
    client = TestClient(create_app(now["url"], ns, follow=lambda: now["url"]))
    assert client.get("/api/overview").status_code == 503  # nowhere else yet
    now["url"] = redis_url
    (ds,) = client.get("/api/overview").json()["datasets"]
    assert ds["name"] == "images"
    assert client.get("/healthz").text == "ok"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the headline is what the ranks delivered (issue 17) ---------------------------

OBJECTS = 1000
OBJECT_BYTES = 4096


def drive_ranks(
    redis_url: str,
    ns: str,
    origins_by_epoch: list[str],
    *,
    job: str = "job1",
    world: int = 2,
    t0: float | None = None,
    dataset: str = "images",
) -> list[UsageReporter]:
    """Report as ``world`` ranks of one job would, one epoch per 10 s bucket:
    each rank serves its half of OBJECTS per epoch from the given origin, in
    batches of 50, blocked 2 ms per batch (rank 1: 20 ms)."""
    now = [time.time() - 10 * len(origins_by_epoch) if t0 is None else t0]
    reporters = [
        UsageReporter(
            lambda: redis_py.Redis.from_url(redis_url, decode_responses=True),
            ns,
            dataset,
            job,
            rank,
            redis_url=redis_url,
            clock=lambda: now[0],
        )
        for rank in range(world)
    ]
    for epoch, origin in enumerate(origins_by_epoch, start=1):
        for rank, reporter in enumerate(reporters):
            for _ in range(OBJECTS // world // 50):
                reporter.served(origin, 50, 50 * OBJECT_BYTES)
                reporter.waited(0.002 if rank == 0 else 0.02, epoch)
            assert reporter.flush()
        now[0] += 10
    for reporter in reporters:
        assert reporter.close() == 0
    return reporters


@pytest.fixture
def two_ranks_three_epochs(redis_url):
    """The issue's job: 2 ranks, 3 epochs over 1,000 objects; epoch 1 from the
    source, epochs 2-3 from views the ranks hold. The stores saw epoch 1 only,
    as happens when warm batches never reach a store."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    index = ClusterIndex.from_url(redis_url, ns)  # flush_stats: as a store would
    index.register("images", "s3://b/images/", "fp", OBJECTS, OBJECTS * OBJECT_BYTES)
    index.flush_stats(
        {("images", 1): {"misses": OBJECTS, "remote_reads": OBJECTS}}, "node-a"
    )
    index.record_rank(
        "images", "job1", 0, {"hits": 1000, "misses": 500, "wait_p99_ms": 2.0}
    )
    drive_ranks(redis_url, ns, ["source", "local", "local"])
    return ns, index


def test_dashboard_headline_counts_every_sample_ranks_delivered(
    two_ranks_three_epochs, redis_url
):
    ns, index = two_ranks_three_epochs
    client = TestClient(create_app(redis_url, ns))
    (ds,) = client.get("/api/overview").json()["datasets"]
    assert ds["hit_rate"] == pytest.approx(2 / 3, abs=0.01)
    assert ds["byte_hit_rate"] == pytest.approx(2 / 3, abs=0.01)
    assert ds["gets_saved"] == 2 * OBJECTS and ds["samples"] == 3 * OBJECTS
    assert ds["source_reads"] == OBJECTS and ds["lost_samples"] == 0
    assert ds["sample_ratio"]["local"] == pytest.approx(2 / 3)
    assert ds["sample_ratio"]["peer"] == 0.0
    assert ds["bytes_by_origin"]["source"] == OBJECTS * OBJECT_BYTES
    # Store traffic is shown apart and unchanged: the stores never saw a hit.
    assert ds["store"]["hit_rate"] == 0.0 and ds["store"]["remote_reads"] == OBJECTS
    (job,) = ds["jobs"]
    assert job["job"] == "job1" and job["hit_rate"] == pytest.approx(2 / 3)
    # What ds.stats()["cluster"] reads agrees with the page.
    assert UsageReader(index.client, ns).totals("images").as_dict() == {
        k: ds[k] for k in UsageReader(index.client, ns).totals("images").as_dict()
    }
    # Hit rate over time, per dataset and per job: 0%, then 100%, 100%.
    for q in ("", "&job=job1"):
        points = client.get(f"/api/series/images?window=3600{q}").json()["points"]
        assert [p["hit_rate"] for p in points] == [0.0, 1.0, 1.0]
        assert sum(p["samples"] for p in points) == 3 * OBJECTS
    svg = client.get("/api/chart/images.svg?job=job1").text
    assert "<polyline" in svg and "job job1" in svg


def test_dashboard_ranks_show_blocked_time_per_epoch_and_the_rank_that_waited(
    two_ranks_three_epochs, redis_url
):
    ns, _ = two_ranks_three_epochs
    ranks = TestClient(create_app(redis_url, ns)).get("/api/ranks/images").json()
    r0, r1 = ranks["ranks"]
    assert (r0["rank"], r1["rank"]) == ("0", "1")
    assert r0["samples"] == r1["samples"] == 3 * OBJECTS // 2
    assert r0["hit_rate"] == pytest.approx(2 / 3)
    # 10 batches per epoch: 20 ms (rank 0) and 200 ms (rank 1) blocked per epoch.
    assert r0["blocked_s_by_epoch"] == pytest.approx({"1": 0.02, "2": 0.02, "3": 0.02})
    assert r1["blocked_s"] == pytest.approx(0.6) and r1["epoch"] == 3
    assert r0["wait_p99_ms"] == 2.0  # its own report is kept beside
    assert not r0["straggler"]


def test_metrics_export_rank_reported_hit_rate_and_store_traffic_apart(
    two_ranks_three_epochs, redis_url
):
    from prometheus_client.parser import text_string_to_metric_families

    ns, _ = two_ranks_three_epochs
    text = TestClient(create_app(redis_url, ns)).get("/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    ds = (("dataset", "images"),)
    assert samples[("shardcache_hit_rate", ds)] == pytest.approx(2 / 3, abs=0.01)
    assert samples[("shardcache_gets_saved_total", ds)] == 2 * OBJECTS
    assert samples[("shardcache_hits_total", ds)] == 2 * OBJECTS
    assert samples[("shardcache_misses_total", ds)] == OBJECTS
    assert samples[("shardcache_store_hit_rate", ds)] == 0.0
    assert samples[("shardcache_remote_reads_total", ds)] == OBJECTS
    local = (("dataset", "images"), ("origin", "local"))
    assert samples[("shardcache_samples_total", local)] == 2 * OBJECTS
    job = (("dataset", "images"), ("job", "job1"))
    assert samples[("shardcache_job_hit_rate", job)] == pytest.approx(2 / 3)
    rank1 = (("dataset", "images"), ("job", "job1"), ("rank", "1"))
    assert samples[("shardcache_rank_blocked_seconds_total", rank1)] == pytest.approx(
        0.6
    )


def test_cli_stats_shows_rank_reported_hit_rate_and_store_traffic(
    two_ranks_three_epochs, redis_url
):
    from typer.testing import CliRunner

    from shardcache_server.cli import app

    ns, _ = two_ranks_three_epochs
    common = ["--redis-url", redis_url, "--namespace", ns]
    res = CliRunner().invoke(app, ["stats", "images", *common])
    assert res.exit_code == 0, res.output
    delivered, store = res.output.split("Store traffic")
    assert "66.7%" in delivered and str(2 * OBJECTS) in delivered
    assert "0.0%" in store and str(OBJECTS) in store
    by_job = CliRunner().invoke(app, ["stats", "images", "--by-job", *common])
    assert by_job.exit_code == 0 and "job1" in by_job.output
    assert "66.7%" in by_job.output


def test_dashboard_hit_rate_dips_after_invalidate(redis_url):
    ns = f"t{uuid.uuid4().hex[:8]}"
    index = RedisIndex.from_url(redis_url, ns)
    index.register("images", "s3://b/images/", "fp", OBJECTS, OBJECTS * OBJECT_BYTES)
    t0 = time.time() - 60
    drive_ranks(redis_url, ns, ["source", "local"], t0=t0)
    index.invalidate("images")  # the job re-reads the new generation
    drive_ranks(redis_url, ns, ["source", "local"], t0=t0 + 20)
    client = TestClient(create_app(redis_url, ns))
    points = client.get("/api/series/images").json()["points"]
    assert [p["hit_rate"] for p in points] == [0.0, 1.0, 0.0, 1.0]
    (ds,) = client.get("/api/overview").json()["datasets"]
    assert ds["hit_rate"] == pytest.approx(0.5) and ds["generation"] == 2
    assert ds["gets_saved"] == 2 * OBJECTS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dashboard_page_in_headless_chromium_shows_rank_reported_hit_rate(
    two_ranks_three_epochs, redis_url, tmp_path
):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip(
            "no Chromium: scripts/test.sh installs Debian's chromium when it can (root + apt)"
        )
    playwright = pytest.importorskip("playwright.sync_api")
    import uvicorn

    ns, _ = two_ranks_three_epochs
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(redis_url, ns, token="s3cret"),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=chromium,
                headless=True,
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--no-first-run",
                ],
            )
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/")
            # With a token, the page asks for it in a form, then its polls
            # carry the session cookie; the token never enters a URL.
            page.fill("input[name='token']", "s3cret")
            page.click("button[type='submit']")
            page.wait_for_selector("body[data-loaded='1']", timeout=20000)
            assert page.url == f"http://127.0.0.1:{port}/"
            page.wait_for_selector("svg.chart")
            assert page.inner_text("td.hit-rate[data-dataset='images']") == "66.7%"
            assert page.inner_text("td.gets-saved[data-dataset='images']") == str(
                2 * OBJECTS
            )
            assert page.inner_text("td.store-hit-rate") == "0.0%"
            assert page.inner_text("td.job-hit-rate[data-job='job1']") == "66.7%"
            assert page.locator(".chart-box[data-job='job1'] polyline").count() == 1
            assert page.locator("table.ranks tr.straggler").count() == 0
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
        assert (tmp_path / "dashboard.png").stat().st_size > 1000
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_gone_store_is_counted_by_no_view(filled, redis_url):
    """A Ray Train script's own local cluster ends with the script; its
    store's heartbeat record and index entries stay in Redis. No view may
    count its memory or its chunks as cached."""
    import json

    from typer.testing import CliRunner

    from shardcache import keys
    from shardcache_server.cli import app

    ns, index = filled
    gen = index.generation("images")
    before = TestClient(create_app(redis_url, ns)).get("/api/overview").json()
    gone = {
        "ts": time.time() - 3600,
        "used_bytes": 7 << 20,
        "budget_bytes": 8 << 20,
        "bytes_by_dataset": {"images": 7 << 20},
    }
    index.client.hset(keys.stores_key(ns), "deadbeef" * 7, json.dumps(gone))
    entry = {"size": 640, "samples": 10, "owner": "deadbeef" * 7, "generation": gen}
    index.client.hset(keys.entries_key(ns, "images", gen), "c99", json.dumps(entry))

    client = TestClient(create_app(redis_url, ns))
    body = client.get("/api/overview").json()
    (ds,) = body["datasets"]
    (was,) = before["datasets"]
    assert (ds["objects_cached"], ds["bytes_cached"]) == (
        was["objects_cached"],
        was["bytes_cached"],
    )
    assert "deadbeef" not in json.dumps(body["nodes"])
    assert "deadbeef" not in client.get("/metrics").text
    listed = CliRunner().invoke(
        app, ["ls", "--redis-url", redis_url, "--namespace", ns]
    )
    assert listed.exit_code == 0 and "deadbeef" not in listed.output


def test_two_ranks_with_one_slow_batch_are_not_stragglers(redis_url):
    """A p99 over a few dozen batches is one slow batch; with two ranks the
    median of both can never be exceeded twice over, so each is compared
    with the other, and a margin is needed as well."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    index = ClusterIndex.from_url(redis_url, ns)
    for rank, p99 in ((0, 56.65), (1, 0.78)):
        index.record_rank("images", "st", rank, {"wait_p99_ms": p99, "hits": 5})
    ranks = TestClient(create_app(redis_url, ns)).get("/api/ranks/images").json()
    assert [r["straggler"] for r in ranks["ranks"]] == [False, False]
    index.record_rank("images", "st", 0, {"wait_p99_ms": 400.0, "hits": 5})
    ranks = TestClient(create_app(redis_url, ns)).get("/api/ranks/images").json()
    assert [r["straggler"] for r in ranks["ranks"]] == [True, False]


def test_a_rank_is_compared_with_its_own_jobs_ranks_only(redis_url):
    """A cold job's ranks waited longer than a warm job's: neither job has a
    straggler, since ranks of another job are not a rank's peers."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    index = ClusterIndex.from_url(redis_url, ns)
    for job, p99 in (("cold", 400.0), ("warm", 2.0)):
        for rank in (0, 1):
            index.record_rank("images", job, rank, {"wait_p99_ms": p99, "hits": 5})
    app_ = create_app(redis_url, ns)
    ranks = TestClient(app_).get("/api/ranks/images").json()["ranks"]
    assert len(ranks) == 4 and not any(r["straggler"] for r in ranks)
    index.record_rank("images", "warm", 1, {"wait_p99_ms": 300.0, "hits": 5})
    ranks = TestClient(app_).get("/api/ranks/images").json()["ranks"]
    flagged = [(r["job"], r["rank"]) for r in ranks if r["straggler"]]
    assert flagged == [("warm", "1")]

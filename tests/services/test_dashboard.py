"""Dashboard API and page against a real Redis filled by the real store code path."""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time
import uuid

import pytest
from starlette.testclient import TestClient

from shardcache.decoders import raw_bytes
from shardcache_server.dashboard import create_app
from shardcache_server.settings import ServiceSettings
from shardcache_server.shard import CacheShard

from helpers import register_dataset


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
        shard = CacheShard(cfg, "node-a", put=lambda v: v, peer=lambda n: None)
        await shard.register(spec, raw_bytes)
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
            "wait_p99_ms": 9.0,
            "generation": 1,
        },
    )
    return ns, index


def test_dashboard_overview_matches_redis(filled, redis_url):
    ns, index = filled
    client = TestClient(create_app(redis_url, ns))
    body = client.get("/api/overview").json()
    (ds,) = body["datasets"]
    assert (ds["hits"], ds["misses"], ds["remote_reads"]) == (16, 8, 8)
    assert ds["hit_rate"] == pytest.approx(16 / 24) == index.stats("images").hit_rate
    assert ds["objects_cached"] == 8 and ds["gets_saved"] == 16
    assert (
        ds["generations"][-1]["generation"] == 1
        and ds["generations"][-1]["remote_reads"] == 8
    )
    assert body["nodes"][0]["node"] == "node-a" and body["nodes"][0]["entries"] == 8
    assert (
        redis_url.split("@")[0].split(":")[-1] not in client.get("/api/overview").text
    )


def test_dashboard_estimates_cached_bytes_past_the_exact_limit(
    filled, redis_url, monkeypatch
):
    import shardcache_server.dashboard as dashboard

    ns, index = filled
    exact = TestClient(create_app(redis_url, ns)).get("/api/overview").json()
    monkeypatch.setattr(dashboard, "EXACT_BYTES_MAX_ENTRIES", 0)
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
    points = client.get("/api/series/images?window=600").json()["points"]
    assert sum(p["hits"] for p in points) == 16
    svg = client.get("/api/chart/images.svg").text
    assert svg.startswith("<svg") and "<polyline" in svg or "no data" in svg
    ranks = client.get("/api/ranks/images").json()["ranks"]
    assert [r["straggler"] for r in ranks] == [False, True]
    index.invalidate("images")
    kinds = [e["kind"] for e in client.get("/api/events").json()["events"]]
    assert kinds[0] == "invalidate" and "store_start" in kinds
    metrics = client.get("/metrics").text
    assert 'shardcache_hits_total{dataset="images"} 16.0' in metrics
    assert 'shardcache_hit_rate{dataset="images"}' in metrics


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


def test_dashboard_redis_down_is_503_not_traceback():
    client = TestClient(create_app("redis://:pw@127.0.0.1:1/0", "x"))
    resp = client.get("/api/overview")
    assert resp.status_code == 503 and "cannot reach Redis" in resp.json()["error"]
    assert "pw" not in resp.text
    assert client.get("/healthz").status_code == 503


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dashboard_page_in_headless_chromium_shows_redis_hit_rate(
    filled, redis_url, tmp_path
):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip(
            "no Chromium: scripts/test.sh installs Debian's chromium when it can (root + apt)"
        )
    playwright = pytest.importorskip("playwright.sync_api")
    import uvicorn

    ns, index = filled
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(redis_url, ns), host="127.0.0.1", port=port, log_level="warning"
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
            page.wait_for_selector("body[data-loaded='1']", timeout=20000)
            page.wait_for_selector("svg.chart")
            shown = page.inner_text("td.hit-rate[data-dataset='images']")
            expected = f"{100 * index.stats('images').hit_rate:.1f}%"
            assert shown == expected
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
        assert (tmp_path / "dashboard.png").stat().st_size > 1000
    finally:
        server.should_exit = True
        thread.join(timeout=10)

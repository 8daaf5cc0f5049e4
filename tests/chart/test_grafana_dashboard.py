"""The chart's Grafana dashboard: rendered only when asked, and every metric it
queries is one the dashboard's /metrics exports (from a real Redis) and
docs/metrics.md documents."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import pytest
import redis as redis_py
from starlette.testclient import TestClient

from shardcache.usage import UsageReporter
from shardcache_server.dashboard import create_app
from shardcache_server.index import ClusterIndex
from shardcache_server.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]
GRAFANA_JSON = ROOT / "helm" / "shardcache" / "dashboards" / "shardcache.json"
_METRIC_RE = re.compile(r"\bshardcache_[a-z0-9_]+\b")


def _queried_metrics() -> set[str]:
    dash = json.loads(GRAFANA_JSON.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    names = {m for e in exprs for m in _METRIC_RE.findall(e)}
    assert names, "the dashboard queries no shardcache metric"
    return names


def _exported_metrics(redis_url: str) -> set[str]:
    """Sample names of /metrics over a namespace where every kind of figure exists."""
    from prometheus_client.parser import text_string_to_metric_families

    ns = f"t{uuid.uuid4().hex[:8]}"
    index = ClusterIndex.from_url(redis_url, ns)
    index.register("images", "s3://b/images/", "fp", 10, 1000)
    index.flush_stats({("images", 1): {"hits": 1, "misses": 1}}, "node-a")
    index.heartbeat("node-a", {"used_bytes": 10, "budget_bytes": 100, "ts": time.time()})
    index.record_rank("images", "job1", 0, {"wait_p99_ms": 1.0})
    reporter = UsageReporter(
        lambda: redis_py.Redis.from_url(redis_url, decode_responses=True),
        ns,
        "images",
        "job1",
        0,
    )
    reporter.served("source", 5, 500)
    reporter.served("local", 5, 500)
    reporter.waited(0.1, epoch=0)
    assert reporter.close() == 0
    text = TestClient(create_app(redis_url, ns)).get("/metrics").text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_grafana_dashboard_queries_only_metrics_that_metrics_exports(redis_url):
    queried = _queried_metrics()
    exported = _exported_metrics(redis_url)
    assert queried <= exported, sorted(queried - exported)
    assert exported >= set(METRICS), sorted(set(METRICS) - exported)


def test_every_exported_metric_is_documented():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert {m for m in METRICS if f"`{m}`" not in doc} == set()


@pytest.mark.helm
def test_grafana_dashboard_configmap_renders_only_when_grafana_dashboard_set():
    from test_chart import objects  # the chart's real Helm renderer

    def dashboards(values):
        return [
            o
            for o in objects(values)
            if o["kind"] == "ConfigMap"
            and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
        ]

    assert dashboards({}) == []
    (cm,) = dashboards({"metrics": {"grafanaDashboard": {"enabled": True}}})
    assert cm["metadata"]["namespace"] == "cache"
    assert json.loads(cm["data"]["shardcache.json"]) == json.loads(
        GRAFANA_JSON.read_text()
    )
    (other,) = dashboards(
        {"metrics": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}}
    )
    assert other["metadata"]["namespace"] == "monitoring"

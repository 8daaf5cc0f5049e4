"""UsageReporter and UsageReader against a real redis-server, including one
that stops and restarts mid-job."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_py

from shardcache import flusher, keys
from shardcache.embedded import start_redis_server
from shardcache.errors import ConfigError
from shardcache.usage import UsageReader, UsageReporter


def _factory(url: str):
    return lambda: redis_py.Redis.from_url(
        url, decode_responses=True, socket_timeout=2, socket_connect_timeout=2
    )


def _ns() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


class _Restartable:
    """A redis-server that can be stopped and started again on the same port
    and directory; SHUTDOWN SAVE keeps the data across, as a restart would."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.proc, self.url = start_redis_server(directory)
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    def stop(self) -> None:
        client = redis_py.Redis.from_url(self.url)
        client.shutdown(save=True)
        self.proc.wait(timeout=10)

    def start(self) -> None:
        self.proc, url = start_redis_server(self.directory, port=self.port)
        assert url == self.url


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[_Restartable]:
    server = _Restartable(tmp_path)
    yield server
    if server.proc.poll() is None:
        server.proc.terminate()
        server.proc.wait(timeout=10)


def test_usage_reporter_unknown_origin_is_config_error_listing_choices():
    reporter = UsageReporter(lambda: None, "default", "images", "job1", 0)
    with pytest.raises(ConfigError, match="'local', 'disk', 'peer', 'source'"):
        reporter.served("store", 1, 1)
    with pytest.raises(ConfigError, match="job"):
        UsageReporter(lambda: None, "default", "images", "a/b", 0)
    with pytest.raises(ConfigError, match="rank"):
        UsageReporter(lambda: None, "default", "images", "job1", -1)


def test_usage_reporter_counts_each_origin_once_in_every_view(redis_url):
    ns = _ns()
    reporter = UsageReporter(_factory(redis_url), ns, "images", "job1", 3)
    reporter.served("local", 60, 600)
    reporter.served("peer", 30, 300)
    reporter.served("source", 10, 100)
    reporter.waited(0.25, epoch=0)
    assert reporter.flush() and reporter.flush()  # nothing new: no second count
    reader = UsageReader(redis_py.Redis.from_url(redis_url, decode_responses=True), ns)
    t = reader.totals("images")
    assert (t.samples, t.nbytes, t.gets_saved) == (100, 1000, 90)
    assert t.hit_rate == pytest.approx(0.9) and t.byte_hit_rate == pytest.approx(0.9)
    assert reader.jobs("images")["job1"] == t
    (rank,) = reader.ranks("images")
    assert (rank.job, rank.rank, rank.epoch) == ("job1", "3", 0)
    assert rank.totals == t and rank.blocked_s_by_epoch == {0: 0.25}
    (point,) = reader.series("images", 600)
    assert point[1] == t


def test_usage_job_record_is_the_listing_and_generation_of_the_latest_batch(
    redis_url,
):
    ns = _ns()
    reporter = UsageReporter(_factory(redis_url), ns, "images", "job1", 0)
    reader = UsageReader(redis_py.Redis.from_url(redis_url, decode_responses=True), ns)
    reporter.served("local", 1, 1)
    assert reporter.flush()  # no batch read yet: no record
    assert reader.job_reads("images", ["job1"])["job1"].listing is None
    reporter.reading("d1", 1)
    reporter.served("local", 1, 1)
    reporter.reading("d2", 3)  # a refresh and an invalidation since
    assert reporter.flush()
    read = reader.job_reads("images", ["job1", "other"])
    assert read["job1"].as_dict() == {"listing": "d2", "generation": 3}
    assert read["other"].as_dict() == {"listing": None, "generation": None}
    assert reader.datasets_of_job(["images", "text"], "job1") == ["images"]
    assert reader.jobs("images")["job1"].samples == 2  # totals unaffected


def test_usage_flush_applied_once_when_the_reply_is_lost(redis_url):
    """Redis applied the flush but the reply never came: the retry is a no-op."""

    class LosesFirstReply(redis_py.Redis):
        lost = 0

        def evalsha(self, *args, **kwargs):
            result = super().evalsha(*args, **kwargs)
            if LosesFirstReply.lost == 0:
                LosesFirstReply.lost = 1
                raise redis_py.TimeoutError("reply lost")
            return result

    ns = _ns()
    reporter = UsageReporter(
        lambda: LosesFirstReply.from_url(redis_url, decode_responses=True),
        ns,
        "images",
        "job1",
        0,
    )
    reporter.served("source", 500, 5000)
    assert not reporter.flush()  # applied, but the reporter cannot know
    reporter.served("local", 500, 5000)
    assert reporter.flush(force=True)
    reader = UsageReader(redis_py.Redis.from_url(redis_url, decode_responses=True), ns)
    t = reader.totals("images")
    assert (t.samples_source, t.samples_local, t.lost_samples) == (500, 500, 0)


def test_usage_redis_stopped_midway_loses_nothing_it_could_keep(restartable):
    ns = _ns()
    reporter = UsageReporter(_factory(restartable.url), ns, "images", "job1", 0)
    reporter.served("source", 500, 5000)
    assert reporter.flush()
    restartable.stop()
    for _ in range(5):  # the background thread keeps trying while Redis is away
        reporter.served("local", 100, 1000)
        reporter.waited(0.01, epoch=1)
        assert not reporter.flush(force=True)
    assert reporter.unflushed_samples == 500 and reporter.failed_flushes == 5
    assert "cannot reach Redis" in (reporter.last_error or "")
    restartable.start()
    assert reporter.flush(force=True) and reporter.unflushed_samples == 0
    client = redis_py.Redis.from_url(restartable.url, decode_responses=True)
    t = UsageReader(client, ns).totals("images")
    assert (t.samples_source, t.samples_local, t.lost_samples) == (500, 500, 0)
    assert t.blocked_s == pytest.approx(0.05)


def test_usage_redis_down_past_the_bound_counts_what_was_dropped(restartable):
    ns = _ns()
    reporter = UsageReporter(
        _factory(restartable.url), ns, "images", "job1", 0, max_pending_flushes=2
    )
    reporter.served("source", 100, 1000)
    assert reporter.flush()
    restartable.stop()
    for _ in range(5):  # five failed batches, two kept: three dropped
        reporter.served("local", 100, 1000)
        assert not reporter.flush(force=True)
    assert reporter.lost_samples == 300
    restartable.start()
    reporter.served("local", 100, 1000)
    assert reporter.flush(force=True)
    client = redis_py.Redis.from_url(restartable.url, decode_responses=True)
    t = UsageReader(client, ns).totals("images")
    served = 100 + 5 * 100 + 100
    assert t.lost_samples == 300 and t.lost_bytes == 3000
    assert t.samples + t.lost_samples == served  # lost at most what was dropped
    (rank,) = UsageReader(client, ns).ranks("images")
    assert rank.totals.lost_samples == 300


def test_usage_close_with_redis_down_returns_the_unreported_samples(restartable):
    reporter = UsageReporter(_factory(restartable.url), _ns(), "images", "job1", 0)
    reporter.served("local", 7, 70)
    restartable.stop()
    assert reporter.close() == 7


def _child(url: str, ns: str, reporter: UsageReporter) -> None:
    reporter.served("peer", 5, 50)  # the parent's 100 unflushed are not ours
    assert reporter.flush()


def test_usage_forked_child_does_not_resend_the_parents_counts(redis_url):
    ns = _ns()
    reporter = UsageReporter(_factory(redis_url), ns, "images", "job1", 0)
    reporter.served("local", 100, 1000)
    proc = multiprocessing.get_context("fork").Process(
        target=_child, args=(redis_url, ns, reporter)
    )
    proc.start()
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert reporter.flush()
    reader = UsageReader(redis_py.Redis.from_url(redis_url, decode_responses=True), ns)
    t = reader.totals("images")
    assert (t.samples_local, t.samples_peer) == (100, 5)


def _collect_forked_copy(box: list, redis_url: str) -> None:
    """A forked child (a DataLoader worker) with a flusher of its own drops
    its copy of the parent's owner, then lives past two flush intervals."""
    flusher.keep_flushed(UsageReporter(_factory(redis_url), _ns(), "images", "j", 0))
    box.clear()
    gc.collect()
    time.sleep(2.5)
    os._exit(0)


def test_an_owner_collected_is_reported_by_its_own_process_only(redis_url):
    """flusher.retire: a session collected before its process ends gets its
    last report and its ``ended`` stamp (session.py); a forked child's copy
    of it, collected in the child, writes nothing under the parent's rank
    (a review: every worker fork stamped the live rank ``ended``)."""
    ns = _ns()
    reporter = UsageReporter(_factory(redis_url), ns, "images", "job1", 0)
    flusher.keep_flushed(reporter)
    box = [type("Owner", (), {})()]
    weakref.finalize(box[0], flusher.retire, reporter, lambda: True, os.getpid())
    client = redis_py.Redis.from_url(redis_url, decode_responses=True)
    key = keys.usage_rank_key(ns, "images", "job1/0")
    proc = multiprocessing.get_context("fork").Process(
        target=_collect_forked_copy, args=(box, redis_url)
    )
    proc.start()
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert client.hget(key, "ended") is None
    box.clear()  # collected here, in its own process
    deadline = time.monotonic() + 10
    while client.hget(key, "ended") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.hget(key, "ended") is not None

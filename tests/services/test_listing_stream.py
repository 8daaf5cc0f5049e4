"""The streaming listing: order, odd keys, 503s mid-listing, the shared budget,
and a listing that fails halfway never published."""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from pathlib import Path
from typing import Any

import pytest

from shardcache.errors import RemoteFetchError
from shardcache.manifest import sample_hash
from shardcache_server import objects
from shardcache_server.emulator import FaultPlan
from shardcache_server.fetch import Fetcher, read_ranges
from shardcache_server.listing import Listings, list_in_thread
from shardcache_server.objects import _version_of, list_source

# Names that trip URL encoding, sorting or byte lengths: a space, unicode,
# "%" (alone and as a fake escape), "+", "?"/"&"/"=", a very long name, and
# "a.txt" beside the directory "a/" ("." sorts before "/").
ODD_NAMES = [
    "a b.bin",
    "ünï/çødé ☃.bin",
    "100%.bin",
    "%41%2F.bin",
    "+plus.bin",
    "q?x=1&y.bin",
    "a.txt",
    "a/b.bin",
    "a/c/d.bin",
    "z" * 200 + ".bin",
]


def _expected(fs: Any, root: str, protocol: str) -> list[tuple[str, int, str]]:
    found = fs.find(root, detail=True)
    head = "" if protocol == "file" else f"{protocol}://"
    return [
        (head + p, int(i["size"]), _version_of(fs, i))
        for p, i in sorted(found.items())
        if i["type"] == "file"
    ]


def _rows(manifest: Any) -> list[tuple[str, int, str]]:
    return [
        (manifest.url(i), manifest.size(i), manifest.etag(i))
        for i in range(len(manifest))
    ]


def test_list_source_local_odd_names_in_sorted_order(tmp_path: Path) -> None:
    import fsspec

    root = tmp_path / "odd"
    for i, name in enumerate(ODD_NAMES):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * (i + 1))
    manifest = list_source(f"{root}/")
    fs = fsspec.filesystem("file")
    assert _rows(manifest) == _expected(fs, str(root), "file")
    assert len(manifest) == len(ODD_NAMES)
    for i in range(len(manifest)):  # read back through the listed URL
        assert Path(manifest.url(i)).read_bytes() == b"x" * manifest.size(i)
        assert int(manifest.hashes[i]) == sample_hash(manifest.url(i), manifest.etag(i))


def test_list_source_s3_odd_keys_listed_read_and_counted_once(
    s3: Any, s3fs_client: Any, bucket: str
) -> None:
    names = [*ODD_NAMES, "k" * 900 + ".bin"]  # S3 keys go to 1,024 bytes
    data = {f"{bucket}/odd/{n}": os.urandom(i + 1) for i, n in enumerate(names)}
    s3fs_client.pipe(data)
    s3.reset_counts()
    manifest = list_source(f"s3://{bucket}/odd/", s3.storage_options())
    assert _rows(manifest) == _expected(s3fs_client, f"{bucket}/odd/", "s3")
    assert s3.total_gets == 0

    async def read_all() -> list[bytes]:
        fetcher = Fetcher(
            "s3", s3.storage_options(), concurrency=4, retries=1,
            backoff_s=0.01, backoff_max_s=0.1, timeout_s=10,
        )  # fmt: skip
        return await asyncio.gather(
            *(fetcher.fetch(*_rows(manifest)[i][:1], manifest.size(i), manifest.etag(i))
              for i in range(len(manifest)))
        )  # fmt: skip

    got = asyncio.run(read_all())
    assert got == [data[manifest.url(i)[len("s3://") :]] for i in range(len(manifest))]
    assert sorted(s3.gets) == sorted(f"/{k}" for k in data)  # each key once
    assert set(s3.gets.values()) == {1}


def test_list_source_s3_sub_prefixes_merge_in_key_order(
    s3: Any, s3fs_client: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sub-prefixes of different sizes finish in any order; the manifest is
    # the keys sorted, whatever the timing.
    monkeypatch.setattr(objects, "LIST_PAGE_KEYS", 3)
    keys = [
        f"p/{d}/{i:03d}"
        for d in ("b", "a", "c-", "c")
        for i in range(7 if d == "a" else 2)
    ]
    keys += ["p/a.txt", "p/top", "p/c.bin"]
    s3fs_client.pipe({f"{bucket}/{k}": k.encode() for k in keys})
    s3.set_faults(FaultPlan(list_latency_s=0.01))
    manifest = list_source(f"s3://{bucket}/p/", s3.storage_options())
    assert manifest.urls() == sorted(f"s3://{bucket}/{k}" for k in keys)
    assert manifest.sizes.tolist() == [
        len(u) - len(f"s3://{bucket}/") for u in manifest.urls()
    ]


def test_list_source_503_pages_back_off_and_continue_from_their_token(
    s3: Any, s3fs_client: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(objects, "LIST_PAGE_KEYS", 5)
    monkeypatch.setattr(objects, "_BACKOFF_MAX_S", 0.05)
    keys = [f"flat/{i:04d}" for i in range(60)]  # one level: 12 pages
    s3fs_client.pipe({f"{bucket}/{k}": b"v" for k in keys})
    s3.reset_counts()
    s3.set_faults(FaultPlan(list_error_rate=0.3, error_status=503, seed=3))
    manifest = list_source(f"s3://{bucket}/flat/", s3.storage_options())
    assert manifest.urls() == [f"s3://{bucket}/{k}" for k in keys]
    assert s3.list_errors > 0
    # Every page was answered once: a 503 re-asked its own page, never page 1.
    assert s3.lists - s3.list_errors == 12


def test_list_source_takes_the_shared_budget_and_halves_it_on_503(
    s3: Any, s3fs_client: Any, bucket: str, redis_url: str, redis: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from shardcache.index import RedisIndex
    from shardcache_server.budget import RequestBudget

    monkeypatch.setattr(objects, "LIST_PAGE_KEYS", 5)
    monkeypatch.setattr(objects, "_BACKOFF_MAX_S", 0.05)
    s3fs_client.pipe({f"{bucket}/b/{i:03d}": b"v" for i in range(30)})
    # A ceiling of 1 request/s with a burst of 1,000: no request waits, and
    # the bucket refills by at most one token per second of listing.
    budget = RequestBudget(RedisIndex.from_url(redis_url, "listbudget"), 1.0, 1000)
    key = f"s3://{bucket}/b/"
    s3.set_faults(FaultPlan(list_error_rate=0.4, seed=5))
    started = time.monotonic()
    manifest = list_source(key, s3.storage_options(), budget=budget)
    refilled = time.monotonic() - started + 1
    assert len(manifest) == 30
    tokens = float(redis.hget(budget.key(key), "tokens"))
    assert s3.list_errors > 0
    assert tokens <= 1000 - s3.lists + refilled  # every LIST request took a token
    assert budget.current_rate(key) < 1.0  # the 503s throttled the source


def test_listing_failed_halfway_is_never_published_and_next_attempt_lists_all(
    s3: Any, s3fs_client: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(objects, "LIST_PAGE_KEYS", 4)
    monkeypatch.setattr(objects, "LIST_RETRIES", 0)
    keys = [f"h/{d:02d}/{i}" for d in range(12) for i in range(9)]
    s3fs_client.pipe({f"{bucket}/{k}": b"v" for k in keys})
    listings = Listings(lambda ref: ref, list_in_thread(lambda value: value))
    spec = {
        "name": "half",
        "urls": f"s3://{bucket}/h/",
        "storage_options": s3.storage_options(),
    }
    s3.set_faults(FaultPlan(list_error_rate=0.08, error_status=500, seed=2))
    with pytest.raises(RemoteFetchError, match="listing"):
        asyncio.run(listings.publish(spec))
    assert s3.lists - s3.list_errors > 1  # pages were listed before it failed
    assert listings.published("half", "") is None
    s3.set_faults(FaultPlan())
    _, _, manifest = asyncio.run(listings.publish(spec))
    assert manifest.urls() == sorted(f"s3://{bucket}/{k}" for k in keys)


def _processes_titled(title: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(title.encode()):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_a_listing_whose_worker_is_killed_is_never_published_and_lists_again(
    ray_cluster: Any, s3: Any, s3fs_client: Any, bucket: str
) -> None:
    # The listing runs in a Ray task of its own (the store's RayLister);
    # killed halfway, nothing of it is published, the caller gets the
    # project's error, and the next request lists everything.
    import signal

    import ray

    from shardcache_server.listing import RayLister

    keys = [f"k/{i:03d}" for i in range(60)]
    s3fs_client.pipe({f"{bucket}/{k}": b"v" for k in keys})
    listings = Listings(
        lambda ref: ref, RayLister(ray.get_runtime_context().get_node_id())
    )
    spec = {
        "name": "killed",
        "urls": f"s3://{bucket}/k/",
        "storage_options": s3.storage_options(),
    }
    # 12 pages of 5 keys, 0.3 s each: the worker is found and killed mid-listing.
    s3.set_faults(FaultPlan(list_latency_s=0.3, list_page_keys=5))

    async def killed() -> None:
        listing = asyncio.ensure_future(listings.publish(spec))
        deadline = time.monotonic() + 60
        while not (pids := _processes_titled("ray::_list_task")):
            assert time.monotonic() < deadline and not listing.done()
            await asyncio.sleep(0.02)
        while s3.lists < 3:  # some pages listed
            await asyncio.sleep(0.02)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        await listing

    with pytest.raises(RemoteFetchError, match="stopped halfway"):
        asyncio.run(killed())
    assert 3 <= s3.lists < 12
    assert listings.published("killed", "") is None
    s3.set_faults(FaultPlan())
    _, _, manifest = asyncio.run(listings.publish(spec))
    assert manifest.urls() == [f"s3://{bucket}/{k}" for k in keys]


def test_store_listing_draws_on_the_source_rps_budget(
    s3: Any, s3fs_client: Any, bucket: str, redis_url: str, redis: Any
) -> None:
    from shardcache_server.budget import RequestBudget
    from shardcache_server.listing import list_with_layout, listing_budget
    from shardcache_server.settings import ServiceSettings

    s3fs_client.pipe({f"{bucket}/s/{i}": b"v" for i in range(3)})
    settings = ServiceSettings(
        redis_url=redis_url, namespace="lb", source_rps=1.0, source_burst=50
    )
    assert listing_budget(ServiceSettings(redis_url=redis_url)) is None
    url = f"s3://{bucket}/s/"
    spec = {"urls": url, "storage_options": s3.storage_options()}
    manifest = list_with_layout(spec, None, None, listing_budget(settings))
    assert len(manifest) == 3
    budget = RequestBudget(_index(redis_url, "lb"), 1.0, 50)
    assert float(redis.hget(budget.key(url), "tokens")) < 50  # the LIST took one


def _index(redis_url: str, namespace: str) -> Any:
    from shardcache.index import RedisIndex

    return RedisIndex.from_url(redis_url, namespace)


def test_emulator_synthetic_bucket_lists_computed_pages(s3: Any) -> None:
    # 20,001 keys in 3 sub-prefixes of 10,000: pages computed, nothing stored.
    manifest = list_source("s3://synthetic-20001/", s3.storage_options())
    assert len(manifest) == 20001
    assert manifest.url(0) == "s3://synthetic-20001/d00000/s000000000.bin"
    assert manifest.url(20000) == "s3://synthetic-20001/d00002/s000020000.bin"
    assert set(manifest.sizes.tolist()) == {100}
    assert s3.lists == 1 + 10 + 10 + 1  # the level, then pages of 1,000 keys


def test_list_source_s3_leaves_timestamps_unparsed_in_its_own_session_only(
    s3: Any, s3fs_client: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The listing's client skips botocore's per-key dateutil parse (most of
    # a listing's CPU); every other client of the process still parses.
    s3fs_client.pipe({f"{bucket}/ts/{i}": b"x" * (i + 1) for i in range(3)})
    sessions: list[Any] = []
    skip = objects._skip_timestamps
    monkeypatch.setattr(
        objects, "_skip_timestamps", lambda s: (sessions.append(s), skip(s))
    )
    manifest = list_source(f"s3://{bucket}/ts/", s3.storage_options())
    assert [manifest.size(i) for i in range(len(manifest))] == [1, 2, 3]
    (session,) = sessions
    factory = session.get_component("response_parser_factory")
    assert factory.create_parser("rest-xml")._timestamp_parser("2026-11-26") == (
        "2026-11-26"
    )
    s3fs_client.invalidate_cache()
    modified = s3fs_client.info(f"{bucket}/ts/0")["LastModified"]
    assert isinstance(modified, datetime.datetime)


def test_list_source_s3_fans_sub_prefix_groups_out_to_ray_tasks(
    ray_cluster: Any, s3: Any, s3fs_client: Any, bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # 30 sub-prefixes of different sizes, odd names, keys between them: the
    # groups listed by Ray tasks land where their keys sort, and the
    # manifest equals the one listed in this process, column for column.
    from shardcache_server.list_fanout import FanOut

    keys = [f"fan/{d:02d}{'é %' if d % 7 == 0 else ''}/{i:03d}"
            for d in range(30) for i in range(1 + d % 5)]  # fmt: skip
    keys += ["fan/00-top", "fan/15.bin", "fan/zz"]
    s3fs_client.pipe({f"{bucket}/{k}": k.encode() for k in keys})
    here = list_source(f"s3://{bucket}/fan/", s3.storage_options())

    fan = FanOut(s3.storage_options(), None, group=4)
    sent: list[list[str]] = []
    listed = fan.list

    async def counted(bucket_: str, subs: list[str], accept: Any, url: str) -> Any:
        sent.append(subs)
        return await listed(bucket_, subs, accept, url)

    monkeypatch.setattr(fan, "list", counted)
    spread = list_source(f"s3://{bucket}/fan/", s3.storage_options(), None, fan)
    assert spread.urls() == sorted(f"s3://{bucket}/{k}" for k in keys)
    for name, column in here.columns.items():
        assert (spread.columns[name] == column).all(), name
    # Every sub-prefix went out in a group of at most 4: none listed here.
    assert sorted(s for group in sent for s in group) == sorted(
        {k.rsplit("/", 1)[0] + "/" for k in keys if k.count("/") == 2}
    )
    assert max(len(g) for g in sent) == 4

    # As the stores list: inside a Ray task, which awaits its own tasks.
    import ray

    def in_task(url: str, options: dict[str, Any]) -> list[str]:
        from shardcache_server.list_fanout import FanOut
        from shardcache_server.objects import list_source

        return list_source(url, options, None, FanOut(options, None, 4)).urls()

    task = ray.remote(in_task).options(num_cpus=0)
    got = ray.get(task.remote(f"s3://{bucket}/fan/", s3.storage_options()))
    assert got == here.urls()


def test_fan_out_task_errors_reach_the_listing_as_the_projects_own(
    ray_cluster: Any, s3: Any,
) -> None:  # fmt: skip
    from shardcache.errors import SourceNotFound
    from shardcache_server.list_fanout import FanOut

    fan = FanOut(s3.storage_options(), None)
    with pytest.raises(SourceNotFound, match="no-such-bucket"):
        asyncio.run(
            fan.list(
                "no-such-bucket", ["x/"], lambda _p: True, "s3://no-such-bucket/x/"
            )
        )


def test_no_credentials_is_named_with_where_the_stores_find_them(
    s3: Any,
    s3fs_client: Any,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # A store on a Ray node that has no AWS variables, reading a dataset whose
    # script had them in its own environment: botocore finds nothing, and no
    # retry ever will. Said once, with where credentials must be.
    s3fs_client.pipe({f"{bucket}/nc/a.bin": b"x" * 8})
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no link-local probe
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    options = {"client_kwargs": {"endpoint_url": s3.endpoint_url}}
    with pytest.raises(RemoteFetchError, match="found no credentials") as listing:
        list_source(f"s3://{bucket}/nc/", options)
    assert "storage_options" in str(listing.value) and "Ray node" in str(listing.value)

    async def read() -> bytes:
        fetcher = Fetcher(
            "s3", options, concurrency=1, retries=4,
            backoff_s=0.01, backoff_max_s=0.1, timeout_s=10,
        )  # fmt: skip
        return await fetcher.fetch(f"s3://{bucket}/nc/a.bin", 8, "")

    with pytest.raises(RemoteFetchError, match="found no credentials") as fetch:
        asyncio.run(read())
    assert "attempts" not in str(fetch.value) and "throttling" not in str(fetch.value)

    # A packed file's ranged read: asked once, not once per retry.
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    calls = []
    real = fs._call_s3

    async def counted(method: str, *args: Any, **kw: Any) -> Any:
        calls.append(method)
        return await real(method, *args, **kw)

    monkeypatch.setattr(fs, "_call_s3", counted)
    with pytest.raises(RemoteFetchError, match="found no credentials") as ranged:
        read_ranges(
            fs, f"{bucket}/nc/a.bin", [(0, 8)],
            url=f"s3://{bucket}/nc/a.bin", etag="", size=8,
        )  # fmt: skip
    assert "attempts" not in str(ranged.value)
    assert calls == ["get_object"], calls


def test_local_ranges_never_take_the_source_budget(tmp_path: Path) -> None:
    # source_rps paces a remote source; a local packed file's ranged reads
    # never wait on it (nor on Redis).
    import fsspec

    class Counting:
        taken = 0

        def acquire_blocking(self, url: str) -> None:
            self.taken += 1

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(10)))
    fs = fsspec.filesystem("file")
    budget = Counting()
    etag = _version_of(fs, fs.info(str(path)))
    got = read_ranges(
        fs, str(path), [(2, 4)], url=f"file://{path}", etag=etag, size=10, budget=budget
    )
    assert got == {(2, 4): b"\x02\x03"} and budget.taken == 0

"""Jobs on the user's path: a new job sees today's data, every run is its own
job, its numbers reach the dashboard with no ``close()``, and jobs that
overlap read each object from the source once in all.

The script is the README's, started the way the README starts it: plain
``torchrun`` (run id ``none``), no ``job=``, no ``close()``, embedded
defaults; 240 small ``.npy`` objects in S3 (moto's server, GETs counted
there).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from shardcache.embedded import free_port
from shardcache.spec import default_name

OBJECTS = 240
CHANGED = range(0, OBJECTS, 24)  # 10 objects rewritten between the two jobs

TRAIN = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

url, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options)
loader = torch.utils.data.DataLoader(ds, batch_size=16, sampler=ds.sampler)
seen = {}
for epoch in range(3):
    ds.set_epoch(epoch)
    for batch in loader:
        for row in batch:
            seen[int(row[1])] = int(row[0])   # sample id -> its value
stats = ds.stats()
with open(f"{out}.{ds.rank}.json", "w") as f:
    json.dump({"seen": seen, "job": stats["job"], "hits": stats["hits"],
               "misses": stats["misses"]}, f)
"""

WORKERS = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

if __name__ == "__main__":
    url, options = sys.argv[1], json.loads(sys.argv[2])
    ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=16, sampler=ds.sampler, num_workers=2,
        multiprocessing_context="spawn")
    n = sum(len(batch) for batch in loader)
    print(json.dumps({"delivered": n}))
"""


STAGGERED = """
import io, json, sys, time
from pathlib import Path
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

url, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
pause_at = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None  # [epoch, step]
ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options,
                              chunk_samples=16)
loader = torch.utils.data.DataLoader(ds, batch_size=16, sampler=ds.sampler)
seen = {}
for epoch in range(3):
    ds.set_epoch(epoch)
    for step, batch in enumerate(loader):
        for row in batch:
            seen.setdefault(int(row[1]), []).append(int(row[0]))
        if [epoch, step] == pause_at:  # mid-epoch: the test starts other jobs
            Path(f"{out}.{ds.rank}.paused").touch()
            while not Path(f"{out}.go").exists():
                time.sleep(0.05)
stats = ds.stats()
with open(f"{out}.{ds.rank}.json", "w") as f:
    json.dump({"seen": seen, "hits": stats["hits"], "misses": stats["misses"]}, f)
"""


STRAGGLER = """
import io, json, sys, time
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

url, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options)
loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=ds.sampler)
for epoch in range(2):
    ds.set_epoch(epoch)
    if ds.rank == 1 and epoch == 0:
        time.sleep(5)  # a slow rank: rank 0 builds the chunk their shards share
    for batch in loader:
        pass
stats = ds.stats()
with open(f"{out}.{ds.rank}.json", "w") as f:
    json.dump({"job": stats["job"], "hits": stats["hits"],
               "misses": stats["misses"]}, f)
"""


WORKERS_STRAGGLER = """
import io, json, sys, time
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

if __name__ == "__main__":
    url, options = sys.argv[1], json.loads(sys.argv[2])
    ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, sampler=ds.sampler, num_workers=2,
        multiprocessing_context="spawn", persistent_workers=True)
    n = 0
    for epoch in range(2):
        ds.set_epoch(epoch)
        if ds.rank == 1 and epoch == 0:
            time.sleep(5)  # a slow rank: rank 0's workers build the chunk
        n += sum(len(batch) for batch in loader)
    # This process read nothing (its workers did): every origin, at 0.
    print(json.dumps({"delivered": n, "here": ds.stats()["served"]["source"]}))
"""


def _put(fs, bucket: str, i: int, value: int) -> None:
    buf = __import__("io").BytesIO()
    np.save(buf, np.array([value, i], np.int64))
    fs.pipe(f"{bucket}/train/{i:04d}.npy", buf.getvalue())


def _redis_url(home: Path) -> str:
    return json.loads((home / ".cache" / "shardcache" / "redis.json").read_text())[
        "url"
    ]


def _metrics(user, redis_url: str) -> str:
    """The dashboard's /metrics, from the real dashboard process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardcache_server.cli", "dashboard",
         "--redis-url", redis_url, "--port", str(port)],
        env=user.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                    return r.read().decode()
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def _job_rows(text: str) -> set[str]:
    return set(re.findall(r'shardcache_job_samples_total\{[^}]*job="([^"]+)"', text))


def _run_job(user, script, url, options, out, env=None):
    done = user.torchrun(script, url, json.dumps(options), str(out), env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]


def test_a_new_job_reads_changed_objects_and_reports_without_close(
    user, s3, s3fs_client, bucket
):
    for i in range(OBJECTS):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("train.py", TRAIN)

    first = _run_job(user, script, url, options, user.workdir / "first")
    assert s3.total_gets == OBJECTS  # each object once, 3 epochs x 2 ranks
    assert sorted(int(k) for r in first for k in r["seen"]) == list(range(OBJECTS))
    assert all(r["misses"] == OBJECTS // 2 and r["hits"] == OBJECTS for r in first)
    assert first[0]["job"] == first[1]["job"] and first[0]["job"] != "none"

    redis_url = _redis_url(user.home)
    name_of = default_name(url)
    metrics = _metrics(user, redis_url)
    assert _metric(metrics, "shardcache_hit_rate", dataset=name_of) == (
        sum(r["hits"] for r in first) / (OBJECTS * 3)
    )

    # Rewrite 10 objects at the source; start the same script again.
    for i in CHANGED:
        _put(s3fs_client, bucket, i, 1000 + i)
    s3.reset_counts()
    second = _run_job(user, script, url, options, user.workdir / "second")
    seen = {int(k): v for r in second for k, v in r["seen"].items()}
    assert sorted(seen) == list(range(OBJECTS))
    assert {i for i, v in seen.items() if v != i} == set(CHANGED)
    assert all(seen[i] == 1000 + i for i in CHANGED)
    fetched = {k for k, n in s3.gets.items() if n}
    assert s3.total_gets == len(CHANGED), sorted(fetched)
    assert second[0]["job"] == second[1]["job"] != first[0]["job"]
    # The ranks' own count: a miss is a sample read from the source, so the
    # 230 rows copied from the old chunk on its node are hits.
    assert sum(r["misses"] for r in second) == len(CHANGED)

    metrics = _metrics(user, redis_url)
    assert {first[0]["job"], second[0]["job"]} <= _job_rows(metrics)
    assert _metric(
        metrics, "shardcache_samples_total", dataset=name_of, origin="source"
    ) == OBJECTS + len(CHANGED)


def test_dataloader_workers_report_every_sample_without_close(
    user, s3, s3fs_client, bucket
):
    for i in range(300):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("workers.py", WORKERS)
    done = user.python(str(script), url, json.dumps(options))
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"delivered": 300}
    name = default_name(url)
    time.sleep(1.0)  # one flush interval after the script's exit
    metrics = _metrics(user, _redis_url(user.home))
    total = sum(
        _metric(metrics, "shardcache_samples_total", dataset=name, origin=o)
        for o in ("local", "peer", "source")
    )
    assert total == 300


RESUME = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset
from shardcache.errors import ConfigError

def load_npy(data):
    return np.load(io.BytesIO(data))

url, options, state_dir, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options,
                              revalidate=sys.argv[5] if len(sys.argv) > 5 else "job")
path = f"{state_dir}/rank{ds.rank}.pt"
ds.set_epoch(0)
if mode == "save":
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler)
    for step, batch in enumerate(loader):
        if step == 2:
            break
    torch.save(ds.state_dict(consumed=3 * 8), path)
    print(json.dumps({"ok": True}))
else:
    try:
        ds.load_state_dict(torch.load(path))
    except ConfigError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(0)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler)
    n = sum(len(b) for b in loader)
    print(json.dumps({"rest": n}))
"""


def _lines(done):
    assert done.returncode == 0, done.stderr[-4000:]
    # Two ranks print at once: a line may hold both ranks' objects.
    return [json.loads(x) for x in re.findall(r"\{[^{}\n]*\}", done.stdout)]


def test_a_resume_across_jobs_survives_revalidation_and_names_what_changed(
    user, s3, s3fs_client, bucket
):
    for i in range(128):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("resume.py", RESUME)
    state = user.workdir / "state"
    state.mkdir()
    args = (url, json.dumps(options), str(state))
    assert _lines(user.torchrun(script, *args, "save")) == [{"ok": True}] * 2
    # A new job, nothing changed: the revalidated listing is the same one, and
    # each rank reads the 64 - 24 samples of its share it had not consumed.
    assert _lines(user.torchrun(script, *args, "load")) == [{"rest": 40}] * 2
    # One object rewritten: the error names it, not a digest.
    _put(s3fs_client, bucket, 7, 700)
    out = _lines(user.torchrun(script, *args, "load"))
    assert all("error" in r for r in out), out
    assert all(f"s3://{bucket}/train/0007.npy" in r["error"] for r in out), out
    assert all("1 object changed" in r["error"] for r in out)


OPEN = """
import io, json, sys
import numpy as np
from shardcache import DistributedCachedDataset
from shardcache.errors import ShardCacheError

def load_npy(data):
    return np.load(io.BytesIO(data))

url, options, revalidate = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
try:
    ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options,
                                  revalidate=revalidate)
except ShardCacheError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    sys.exit(0)
print(json.dumps({"n": len(ds), "first": int(ds[0][0])}))
"""


def test_a_job_that_cannot_revalidate_stops_unless_it_opted_out(
    user, s3, s3fs_client, bucket
):
    for i in range(16):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("open.py", OPEN)
    assert _lines(user.python(str(script), url, json.dumps(options), "job")) == [
        {"n": 16, "first": 0}
    ]
    # The source is unreachable now (nothing listens there).
    down = {
        **options,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    [failed] = _lines(user.python(str(script), url, json.dumps(down), "job"))
    assert failed["error"] in ("RemoteFetchError", "SourceNotFound"), failed
    assert url in failed["message"] and "revalidate='never'" in failed["message"]
    # Opted out: the job starts on the listing the cluster holds, from the cache.
    assert _lines(user.python(str(script), url, json.dumps(down), "never")) == [
        {"n": 16, "first": 0}
    ]


def _wait_for(paths: list[Path], jobs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 300  # the first job starts the Ray head
    while not all(p.exists() for p in paths):
        assert all(j.poll() in (None, 0) for j in jobs), [j.args for j in jobs]
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.1)


def test_staggered_jobs_read_each_object_once_and_later_jobs_start_from_the_cache(
    user, s3, s3fs_client, bucket
):
    """Three jobs on one dataset, each started while the earlier ones are
    mid-epoch: every object is read from S3 once in all, and the job that
    starts once the data is cached reads its first epoch from the cache."""
    for i in range(OBJECTS):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", json.dumps(s3.storage_options())
    script = user.write("staggered.py", STAGGERED)
    out = {name: user.workdir / name for name in ("a", "b", "c")}

    def start(name: str, *pause: str) -> subprocess.Popen[bytes]:
        log = user.workdir / f"{name}.log"
        return user.start_torchrun(
            script, url, options, str(out[name]), *pause, log=log
        )

    # A pauses in its first epoch, after 3 of its 8 batches per rank.
    a = start("a", "[0, 2]")
    _wait_for([Path(f"{out['a']}.{r}.paused") for r in (0, 1)], [a])
    # B starts while A is mid-epoch: it reads its first epoch (the chunks A
    # has not read yet among them) and pauses in its second.
    b = start("b", "[1, 2]")
    _wait_for([Path(f"{out['b']}.{r}.paused") for r in (0, 1)], [a, b])
    # C starts while both are mid-epoch and runs to its end.
    c = start("c")
    assert c.wait(timeout=300) == 0, (user.workdir / "c.log").read_text()[-4000:]
    for name in ("a", "b"):
        Path(f"{out[name]}.go").touch()
    for name, job in (("a", a), ("b", b)):
        assert job.wait(timeout=300) == 0, (user.workdir / f"{name}.log").read_text()[
            -4000:
        ]

    assert s3.total_gets == OBJECTS  # three jobs, counted at the S3 server
    assert set(s3.gets.values()) == {1}
    for name in out:
        ranks = [json.loads(Path(f"{out[name]}.{r}.json").read_text()) for r in (0, 1)]
        seen: dict[int, list[int]] = {}
        for r in ranks:
            for k, values in r["seen"].items():
                seen.setdefault(int(k), []).extend(values)
        # Every sample, three epochs, its own value.
        assert seen == {i: [i] * 3 for i in range(OBJECTS)}, name
        if name == "c":  # its first epoch came from the cache
            assert [r["misses"] for r in ranks] == [0, 0]
            assert sum(r["hits"] for r in ranks) == 3 * OBJECTS


def test_a_chunk_split_between_ranks_counts_its_reads_once_for_its_job(
    user, s3, s3fs_client, bucket
):
    """16 objects are one chunk, its rows split between the two ranks. Rank 1
    asks for its half after rank 0's request built it: both halves were read
    from the source in this epoch, so both ranks count them as source reads
    (rank 1 counted its half as hits before: "50% hit rate" on a cold epoch).
    A second job reads the chunk the first one built: hits only."""
    for i in range(16):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("straggler.py", STRAGGLER)

    first = _run_job(user, script, url, options, user.workdir / "first")
    assert s3.total_gets == 16
    assert [r["misses"] for r in first] == [8, 8]  # epoch 0: every row a GET
    assert [r["hits"] for r in first] == [8, 8]  # epoch 1: held
    metrics = _metrics(user, _redis_url(user.home))
    name = default_name(url)
    assert (
        _metric(metrics, "shardcache_samples_total", dataset=name, origin="source")
        == 16
    )

    s3.reset_counts()
    second = _run_job(user, script, url, options, user.workdir / "second")
    assert s3.total_gets == 0
    assert [(r["misses"], r["hits"]) for r in second] == [(0, 16), (0, 16)]
    assert second[0]["job"] != first[0]["job"]


def test_a_job_name_given_to_every_run_never_counts_the_last_runs_reads(
    user, s3, s3fs_client, bucket
):
    """``SHARDCACHE_JOB=nightly`` on every run: the second run's epoch 0
    reads the chunk the first run built, and counts hits. A name a later run
    may carry too names no reading, so a rank reading after another's build
    counts hits, as the docs say (rank 1: 0 misses in the first run)."""
    for i in range(16):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("straggler.py", STRAGGLER)
    named = {"SHARDCACHE_JOB": f"nightly-{bucket}"}

    first = _run_job(user, script, url, options, user.workdir / "a", env=named)
    assert s3.total_gets == 16 and first[0]["job"] == named["SHARDCACHE_JOB"]
    assert [r["misses"] for r in first] == [8, 0]
    second = _run_job(user, script, url, options, user.workdir / "b", env=named)
    assert s3.total_gets == 16
    assert [(r["misses"], r["hits"]) for r in second] == [(0, 16), (0, 16)]


def test_dataloader_workers_count_each_source_read_once_over_persistent_epochs(
    user, s3, s3fs_client, bucket
):
    """The README's spawned workers, persistent, on a slow rank: the workers
    of rank 1 read their half of the chunk rank 0's workers built, in the
    same epoch (source reads), then a second epoch from the cache (hits,
    though a persistent worker's own sampler still says epoch 0)."""
    for i in range(16):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("workers_straggler.py", WORKERS_STRAGGLER)
    done = user.torchrun(script, url, json.dumps(options))
    assert done.returncode == 0, done.stderr[-4000:]
    assert _lines(done) == [{"delivered": 16, "here": 0}] * 2  # 8 an epoch
    assert s3.total_gets == 16
    time.sleep(1.0)  # one flush interval after the script's exit
    metrics = _metrics(user, _redis_url(user.home))
    name = default_name(url)
    served = {
        o: _metric(metrics, "shardcache_samples_total", dataset=name, origin=o)
        for o in ("local", "peer", "source")
    }
    assert served == {"local": 16, "peer": 0, "source": 16}

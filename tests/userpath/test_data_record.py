"""The run's data record on the user's path: what a job read, and a resume
after the source changed.

A job saves its state mid-epoch, two objects are rewritten at the source,
and the same script resumes in a new job (which re-lists the source) with
each ``on_change``: ``"error"`` names the two objects; ``"new_listing"``
delivers every sample the saved epoch had not, once, the rewritten ones at
their new version. The job's record (listing digest and generation) is what
the ranks saw, in ``shardcache stats --job`` and the dashboard's JSON.
Scripts run under ``python -m torch.distributed.run``, no ``job=``, no
``close()``.
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

OBJECTS = 128
BATCH = 8
SAVED_STEPS = 3  # batches each rank consumed before the save

SCRIPT = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset
from shardcache.errors import ConfigError

def load_npy(data):
    return np.load(io.BytesIO(data))

url, options, state_dir, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options)
path = f"{state_dir}/rank{ds.rank}.pt"
ds.set_epoch(0)
loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler)
seen = {}
if mode == "save":
    for step, batch in enumerate(loader):
        seen.update({int(r[1]): int(r[0]) for r in batch})
        if step == 2:
            break
    state = ds.state_dict(consumed=3 * 8)
    torch.save(state, path)
else:
    try:
        ds.load_state_dict(torch.load(path), on_change=mode)
    except ConfigError as exc:
        print(json.dumps({"rank": ds.rank, "error": str(exc)}))
        sys.exit(0)
    for batch in loader:
        seen.update({int(r[1]): int(r[0]) for r in batch})
    state = ds.state_dict()
stats = ds.stats()
print(json.dumps({"rank": ds.rank, "seen": seen, "job": ds.job,
                  "listing": state["manifest"], "generation": state["generation"],
                  "stats_listing": stats["listing"],
                  "across": stats["resumed_across_change"] is not None}))
"""


def _put(fs, bucket: str, i: int, value: int) -> None:
    buf = __import__("io").BytesIO()
    np.save(buf, np.array([value, i], np.int64))
    fs.pipe(f"{bucket}/train/{i:04d}.npy", buf.getvalue())


def _ranks(done) -> list[dict]:
    assert done.returncode == 0, done.stderr[-4000:]
    # Two ranks print at once: split on the objects, not on lines.
    found = [json.loads(x) for x in re.findall(r'\{"rank".*?\}(?=\{"rank"|\n|$)',
                                               done.stdout)]  # fmt: skip
    return sorted(found, key=lambda r: r["rank"])


def _redis_url(home: Path) -> str:
    path = home / ".cache" / "shardcache" / "redis.json"
    return json.loads(path.read_text())["url"]


def _dashboard_json(user, redis_url: str, name: str) -> dict:
    """Dataset ``name`` of ``/api/overview``, from the real dashboard process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardcache_server.cli", "dashboard",
         "--redis-url", redis_url, "--port", str(port)],
        env=user.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/api/overview"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url) as r:
                    page = json.loads(r.read().decode())
                return next(d for d in page["datasets"] if d["name"] == name)
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_resume_after_the_source_changed_follows_on_change_and_is_recorded(
    user, s3, s3fs_client, bucket
):
    for i in range(OBJECTS):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("train.py", SCRIPT)
    state = user.workdir / "state"
    state.mkdir()
    args = (url, json.dumps(options), str(state))

    saved = _ranks(user.torchrun(script, *args, "save"))
    assert len(saved) == 2 and all(len(r["seen"]) == SAVED_STEPS * BATCH for r in saved)
    delivered = {int(k) for r in saved for k in r["seen"]}
    old_listing = saved[0]["listing"]
    assert saved[1]["listing"] == old_listing == saved[0]["stats_listing"]

    # Rewrite one object the save delivered and one it had not.
    changed = (min(delivered), min(set(range(OBJECTS)) - delivered))
    for i in changed:
        _put(s3fs_client, bucket, i, 1000 + i)

    # "error" (the default's behaviour): refused, both objects named.
    refused = _ranks(user.torchrun(script, *args, "error"))
    assert len(refused) == 2
    for r in refused:
        assert "2 objects changed" in r["error"], r
        assert all(f"s3://{bucket}/train/{i:04d}.npy" in r["error"] for i in changed)
        assert "on_change='new_listing'" in r["error"]

    # "new_listing": the rest of the saved epoch on today's listing.
    resumed = _ranks(user.torchrun(script, *args, "new_listing"))
    rest = {int(k): v for r in resumed for k, v in r["seen"].items()}
    assert len(rest) == sum(len(r["seen"]) for r in resumed)  # none twice
    assert sorted(delivered | set(rest)) == list(range(OBJECTS))  # all of it
    assert not delivered & set(rest)  # nothing the save delivered again
    assert changed[1] in rest and changed[0] not in rest
    for i in rest:  # changed objects not yet delivered: their new version
        assert rest[i] == (1000 + i if i in changed else i)
    new_listing = resumed[0]["listing"]
    assert new_listing != old_listing and resumed[1]["listing"] == new_listing
    assert all(r["across"] for r in resumed)
    generation = resumed[0]["generation"]
    job = resumed[0]["job"]
    assert resumed[1]["job"] == job != saved[0]["job"]

    # The job's record, as a user reads it: the CLI and the dashboard.
    redis_url = _redis_url(user.home)
    name = default_name(url)
    time.sleep(1.0)  # one flush interval after the script's exit
    cli = user.shardcache("stats", name, "--job", job, "--redis-url", redis_url)
    assert cli.returncode == 0, cli.stderr
    assert f"{name} job {job}: listing {new_listing}, generation {generation}" in (
        cli.stdout
    ), cli.stdout
    first = user.shardcache("stats", "--job", saved[0]["job"], "--redis-url", redis_url)
    assert f"job {saved[0]['job']}: listing {old_listing}," in first.stdout
    unknown = user.shardcache("stats", "--job", "no-such-job", "--redis-url", redis_url)
    assert unknown.returncode == 2 and "no-such-job" in unknown.stderr

    page = _dashboard_json(user, redis_url, name)
    jobs = {j["job"]: j for j in page["jobs"]}
    assert jobs[job]["listing"] == new_listing
    assert jobs[job]["generation"] == generation
    assert jobs[saved[0]["job"]]["listing"] == old_listing

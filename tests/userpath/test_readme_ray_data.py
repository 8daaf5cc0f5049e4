"""The README's Ray Data block, run as written: saved under the name its first
line gives and started with the command it names, twice, on a user's machine
(embedded Redis and Ray head, the bucket in the session's S3 emulator), after
the README's quick start ran under torchrun, as a user who reads the README
in order runs them: that torchrun job starts the Redis and Ray head the Ray
Data job then joins."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import redis as redis_py
from test_readme import quickstart

from shardcache.spec import default_name
from shardcache.usage import UsageReader
from shardcache_server.datagen import make_image

README = Path(__file__).resolve().parents[2] / "README.md"
BUCKET = "my-bucket"
IMAGES = 24


def ray_data_block() -> tuple[str, str, list[str]]:
    """The block's file name, its code and the command on its first line."""
    block = re.search(
        r"```python\n(# (ray_\w+\.py) -- run with:.*?)```", README.read_text(), re.S
    )
    assert block, "README.md lost its Ray Data example"
    code = block.group(1)
    command = code.splitlines()[0].split("run with:", 1)[1].strip()
    return block.group(2), code, shlex.split(command)


def test_readme_ray_data_runs_as_written_and_a_second_run_reads_no_object(
    user, s3, s3fs_client
):
    if s3fs_client.exists(BUCKET):
        s3fs_client.rm(BUCKET, recursive=True)
    s3fs_client.mkdir(BUCKET)
    s3fs_client.pipe(
        {f"{BUCKET}/train/{i:03d}.png": make_image(i, 8, "PNG") for i in range(IMAGES)}
    )
    name, code, command = ray_data_block()
    assert command == ["python", name]
    user.write(name, code)
    env = {"AWS_ENDPOINT_URL": s3.storage_options()["client_kwargs"]["endpoint_url"]}
    # The quick start first, under torchrun: it starts the background services
    # from a rank's environment (TORCHELASTIC_*, RANK, MASTER_*), which the
    # Ray head must not keep, or the TorchTrainer below hangs in its
    # rendezvous (its workers would think an agent hosts the store).
    train, _ = quickstart()
    user.write("train.py", train)
    s3.reset_counts()
    first = user.torchrun("train.py", env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    assert s3.total_gets == IMAGES

    done = user.python(name, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    # The same objects and preprocess as the quick start: every block from
    # the chunks that torchrun job cached, none read again.
    assert s3.total_gets == IMAGES
    s3.reset_counts()
    again = user.python(name, env=env)
    assert again.returncode == 0, again.stderr[-4000:]
    assert s3.total_gets == 0  # a second job: every block from the cache

    url = json.loads((user.home / ".cache/shardcache/redis.json").read_text())["url"]
    usage = UsageReader(redis_py.Redis.from_url(url, decode_responses=True))
    jobs = usage.jobs(default_name(f"s3://{BUCKET}/train/"))
    assert len(jobs) == 3  # the quick start and two Ray Data runs: three jobs
    assert sorted(t.samples_source for t in jobs.values()) == [0, 0, IMAGES]
    assert all(t.samples >= 3 * IMAGES for t in jobs.values())  # 3 epochs each
    # Every job's record names the listing and generation it read, the Ray
    # Data jobs' as the torchrun job's (the README: "for every job").
    reads = usage.job_reads(default_name(f"s3://{BUCKET}/train/"), list(jobs))
    assert len({r.listing for r in reads.values()}) == 1, reads
    assert all(r.listing and r.generation for r in reads.values()), reads
    s3fs_client.rm(BUCKET, recursive=True)

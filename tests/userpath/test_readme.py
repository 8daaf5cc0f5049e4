"""The README's quick start, run as written: the code block is read from
README.md, saved as ``train.py`` and started with the command its first
line names. The only things the test supplies are what a user's machine
has: a bucket called ``my-bucket`` (moto's server, through
``AWS_ENDPOINT_URL``) and a HOME where the demo ran once.
"""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path

import numpy as np
import redis as redis_py
from PIL import Image

from shardcache.embedded import free_port
from shardcache.spec import default_name
from shardcache.usage import UsageReader

README = Path(__file__).resolve().parents[2] / "README.md"
BUCKET = "my-bucket"
IMAGES = 64


def readme_script(filename: str) -> tuple[str, list[str]]:
    """The README's example saved as ``filename`` (its first line says so)
    and the command that line names."""
    pattern = rf"```python\n(# {re.escape(filename)} -- .*?)```"
    block = re.search(pattern, README.read_text(), re.S)
    assert block, f"README.md lost its {filename} example"
    code = block.group(1)
    command = code.splitlines()[0].split("run with:", 1)[1].strip()
    return code, shlex.split(command)


def quickstart() -> tuple[str, list[str]]:
    """The quick start's code and the command on its first line."""
    return readme_script("train.py")


def fresh_bucket(s3fs_client, name: str) -> None:
    """An empty bucket called ``name`` (a README names its buckets)."""
    if s3fs_client.exists(name):
        s3fs_client.rm(name, recursive=True)
    s3fs_client.mkdir(name)


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_readme_quickstart_runs_as_written_and_reads_each_object_once(
    user, s3, s3fs_client
):
    fresh_bucket(s3fs_client, BUCKET)
    for i in range(IMAGES):
        s3fs_client.pipe(f"{BUCKET}/train/{i:03d}.png", _png(i))
    code, command = quickstart()
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    user.write("train.py", code)
    env = {"AWS_ENDPOINT_URL": s3.storage_options()["client_kwargs"]["endpoint_url"]}

    s3.reset_counts()
    done = user.python(*command[1:], env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr and "InvalidAuthToken" not in done.stderr
    assert s3.total_gets == IMAGES  # epochs 2 and 3 read no S3 object

    # A second run after two images changed: a job of its own that reads
    # exactly those two.
    for i in (5, 40):
        s3fs_client.pipe(f"{BUCKET}/train/{i:03d}.png", _png(200 + i))
    s3.reset_counts()
    again = user.python(*command[1:], env=env)
    assert again.returncode == 0, again.stderr[-4000:]
    assert s3.total_gets == 2

    url = json.loads((user.home / ".cache/shardcache/redis.json").read_text())["url"]
    usage = UsageReader(redis_py.Redis.from_url(url, decode_responses=True))
    name = default_name(f"s3://{BUCKET}/train/")
    jobs = usage.jobs(name)
    assert len(jobs) == 2  # two runs, two jobs on the dashboard
    assert sorted(t.samples for t in jobs.values()) == [3 * IMAGES, 3 * IMAGES]
    assert sorted(t.samples_source for t in jobs.values()) == [2, IMAGES]

    # A third run after one image was added in the middle and one removed:
    # it reads the new one only, though every row after it moved.
    s3fs_client.pipe(f"{BUCKET}/train/007b.png", _png(250))
    s3fs_client.rm(f"{BUCKET}/train/030.png")
    s3.reset_counts()
    third = user.python(*command[1:], env=env)
    assert third.returncode == 0, third.stderr[-4000:]
    assert s3.total_gets == 1
    s3fs_client.rm(BUCKET, recursive=True)


def test_readme_quickstart_after_a_run_with_a_wrong_redis_url(
    fresh_user, s3, s3fs_client
):
    """A user who once runs the README's script with a ``redis_url`` where
    nothing listens gets that Redis named (its password redacted), and the
    script run next without it works: nothing the wrong run started is
    reused. Over S3 (the rank lists) and then a local folder (the stores
    list), starting from a cold Ray head: the stores a wrong run started
    must never be reused without an index."""
    user = fresh_user  # the first wrong run starts Ray and the stores
    bucket = "wrong-redis-bucket"
    fresh_bucket(s3fs_client, bucket)
    folder = user.workdir / "images"
    folder.mkdir()
    for i in range(16):
        s3fs_client.pipe(f"{bucket}/train/{i:03d}.png", _png(i))
        (folder / f"{i:03d}.png").write_bytes(_png(i))
    code, command = quickstart()
    env = {"AWS_ENDPOINT_URL": s3.storage_options()["client_kwargs"]["endpoint_url"]}
    for source in (f"s3://{bucket}/train/", f"{folder}/"):
        script = code.replace("s3://my-bucket/train/", source)
        port = free_port()
        wrong = script.replace(
            "preprocess=decode_image_chw)",
            "preprocess=decode_image_chw, "
            f'redis_url="redis://:hunter2@127.0.0.1:{port}/0")',
        )
        assert wrong != script, "the quick start's call no longer ends as expected"

        user.write("train.py", wrong)
        failed = user.python(*command[1:], env=env)
        assert failed.returncode != 0
        # What the project says (the exception's line), not the script's
        # own source line that Python's traceback quotes.
        said = [ln for ln in failed.stderr.splitlines() if "IndexUnavailable:" in ln]
        assert said, failed.stderr[-4000:]
        assert all(f"127.0.0.1:{port}" in ln and "hunter2" not in ln for ln in said)

        user.write("train.py", script)
        s3.reset_counts()
        done = user.python(*command[1:], env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        assert "Traceback" not in done.stderr
        assert s3.total_gets == (16 if source.startswith("s3://") else 0)
    s3fs_client.rm(bucket, recursive=True)

"""The README's quick start over a dataset larger than the stores' memory,
with the disk tier its prose names: ``SHARDCACHE_DISK_DIR`` set before the
first script, the quick start's ``train.py`` as written under plain
torchrun (no ``job=``, no ``close()``), embedded defaults otherwise.

Run with the default hold and with ``SHARDCACHE_HOLD_BYTES=0``, which puts
the ranks where an ImageNet-sized shard puts them under the default 2 GiB
hold: they may keep no chunk from memory, so warm epochs read what memory
cannot hold from the node's chunk files. Either way epochs 2 and 3 read no
S3 object, and the dashboard's totals say how much came from the disk tier
(none of it counted as a source read). A later script whose environment asks the
running stores for other settings is told that they keep theirs.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import redis as redis_py
from PIL import Image
from test_readme import BUCKET, fresh_bucket, quickstart

from shardcache.spec import default_name
from shardcache.usage import UsageReader

IMAGES = 160
SIDE = 256  # noise PNGs of ~193 KiB: 160 are ~31 MiB of source, 2 chunks
# decode_image_chw gives float32: each chunk is ~60 MiB decoded, three times
# this budget, so memory can hold neither and only the disk tier keeps them.
BUDGET = 20 * 2**20


def _noise_png(i: int) -> bytes:
    pixels = np.random.default_rng(i).integers(0, 256, (SIDE, SIDE, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("hold", [None, "0"], ids=["default-hold", "hold-0"])
def test_quickstart_larger_than_memory_reads_warm_epochs_from_the_disk_tier(
    fresh_user, s3, s3fs_client, tmp_path, hold
):
    # A HOME of its own: the stores must start with this budget and disk tier.
    user = fresh_user
    fresh_bucket(s3fs_client, BUCKET)
    s3fs_client.pipe(
        {f"{BUCKET}/train/{i:03d}.png": _noise_png(i) for i in range(IMAGES)}
    )
    code, command = quickstart()
    user.write("train.py", code)
    env = {
        "AWS_ENDPOINT_URL": s3.storage_options()["client_kwargs"]["endpoint_url"],
        "SHARDCACHE_DISK_DIR": str(tmp_path / "disk"),
        "SHARDCACHE_CACHE_BYTES": str(BUDGET),
        **({"SHARDCACHE_HOLD_BYTES": hold} if hold is not None else {}),
    }
    s3.reset_counts()
    done = user.python(*command[1:], env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr
    # Memory held no chunk, yet epochs 2 and 3 read no S3 object.
    assert s3.total_gets == IMAGES
    assert "shuffle_block" not in done.stderr  # nothing rebuilt: no advice

    url = json.loads((user.home / ".cache/shardcache/redis.json").read_text())["url"]
    usage = UsageReader(redis_py.Redis.from_url(url, decode_responses=True))
    (totals,) = usage.jobs(default_name(f"s3://{BUCKET}/train/")).values()
    assert totals.samples == 3 * IMAGES
    assert totals.samples_source == IMAGES
    # The warm epochs' samples came from the chunk files, not the source.
    assert totals.samples_disk > 0
    assert totals.samples_disk + totals.samples_local == 2 * IMAGES
    assert "started with" not in done.stderr  # the stores took this environment

    # A running store keeps its settings: a later script asking for another
    # disk tier is told so, and what to run, instead of being ignored.
    again = user.python(*command[1:], env={**env, "SHARDCACHE_DISK_DIR": "/elsewhere"})
    assert again.returncode == 0, again.stderr[-4000:]
    assert s3.total_gets == IMAGES
    assert f"disk_dir='{tmp_path / 'disk'}'" in again.stderr
    assert "SHARDCACHE_DISK_DIR='/elsewhere'" in again.stderr
    assert again.stderr.count("shardcache local stop") == 1  # once per node
    assert "SHARDCACHE_CACHE_BYTES" not in again.stderr  # only what differs
    s3fs_client.rm(BUCKET, recursive=True)

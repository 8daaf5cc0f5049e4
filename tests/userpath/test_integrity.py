"""Issue 26 on the user's path: nothing a user does silently resets the cache,
one URL has one reading, and an unpicklable preprocess fails at construction.

Scripts run as ``python script.py`` under a fresh HOME (``user`` fixture),
on the embedded defaults, reading the session's S3 emulator.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

pytestmark = [pytest.mark.slow]

OBJECTS = 12

JOB = """
import numpy as np
from shardcache import DistributedCachedDataset

class Scale:  # a plain object the preprocess closes over: its repr holds an address
    def __init__(self, factor):
        self.factor = factor

def make(scale):
    def preprocess(raw):
        return np.frombuffer(raw, np.uint8).astype(np.float32) * scale.factor
    return preprocess

ds = DistributedCachedDataset(
    {url!r}, make(Scale(2.0)), storage_options={options!r}, name="closure",
    shuffle=False, rank=0, world_size=1,
)
total = sum(float(ds[i][0]) for i in range(len(ds)))
print("generation", ds.generation, "samples", len(ds), "total", total)
"""


def _objects(s3fs_client, bucket: str, prefix: str = "d") -> str:
    s3fs_client.pipe(
        {f"{bucket}/{prefix}/{i:03d}.bin": bytes([i]) * 64 for i in range(OBJECTS)}
    )
    return f"s3://{bucket}/{prefix}/"


def _gets(s3, run) -> tuple[int, str]:
    before = s3.total_gets
    done = run()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return s3.total_gets - before, done.stdout + done.stderr


def test_integrity_closure_preprocess_hits_cache_across_runs_and_changes_are_logged(
    user, s3, s3fs_client, bucket
):
    url = _objects(s3fs_client, bucket)
    source = JOB.format(url=url, options=s3.storage_options())
    script = user.write("train.py", source)
    gets, out = _gets(s3, lambda: user.python(str(script)))
    assert gets == OBJECTS and "generation 1 " in out
    # The same script again, in a new process: every sample from the cache.
    gets, out = _gets(s3, lambda: user.python(str(script)))
    assert gets == 0 and "generation 1 " in out, out
    # A renamed parameter and a comment change no behaviour: nothing resets.
    renamed = source.replace(
        "def preprocess(raw):", "def preprocess(data):  # the object's bytes"
    ).replace("frombuffer(raw", "frombuffer(data")
    user.write("train.py", renamed)
    gets, out = _gets(s3, lambda: user.python(str(script)))
    assert gets == 0 and "generation 1 " in out and "cache generation" not in out, out
    # A changed factor does: one warning line says what, and what is re-read.
    user.write("train.py", source.replace("Scale(2.0)", "Scale(3.0)"))
    gets, out = _gets(s3, lambda: user.python(str(script)))
    assert gets == OBJECTS and "generation 2 " in out
    lines = [ln for ln in out.splitlines() if "cache generation 1 -> 2" in ln]
    assert len(lines) == 1, out
    assert "preprocess" in lines[0] and f"all {OBJECTS} objects" in lines[0]


def test_integrity_warm_then_job_reads_nothing_and_warm_never_resets(
    user, s3, s3fs_client, bucket
):
    url = _objects(s3fs_client, bucket, "w")
    s3o = [
        "--endpoint-url",
        s3.endpoint_url,
        "-o",
        "key=testing",
        "-o",
        "secret=testing",
    ]
    warm = user.shardcache("warm", url, "--name", "warmed", *s3o)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    job = user.write(
        "job.py",
        f"""
        from shardcache import DistributedCachedDataset
        ds = DistributedCachedDataset({url!r}, storage_options={s3.storage_options()!r},
                                      name="warmed", rank=0, world_size=1)
        print("generation", ds.generation, "bytes", sum(len(ds[i]) for i in range(len(ds))))
        """,
    )
    gets, out = _gets(s3, lambda: user.python(str(job)))
    assert gets == 0 and "generation 1 " in out, out
    # A warm with another preprocess would reset the job's cache: refused.
    other = user.shardcache("warm", url, "--name", "warmed", "--preprocess",
                            "decode_image", *s3o)  # fmt: skip
    assert other.returncode == 2 and "--like warmed" in other.stderr, other.stderr
    # After an invalidation, --like warms with the job's own spec.
    assert user.shardcache("invalidate", "warmed").returncode == 0
    like = user.shardcache("warm", "--like", "warmed")
    assert like.returncode == 0, like.stdout + like.stderr
    gets, out = _gets(s3, lambda: user.python(str(job)))
    assert gets == 0 and "generation 2 " in out, out


def _npy(shape=(3, 32, 32), value=0) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.full(shape, value, dtype=np.float32))
    return buf.getvalue()


def test_integrity_npy_files_read_alike_by_prefix_and_glob(
    user, s3, s3fs_client, bucket
):
    s3fs_client.pipe({f"{bucket}/n/{i:03d}.npy": _npy(value=i) for i in range(300)})
    script = user.write(
        "npy.py",
        f"""
        from shardcache import DistributedCachedDataset, ConfigError
        opts = {s3.storage_options()!r}
        for label, url in (("prefix", "s3://{bucket}/n/"), ("glob", "s3://{bucket}/n/*.npy")):
            ds = DistributedCachedDataset(url, storage_options=opts, name="n" + label,
                                          rank=0, world_size=1, shuffle=False)
            print(label, len(ds), tuple(ds[7].shape), float(ds[7][0, 0, 0]))
        rows = DistributedCachedDataset("s3://{bucket}/n/*.npy", storage_options=opts,
                                        name="nrows", format="npy", rank=0, world_size=1)
        print("rows", len(rows), tuple(rows[0].shape))
        """,
    )
    done = user.python(str(script))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "prefix 300 (3, 32, 32) 7.0" in done.stdout
    assert "glob 300 (3, 32, 32) 7.0" in done.stdout
    assert "rows 900 (32, 32)" in done.stdout


def test_integrity_unpicklable_preprocess_fails_at_construction_naming_member(
    user, s3, s3fs_client, bucket
):
    url = _objects(s3fs_client, bucket, "p")
    script = user.write(
        "locked.py",
        f"""
        import threading
        from shardcache import DistributedCachedDataset, ConfigError
        lock = threading.Lock()
        try:
            DistributedCachedDataset({url!r}, lambda raw: (lock, raw)[1],
                                     storage_options={s3.storage_options()!r})
        except ConfigError as exc:
            print("ConfigError:", exc)
        """,
    )
    done = user.python(str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(
        r"ConfigError: preprocess cannot be pickled: .*'lock'", done.stdout
    )

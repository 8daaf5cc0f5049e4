"""Objects rewritten under a job, on the user's path: the README's
script under plain ``torchrun`` (no ``job=``, no ``close()``, embedded
defaults, the demo run first), reading ``.npy`` files from a folder.

A README trial (2026-12-02) rewrote one file with the same size after the
job had listed the folder: the job delivered the new bytes under its old
listing, with no error (S3 raises ``StaleVersionError`` there). A job must
read the version it listed or say that the file changed; the next job reads
the new version.
"""

from __future__ import annotations

import json

import numpy as np

from tests.userpath.test_jobs import _put

SCRIPT = """
import json, sys
import numpy as np
import torch
import torch.distributed as dist
from shardcache import DistributedCachedDataset, StaleVersionError

src, rewrite = sys.argv[1], sys.argv[2] == "rewrite"
dist.init_process_group("gloo")
ds = DistributedCachedDataset(src)        # the job lists the folder here
dist.barrier()
if rewrite and ds.rank == 0:              # same shape and dtype: same size
    np.save(src + "s0005.npy", np.full((4,), 6005, np.float32))
dist.barrier()
loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=ds.sampler)
values, error = [], None
try:
    for batch in loader:
        values += [int(v) for v in batch[:, 0].tolist()]
except StaleVersionError as exc:
    error = str(exc)
print(json.dumps({"values": values, "error": error}))
"""


def _files(folder, count: int) -> None:
    folder.mkdir()
    for i in range(count):
        np.save(folder / f"s{i:04d}.npy", np.full((4,), i, np.float32))


def test_a_local_file_rewritten_after_the_listing_is_never_served_as_listed(user):
    src = user.workdir / "data"
    _files(src, 40)
    script = user.write("local_rewrite.py", SCRIPT)

    done = user.torchrun(script, f"{src}/", "rewrite")
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line[:1] == "{"]
    assert len(ranks) == 2
    delivered = [v for r in ranks for v in r["values"]]
    assert 6005 not in delivered  # never the new bytes under the old listing
    errors = [r["error"] for r in ranks if r["error"]]
    assert len(errors) == 1, ranks  # the rank whose shard holds it
    assert "s0005.npy" in errors[0] and "changed since it was listed" in errors[0]
    assert "refresh()" in errors[0]

    again = user.torchrun(script, f"{src}/", "read")  # a new job lists again
    assert again.returncode == 0, again.stderr[-4000:]
    ranks = [json.loads(line) for line in again.stdout.splitlines() if line[:1] == "{"]
    assert [r["error"] for r in ranks] == [None, None]
    delivered = sorted(v for r in ranks for v in r["values"])
    assert delivered == sorted([*range(5), 6005, *range(6, 40)])


REWRITE_S3 = """
import io, json, sys
import numpy as np
import s3fs
import torch
import torch.distributed as dist
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

url, options, rewrite = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "rewrite"
dist.init_process_group("gloo")
ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options,
                              on_error="skip")
dist.barrier()
if rewrite and ds.rank == 0:  # after the listing, before any read: same size
    buf = io.BytesIO()
    np.save(buf, np.array([7007, 7], np.int64))
    s3fs.S3FileSystem(**options).pipe(url.removeprefix("s3://") + "0007.npy",
                                      buf.getvalue())
dist.barrier()
loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler)
values = set()
for epoch in range(3):
    ds.set_epoch(epoch)
    for batch in loader:
        values.update(int(v) for v in batch[:, 0].tolist())
stats = ds.stats()
print(json.dumps({"values": sorted(values), "skipped": stats["skipped"]}))
"""


def test_one_object_rewritten_mid_job_costs_one_read_not_its_chunks(
    user, s3, s3fs_client, bucket
):
    """120 objects, one chunk; object 7 rewritten after the listing. The job
    skips it (``on_error="skip"``) and reads the other 119 once: its chunk is
    cached with that row marked. A README trial counted 360 GETs for 3 epochs
    (the chunk rebuilt each epoch), and the next job read all 120 again."""
    for i in range(120):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("rewrite_s3.py", REWRITE_S3)

    done = user.torchrun(script, url, json.dumps(options), "rewrite")
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line[:1] == "{"]
    assert sum(r["skipped"] for r in ranks) == 3  # once an epoch, never served
    values = set().union(*(r["values"] for r in ranks))
    assert 7007 not in values and 7 not in values and len(values) == 119
    assert s3.total_gets == 120  # each object once, the stale one too

    s3.reset_counts()
    again = user.torchrun(script, url, json.dumps(options), "read")
    assert again.returncode == 0, again.stderr[-4000:]
    ranks = [json.loads(line) for line in again.stdout.splitlines() if line[:1] == "{"]
    assert [r["skipped"] for r in ranks] == [0, 0]
    assert 7007 in set().union(*(r["values"] for r in ranks))
    assert s3.total_gets == 1  # the next job reads the rewritten object only

"""Persistent DataLoader workers follow their rank's ``refresh()`` and
``invalidate()``, on the user's path: plain ``torchrun``, no ``job=``, no
``close()``, the README's spawned workers, the demo run first.

A README trial (2026-12-02) with ``persistent_workers=True`` saw
``refresh()`` return the two rewritten objects and the workers serve their
old bytes in every later epoch, and ``invalidate()`` move the generation
while the workers read 0 samples from the source: a persistent worker kept
the listing and the generation of its start. The rank now posts its
epoch, listing and invalidations for its workers (``epoch_board.Post``).
"""

from __future__ import annotations

import json

import pytest

from tests.userpath.test_invalidate_counts import _ranks
from tests.userpath.test_jobs import _put

CHANGED = (3, 40)

SCRIPT = """
import io, json, sys
import fsspec
import numpy as np
import torch
import torch.distributed as dist
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

def main():
    url, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options,
                                  chunk_samples=16)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler,
                                         num_workers=2, multiprocessing_context="spawn",
                                         persistent_workers=True)
    seen, refreshed = {}, []
    for epoch in range(3):
        ds.set_epoch(epoch)
        for batch in loader:
            for row in batch:
                seen.setdefault(int(row[1]), []).append(int(row[0]))
        dist.barrier()
        if epoch == 0:
            if ds.rank == 0:  # two objects change upstream
                for i in CHANGED:
                    buf = io.BytesIO()
                    np.save(buf, np.array([100 + i, i], np.int64))
                    with fsspec.open(f"{url}{i:04d}.npy", "wb", **options) as f:
                        f.write(buf.getvalue())
            dist.barrier()
            refreshed = ds.refresh()
        if epoch == 1:
            if ds.rank == 0:
                ds.invalidate()  # rank 1's workers move at its next epoch,
            dist.barrier()       # the one it starts after this call
    with open(f"{out}.{ds.rank}.json", "w") as f:
        json.dump({"seen": seen, "refreshed": refreshed}, f)

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("job", ["", "nightly"])
def test_persistent_workers_follow_refresh_and_invalidate(
    user, s3, s3fs_client, bucket, job
):
    for i in range(64):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("persistent.py", f"CHANGED = {CHANGED!r}\n" + SCRIPT)
    out = user.workdir / "run"
    # A job name later runs may carry too (SHARDCACHE_JOB) names no reading:
    # the workers still see each epoch start (a review found they did not).
    env = {"SHARDCACHE_JOB": job} if job else None
    done = user.torchrun(script, url, json.dumps(options), str(out), env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks, seen = _ranks(out)
    for r in ranks:
        assert sorted(r["refreshed"]) == [f"{url}{i:04d}.npy" for i in CHANGED]
    # Epoch 0 the old bytes, epochs 1 and 2 the new ones of the changed objects.
    assert seen == {
        i: [i, 100 + i, 100 + i] if i in CHANGED else [i] * 3 for i in range(64)
    }
    # The refresh re-read the changed objects only; the invalidate every one.
    assert s3.total_gets == 64 + len(CHANGED) + 64

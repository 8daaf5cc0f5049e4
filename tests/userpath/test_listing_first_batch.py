"""A first batch before the listing ends, on the user's path: the README's
script under plain ``torchrun``, no ``job=``, no ``close()``, embedded
defaults, after the demo, against an S3 prefix listed in 24 pages of 250
keys that take 0.6 s each (a ~15 s listing).

A listing of millions of objects takes minutes, and nothing could be read
before it ended. The stores now publish its first whole chunks after
``stream_after_s`` (2 s) and longer prefixes as it goes; the first epoch is
read segment by segment (``shardcache.segments``). What must still hold:
every rank the same number of batches, every object read from the source
once, every object delivered in the first epoch (a few padded twice, as
``DistributedSampler`` pads), later epochs exact, and a resume of the
first epoch continuing its own order exactly.
"""

from __future__ import annotations

import io
import json
from collections import Counter

import numpy as np

from shardcache_server.emulator import FaultPlan

N = 6_000
PAGES = FaultPlan(list_latency_s=0.6, list_page_keys=250)  # 24 pages, ~15 s
BATCH = 64

SCRIPT = """
import io, json, sys, time
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

def main():
    url, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    workers = int(sys.argv[4])
    ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options,
                                  chunk_samples=256)
    extra = dict(num_workers=workers, multiprocessing_context="spawn",
                 persistent_workers=True) if workers else {}
    loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=ds.sampler, **extra)
    early, epochs = None, []
    for epoch in range(2):
        ds.set_epoch(epoch)
        values, batches = [], 0
        for x in loader:
            if early is None:  # was the listing still under way?
                early = ds.manifest.is_prefix
            values += x[:, 0].tolist()
            batches += 1
        epochs.append({"values": values, "batches": batches, "len": len(ds.sampler)})
    with open(f"{out}.{ds.rank}.json", "w") as f:
        json.dump({"early": early, "epochs": epochs, "n": len(ds)}, f)

if __name__ == "__main__":
    main()
"""

RESUME = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

url, options, out, stop = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options,
                              chunk_samples=256)
resumed = stop < 0
if resumed:
    with open(f"{out}.state.{ds.rank}.json") as f:
        ds.load_state_dict(json.load(f))
loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=ds.sampler)
values = []
for epoch in range(ds.sampler.epoch, 1):
    ds.set_epoch(epoch)
    for i, x in enumerate(loader):
        values += x[:, 0].tolist()
        if i + 1 == stop:
            with open(f"{out}.state.{ds.rank}.json", "w") as f:
                json.dump(ds.state_dict(), f)
            break
order = ds.sampler.order().tolist()  # the epoch's whole order (the listing ended)
with open(f"{out}.{'b' if resumed else 'a'}.{ds.rank}.json", "w") as f:
    json.dump({"values": values, "order": order}, f)
"""


def _fill(s3fs_client, bucket: str, folder: str) -> str:
    def npy(i: int) -> bytes:
        buf = io.BytesIO()
        np.save(buf, np.array([i, i], np.int64))
        return buf.getvalue()

    s3fs_client.pipe({f"{bucket}/{folder}/{i:05d}.npy": npy(i) for i in range(N)})
    return f"s3://{bucket}/{folder}/"


def _results(out, kind: str = "") -> list[dict]:
    return [json.loads(open(f"{out}.{kind}{r}.json").read()) for r in (0, 1)]


def test_the_first_batch_comes_before_the_listing_ends(user, s3, s3fs_client, bucket):
    """Under the README's spawned DataLoader workers, which follow their rank
    to each longer prefix (the resume test below reads without workers)."""
    workers = 2
    url = _fill(s3fs_client, bucket, f"w{workers}")
    script = user.write("train.py", SCRIPT)
    out = user.workdir / "run"
    s3.reset_counts()
    s3.set_faults(PAGES)
    done = user.torchrun(
        script, url, json.dumps(s3.storage_options()), str(out), str(workers)
    )
    s3.set_faults(FaultPlan())
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = _results(out)
    assert all(r["early"] for r in ranks), "the first batch waited for the listing"
    assert all(r["n"] == N for r in ranks)
    first = [r["epochs"][0] for r in ranks]
    assert first[0]["batches"] == first[1]["batches"]  # ranks in step
    got = Counter(v for r in first for v in r["values"])
    assert set(got) == set(range(N))  # every object delivered
    padded = sum(got.values()) - N
    assert 0 <= padded <= 8  # at most one per rank and segment (a few segments)
    assert all(len(r["values"]) == r["len"] for r in first)
    second = Counter(v for r in ranks for v in r["epochs"][1]["values"])
    assert second == Counter(range(N))  # the whole listing: exact
    assert ranks[0]["epochs"][1]["batches"] == ranks[1]["epochs"][1]["batches"]
    # Read from the source once each, though read while it was listed.
    assert len(s3.gets) == N and max(s3.gets.values()) == 1


def test_a_resume_of_the_first_epoch_continues_its_own_order(
    user, s3, s3fs_client, bucket
):
    url = _fill(s3fs_client, bucket, "resume")
    script = user.write("resume.py", RESUME)
    out = user.workdir / "run"
    options = json.dumps(s3.storage_options())
    s3.set_faults(PAGES)
    try:
        stop = 30  # batches: past the first segment
        first = user.torchrun(script, url, options, str(out), str(stop))
        assert first.returncode == 0, first.stderr[-3000:]
        # A new job lists again (its own segments, maybe none): the saved ones rule.
        again = user.torchrun(script, url, options, str(out), "-1")
        assert again.returncode == 0, again.stderr[-3000:]
    finally:
        s3.set_faults(FaultPlan())
    for a, b in zip(_results(out, "a."), _results(out, "b."), strict=True):
        assert a["values"] == a["order"][: stop * BATCH]
        assert b["values"] == a["order"][stop * BATCH :]  # exactly the rest

"""``ds.invalidate()`` from one rank in the middle of an epoch, on the user's
path: plain ``torchrun``, no ``job=``, no ``close()``, the demo run first.

The README promises: this rank's next batch re-fetches, the other ranks at
their next epoch. A README trial (2026-11-28) saw the other rank count hits
while the emulator counted 32 GETs in that epoch, and asked whether a rank
hid source reads. It does not: those GETs are the invalidating rank's
chunks, rebuilt whole, rows it had delivered already this epoch included.
Those rows are delivered from the cache in the next epoch, as hits. So the
source *samples* (what the ranks received from the source) and the stores'
*GETs* differ by exactly those rows; both are on the dashboard, and both
are checked here against what the ranks and the emulator saw.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardcache.index import RedisIndex
from shardcache.spec import default_name
from tests.userpath.test_jobs import _metric, _metrics, _put, _redis_url

SCRIPT_HEAD = """
import io, json, sys
import numpy as np
import torch
import torch.distributed as dist
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

url, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
ds = DistributedCachedDataset(url, preprocess=load_npy, storage_options=options,
                              chunk_samples=16)
loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler)
"""


def _ranks(out: Path) -> tuple[list[dict], dict[int, list[int]]]:
    """The two ranks' results, and every sample's values as they saw them."""
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    seen: dict[int, list[int]] = {}
    for r in ranks:
        for k, values in r["seen"].items():
            seen.setdefault(int(k), []).extend(values)
    return ranks, seen


MID_EPOCH = (
    SCRIPT_HEAD
    + """epochs, seen = [], {}
for epoch in range(3):
    ds.set_epoch(epoch)
    before = ds.stats()
    for step, batch in enumerate(loader):
        for row in batch:
            seen.setdefault(int(row[1]), []).append(int(row[0]))
        if (epoch, step) == (1, 1):
            dist.barrier()  # both ranks are in epoch 1
            if ds.rank == 0:
                ds.invalidate()
            dist.barrier()  # rank 1 is mid-epoch when the generation moves
    after = ds.stats()
    epochs.append([after["misses"] - before["misses"], after["hits"] - before["hits"]])
with open(f"{out}.{ds.rank}.json", "w") as f:
    json.dump({"epochs": epochs, "seen": seen}, f)
"""
)


def test_invalidate_mid_epoch_counts_what_the_ranks_and_the_source_saw(
    user, s3, s3fs_client, bucket
):
    for i in range(64):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("mid_epoch.py", MID_EPOCH)
    out = user.workdir / "run"
    done = user.torchrun(script, url, json.dumps(options), str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    ranks, seen = _ranks(out)
    assert seen == {i: [i] * 3 for i in range(64)}
    source = sum(m for r in ranks for m, _ in r["epochs"])
    # [source samples, hits] per epoch. 64 objects, 4 chunks of 16, 2 each.
    # Rank 0 invalidates after 16 of its 32 samples of epoch 1: its next 16
    # come from the source (both its chunks rebuilt: 32 GETs), and epoch 2
    # reads those chunks, under the new generation already: 32 hits.
    assert ranks[0]["epochs"] == [[32, 0], [16, 16], [0, 32]]
    # Rank 1 ends epoch 1 on the old generation, then reads the new one.
    assert ranks[1]["epochs"] == [[32, 0], [0, 32], [32, 0]]
    assert source == 112
    assert s3.total_gets == 64 + 32 + 32  # the rebuilt chunks' every row
    metrics = _metrics(user, _redis_url(user.home))
    name = default_name(url)
    labels = {"dataset": name}
    assert (
        _metric(metrics, "shardcache_samples_total", origin="source", **labels) == 112
    )
    assert _metric(metrics, "shardcache_remote_reads_total", **labels) == 128


EVERY_RANK = (
    SCRIPT_HEAD
    + """made, seen = [], {}
for epoch in range(3):
    ds.set_epoch(epoch)
    for step, batch in enumerate(loader):
        for row in batch:
            seen.setdefault(int(row[1]), []).append(int(row[0]))
        if (epoch, step) == (1, 1):
            read = ds.state_dict()["generation"]
            made.append(ds.invalidate())  # every rank, as DDP code calls it
with open(f"{out}.{ds.rank}.json", "w") as f:
    json.dump({"read": read, "made": made, "seen": seen}, f)
"""
)


def test_invalidate_called_on_every_rank_starts_one_generation(
    user, s3, s3fs_client, bucket
):
    for i in range(64):
        _put(s3fs_client, bucket, i, i)
    url, options = f"s3://{bucket}/train/", s3.storage_options()
    script = user.write("every_rank.py", EVERY_RANK)
    out = user.workdir / "run"
    done = user.torchrun(script, url, json.dumps(options), str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    ranks, seen = _ranks(out)
    assert seen == {i: [i] * 3 for i in range(64)}
    index = RedisIndex.from_url(_redis_url(user.home))
    generation = index.generation(default_name(url))
    # One generation for the two calls (one a rank would make two), though
    # the later rank may have moved to it before its own call.
    read = min(r["read"] for r in ranks)
    assert ranks[0]["made"] == ranks[1]["made"] == [generation] == [read + 1]
    # Each chunk read once before the call and once after it, never again.
    assert s3.total_gets == 64 + 64

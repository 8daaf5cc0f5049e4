"""A fresh dataset's first batch waits for one small build, on the user's
path: the README's script under plain ``torchrun``, no ``job=``, no
``close()``, embedded defaults, after the demo.

A full shuffle's first batch of a cold cache touches a chunk per sample and
waits for every one of them to be built (100 k objects from S3: 96 s). A
listing that a job waits for, of which nothing can be cached yet, now
carries one segment: its first epoch is read chunk by chunk, the first
chunk's 16 small pieces first (``shardcache.segments``). What must still
hold: the ranks in step with every sample delivered once, each rank's
first epoch on the chunks of its stable shard (so later epochs read where
the first one built), and later epochs shuffled across the shard as before.
"""

from __future__ import annotations

import io
import json
import time

import numpy as np

from shardcache_server.emulator import FaultPlan

N = 12_000  # 3 chunks of the default 4,096: a full-shuffle first batch waits for
# ~9,300 reads (the first chunk's pieces in part), over COLD_FIRST_BATCH_READS
PIECE = 64  # the default chunk of 4,096 cut into 64 pieces (listing.RAMP_PIECES)

SCRIPT = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

ds = DistributedCachedDataset(sys.argv[1], preprocess=load_npy)
loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=ds.sampler)
epochs = []
for epoch in range(2):
    ds.set_epoch(epoch)
    epochs.append([int(v) for x in loader for v in x[:, 0]])
with open(f"{sys.argv[2]}.{ds.rank}.json", "w") as f:
    json.dump({"epochs": epochs, "ends": ds.manifest.prefix_ends.tolist()}, f)
"""


GLANCE = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

ds = DistributedCachedDataset(sys.argv[1], preprocess=load_npy,
                              storage_options=json.loads(sys.argv[2]))
loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=ds.sampler)
epochs, seen = int(sys.argv[4]), []
if epochs == 0:  # a glance at the first batch, then exit
    seen = [int(v) for v in next(iter(loader))[:, 0]]
for epoch in range(epochs):
    ds.set_epoch(epoch)
    for x in loader:
        seen += [int(v) for v in x[:, 0]]
with open(f"{sys.argv[3]}.{ds.rank}.json", "w") as f:
    json.dump(seen, f)
"""


def test_a_cold_first_epoch_starts_on_a_small_piece(user, tmp_path):
    data = tmp_path / "cold"
    data.mkdir()
    for i in range(N):
        np.save(data / f"{i:05d}.npy", np.array([i, i], np.int64))
    script = user.write("train.py", SCRIPT)
    out = user.workdir / "cold"
    done = user.torchrun(script, f"file://{data}", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads(open(f"{out}.{r}.json").read()) for r in (0, 1)]
    assert all(r["ends"] == [0, N] for r in ranks)  # one segment: the whole listing
    first = [r["epochs"][0] for r in ranks]
    assert len(first[0]) == len(first[1]) == N // 2  # in step
    assert sorted(first[0] + first[1]) == list(range(N))  # each sample once
    for r, order in enumerate(first):
        # The first batch from one piece of the first chunk.
        assert len({v // PIECE for v in order[:64]}) == 1 and order[0] < 4096, r
        # Chunk by chunk: each piece or chunk read in one run.
        chunk = [v // PIECE if v < 4096 else 64 + (v - 4096) // 4096 for v in order]
        runs = 1 + sum(a != b for a, b in zip(chunk, chunk[1:], strict=False))
        assert runs == len(set(chunk)), r
        second = ranks[r]["epochs"][1]
        assert set(second) == set(order)  # its stable shard: where it was built
        assert second != order


def _settled(s3, quiet_s: float = 5.0, limit_s: float = 180.0) -> int:
    """The GETs once the stores stopped making new ones."""
    deadline, last, since = time.monotonic() + limit_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = s3.total_gets
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.5)
    return last


def test_a_glance_at_a_cold_dataset_exits_without_waiting_for_its_builds(
    user, s3, s3fs_client, bucket
):
    """A script that looks at its first batch and ends (no close()) used to
    sit at exit until the stores had built everything its look-ahead asked
    for; the builds do not need it. What it asked for is still built once,
    and the next job reads every object exactly once in all."""
    n = 8_200  # one segment from pieces: 8,200 reads for a full shuffle's first batch

    def npy(i: int) -> bytes:
        buf = io.BytesIO()
        np.save(buf, np.array([i, i], np.int64))
        return buf.getvalue()

    s3fs_client.pipe({f"{bucket}/glance/{i:05d}.npy": npy(i) for i in range(n)})
    url, options = f"s3://{bucket}/glance/", json.dumps(s3.storage_options())
    script = user.write("glance.py", GLANCE)
    out = user.workdir / "glance"
    s3.reset_counts()
    s3.set_faults(FaultPlan(latency_s=0.3))  # ~40 s to read it all from here
    try:
        done = user.python(str(script), url, options, str(out), "0")  # one process
        at_exit = s3.total_gets
        assert done.returncode == 0, done.stderr[-3000:]
        assert at_exit < n, "the script waited for every build before it exited"
        asked = _settled(s3)  # the stores finish what the look-ahead asked for
    finally:
        s3.set_faults(FaultPlan())
    assert max(s3.gets.values()) == 1
    done = user.torchrun(script, url, options, str(out), "1")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [v for r in (0, 1) for v in json.loads(open(f"{out}.{r}.json").read())]
    assert sorted(seen) == list(range(n))
    assert s3.total_gets == n and max(s3.gets.values()) == 1, (asked, s3.total_gets)

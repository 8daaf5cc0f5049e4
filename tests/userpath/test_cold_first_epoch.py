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

import json

import numpy as np

N = 10_000  # 3 chunks of the default 4,096: a full-shuffle first batch reads them all
PIECE = 256  # the default chunk cut into 16 pieces

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
        chunk = [v // PIECE if v < 4096 else 16 + (v - 4096) // 4096 for v in order]
        runs = 1 + sum(a != b for a, b in zip(chunk, chunk[1:], strict=False))
        assert runs == len(set(chunk)), r
        second = ranks[r]["epochs"][1]
        assert set(second) == set(order)  # its stable shard: where it was built
        assert second != order

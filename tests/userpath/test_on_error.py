"""One bad object does not end the epoch when the user opts in.

100 ``.npy`` files, one of them truncated so ``np.load`` fails on the
cluster. With ``on_error="skip"`` both ranks run the same number of steps
over a full-length epoch and the bad sample is counted, not delivered; by
default the batch raises the project's error naming the file.
"""

from __future__ import annotations

import json

import numpy as np

SCRIPT = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset
from shardcache.errors import ShardCacheError

def load_npy(data):
    return np.load(io.BytesIO(data))

root, on_error, out, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ds = DistributedCachedDataset(root, preprocess=load_npy, on_error=on_error,
                              name=f"skip-{on_error}")
loader = torch.utils.data.DataLoader(ds, batch_size=10, sampler=ds.sampler)
steps, values, reads, skipped = 0, [], [], []
for epoch in range(epochs):
    ds.set_epoch(epoch)
    before = ds.stats()
    try:
        for batch in loader:
            steps += 1
            values += batch[:, 0].tolist() if epoch == 0 else []
    except ShardCacheError as exc:
        values = {"error": type(exc).__name__, "message": str(exc)}
    after = ds.stats()
    reads.append(after["remote_reads"] - before["remote_reads"])
    skipped.append(after["skipped"] - before["skipped"])
with open(f"{out}.{ds.rank}.json", "w") as f:
    json.dump({"steps": steps, "values": values, "skipped": skipped, "reads": reads}, f)
"""


def test_on_error_skip_keeps_every_rank_in_step_and_counts_the_bad_object(user):
    root = user.workdir / "data"
    root.mkdir()
    for i in range(100):
        np.save(root / f"{i:03d}.npy", np.full((4,), i, np.float32))
    (root / "042.npy").write_bytes((root / "042.npy").read_bytes()[:20])
    script = user.write("train.py", SCRIPT)

    out = user.workdir / "skip"
    done = user.torchrun(script, f"{root}/", "skip", str(out), "2")
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((user.workdir / f"skip.{r}.json").read_text()) for r in (0, 1)]
    assert [r["steps"] for r in ranks] == [10, 10]
    values = [v for r in ranks for v in r["values"]]
    assert len(values) == 100 and 42 not in values
    assert set(values) == set(range(100)) - {42}  # one stand-in repeats a value
    # Counted every epoch it is skipped; read from the source once: the
    # second epoch reads nothing, not the bad object's whole chunk again.
    assert [sum(r["skipped"][e] for r in ranks) for e in (0, 1)] == [1, 1]
    # The 100 files are one chunk, split between the ranks: it counts as
    # source for the rank whose request built it, and for the other rank
    # too when it asked while the build was in flight (a race).
    assert sorted(r["reads"][0] for r in ranks) in ([0, 50], [50, 50])
    assert [r["reads"][1] for r in ranks] == [0, 0]
    assert "skipping samples that could not be read" in done.stderr
    stats = user.shardcache("stats")  # skipped is not "lost" (Redis was up)
    assert stats.returncode == 0, stats.stderr
    assert "skipped:" in stats.stdout and "lost:" not in stats.stdout, stats.stdout

    out = user.workdir / "raise"
    done = user.torchrun(script, f"{root}/", "raise", str(out), "1")
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((user.workdir / f"raise.{r}.json").read_text()) for r in (0, 1)]
    errors = [r["values"] for r in ranks if isinstance(r["values"], dict)]
    assert len(errors) == 1 and errors[0]["error"] == "PreprocessError"
    assert "042.npy" in errors[0]["message"]

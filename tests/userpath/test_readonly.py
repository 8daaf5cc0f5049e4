"""Read-only means read-only: no tensor a user receives can change the cache.

Issue: ``x = ds[0]; x.mul_(2)`` used to write into the shared chunk in the
Ray object store, so every later reader on the node got doubled values.
The chunk here is big enough (60 x 12 KiB) to live in shared memory rather
than be inlined by Ray, which is what hid the bug from small test data.
"""

from __future__ import annotations

import json

import numpy as np

SAMPLES = 60
SHAPE = (3, 32, 32)

WRITE_EVERYWHERE = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

def double(x):
    return x.mul_(2)  # an in-place transform, as users write them

if __name__ == "__main__":
    root = sys.argv[1]
    ds = DistributedCachedDataset(root, preprocess=load_npy)
    x = ds[0]
    x.mul_(2)                                   # 1. a sample, in place
    ds[1].numpy()[...] = -1                     # 2. through numpy
    for batch in torch.utils.data.DataLoader(ds, batch_size=16, sampler=ds.sampler):
        batch.mul_(2)                           # 3. a DataLoader batch
    for batch in ds.loader(16):
        batch.mul_(2)                           # 4. the fast path
    aug = DistributedCachedDataset(root, preprocess=load_npy, transform=double)
    for batch in torch.utils.data.DataLoader(aug, batch_size=16, sampler=aug.sampler):
        pass                                    # 5. an in-place transform
    for batch in aug.loader(16):
        pass                                    # 6. ... on the fast path
    workers = torch.utils.data.DataLoader(
        aug, batch_size=16, sampler=aug.sampler, num_workers=2,
        multiprocessing_context="spawn")
    for batch in workers:
        pass                                    # 7. ... in DataLoader workers
    print(json.dumps({"rank": ds.rank}))
"""

READ_FRESH = """
import io, json, sys
import numpy as np
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

ds = DistributedCachedDataset(sys.argv[1], preprocess=load_npy)
bad = [i for i in range(len(ds)) if not np.array_equal(ds[i].numpy(), np.full((3, 32, 32), i, np.float32))]
print(json.dumps({"bad": bad, "stats": {k: ds.stats()[k] for k in ("hits", "misses")}}))
"""


def _sample_files(user):
    """``SAMPLES`` .npy files, sample ``i`` all ``i``: a torn or changed row shows."""
    root = user.workdir / "data"
    root.mkdir()
    for i in range(SAMPLES):
        np.save(root / f"{i:04d}.npy", np.full(SHAPE, i, np.float32))
    return root


def test_in_place_writes_through_every_path_leave_the_cache_intact(user):
    root = _sample_files(user)
    writer = user.write("train.py", WRITE_EVERYWHERE)
    done = user.torchrun(writer, f"{root}/")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "not writable" not in done.stderr  # no view reached user code

    reader = user.write("check.py", READ_FRESH)
    fresh = user.python(str(reader), f"{root}/")
    assert fresh.returncode == 0, fresh.stderr[-4000:]
    out = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert out["bad"] == []
    assert out["stats"]["hits"] == SAMPLES  # read from the cache, not re-read


KEEP_SOME = """
import io, json, sys
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

if __name__ == "__main__":
    ds = DistributedCachedDataset(sys.argv[1], preprocess=load_npy)
    loaders = {
        "dataloader": torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler),
        "fast": ds.loader(8),
    }
    kept, addresses, torn = [], [], 0
    for epoch in range(3):
        ds.set_epoch(epoch)
        for name, loader in loaders.items():
            for i, batch in enumerate(loader):
                addresses.append(batch.data_ptr())
                flat = batch.flatten(1)
                torn += int((flat.min(1).values != flat.max(1).values).sum())
                batch.mul_(-1)  # the step writes into its own batch
                if i % 3 == 0:
                    kept.append((batch, batch.clone()))  # a batch kept whole
                elif i % 3 == 1:
                    row = batch[1]
                    kept.append((row, row.clone()))  # one row of it
    changed = sum(not torch.equal(k, c) for k, c in kept)
    print(json.dumps({"changed": changed, "kept": len(kept), "torn": torn,
                      "batches": len(addresses), "distinct": len(set(addresses))}))
"""


def test_a_batch_or_row_the_user_keeps_is_never_written_again(user):
    """Batches are gathered into buffers written again once nothing views
    them (``buffers.py``): a batch the step keeps, or one row of it, keeps
    its buffer; the dropped ones are reused, and no batch is torn."""
    root = _sample_files(user)
    script = user.write("keep.py", KEEP_SOME)
    done = user.torchrun(script, f"{root}/")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 2, done.stdout[-2000:]
    for line in lines:
        out = json.loads(line)
        assert out["changed"] == 0 and out["torn"] == 0, out
        assert out["kept"] > 10, out
        # Addresses repeat: dropped batches' buffers were written again.
        assert out["distinct"] < out["batches"], out

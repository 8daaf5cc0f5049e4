"""Every call the README's reference block shows, made the way it shows it,
in a DDP script under plain torchrun (2 gloo ranks, embedded defaults).

The block is read from README.md: a call added there without a line here
fails ``test_readme_calls_are_all_made``.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[2] / "README.md"

SCRIPT = """
import io, json, sys
import numpy as np
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from shardcache import DistributedCachedDataset

def load_npy(data):
    return np.load(io.BytesIO(data))

def random_flip(x):
    return x.flip(-1) if torch.rand(()) < 0.5 else x

if __name__ == "__main__":
    dist.init_process_group("gloo")
    url, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    ds = DistributedCachedDataset(
        url, preprocess=load_npy, transform=random_flip, storage_options=options,
        redis_url=None, ray_address=None, shuffle=True, seed=0, drop_last=False,
        shuffle_block=None, consistency="epoch", revalidate="job", on_error="raise",
        chunk_bytes=16 * 2**20, chunk_samples=4096, version=None,
    )
    got = {}
    for epoch in range(2):
        ds.set_epoch(epoch)
        for batch in ds.loader(64):
            got["loader"] = got.get("loader", 0) + len(batch)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=ds.sampler,
                                         num_workers=2, multiprocessing_context="spawn")
    got["dataloader"] = sum(len(b) for b in loader)
    got["hits"] = ds.stats()["hits"]
    got["generation"] = ds.invalidate()
    got["changed"] = ds.refresh()
    sd = ds.state_dict()
    ds.load_state_dict(sd)
    ds.load_state_dict(ds.gather_state_dict())
    ds.set_epoch(2)  # the state loaded above was at the end of an epoch
    got["warm"] = ds.warm(steps=1, batch_size=64)
    stateful = StatefulDataLoader(ds, sampler=ds.sampler, num_workers=2,
                                  multiprocessing_context="spawn")
    got["stateful"] = sum(len(b) for b in stateful)
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(got, f)
"""


def _readme_calls() -> set[str]:
    block = README.read_text().split("```python\nfrom shardcache import", 1)[1]
    block = block.split("```", 1)[0]
    return set(re.findall(r"\bds\.(\w+)\(", block)) | set(
        re.findall(r"\b(StatefulDataLoader|DataLoader)\(", block)
    )


def test_readme_calls_are_all_made():
    made = set(re.findall(r"\bds\.(\w+)\(", SCRIPT)) | set(
        re.findall(r"\b(StatefulDataLoader|DataLoader)\(", SCRIPT)
    )
    assert _readme_calls() <= made, _readme_calls() - made


def test_readme_reference_calls_work_under_torchrun(user, s3, s3fs_client, bucket):
    for i in range(128):
        buf = io.BytesIO()
        np.save(buf, np.full((3, 4, 4), i, np.float32))
        s3fs_client.pipe(f"{bucket}/train/{i:03d}.npy", buf.getvalue())
    script = user.write("train.py", SCRIPT)
    out = user.workdir / "out"
    done = user.torchrun(script, f"s3://{bucket}/train/", json.dumps(s3.storage_options()), str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    for got in ranks:
        assert got["loader"] == 2 * 64 and got["dataloader"] == 64
        assert got["stateful"] == 64 and got["changed"] == []
        # epoch 1 of ds.loader; the DataLoader's workers count their own
        # samples (stats() is this process: its "counts" says so)
        assert got["hits"] == 64
        assert got["warm"]["samples"] >= 1

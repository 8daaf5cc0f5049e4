"""What every trainer script starts with: DATA, a Net that records the
sample values it is fed, and a record of each dataset built in this
process, written as rank<R>.json to OUT when the script ends."""

import atexit
import json
import os
from pathlib import Path

import torch

import shardcache.dataset

DATA = os.environ["TRAINERS_DATA"]
OUT = Path(os.environ["TRAINERS_OUT"])
RECORD: list[int] = []
DATASETS: list = []

_init = shardcache.dataset.DistributedCachedDataset.__init__


def _tracked_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    DATASETS.append(self)


shardcache.dataset.DistributedCachedDataset.__init__ = _tracked_init


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        RECORD.extend(x.reshape(-1).tolist())
        return x.float().reshape(len(x), -1) * self.w


def _report():
    if not DATASETS:
        return
    ds = DATASETS[-1]
    stats = ds.stats()
    report = {
        "rank": ds.rank,
        "world_size": ds.world_size,
        "values": RECORD,
        "per_epoch": len(ds.sampler),
        "hits": stats["hits"],
        "misses": stats["misses"],
    }
    (OUT / f"rank{ds.rank}.json").write_text(json.dumps(report))


atexit.register(_report)

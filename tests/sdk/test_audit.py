"""The delivery audit under real loaders: torch's DataLoader, torchdata's
StatefulDataLoader and Accelerate's BatchSamplerShard (what
``accelerator.prepare()`` puts around a DataLoader's batch sampler), one
process standing for each rank. ``Batches`` is the dataset's batch path
reduced to the audit call it makes in ``__getitems__``."""

from __future__ import annotations

import numpy as np
import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from shardcache.batches import ShardBatchSampler
from shardcache.errors import ConfigError, ShardedTwiceError
from shardcache.sampler import ShardSampler

SIZES = [25] * 16  # 400 samples, 200 per rank of 2
BATCH = 20


class Batches(Dataset):
    def __init__(self, sampler: ShardSampler):
        self.sampler = sampler

    def __len__(self) -> int:
        return self.sampler.n

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.sampler.audit(np.asarray(indices, dtype=np.int64))
        return list(indices)


def as_list(batch: list[int]) -> list[int]:
    return list(batch)


def loader_of(sampler: ShardSampler, **kw) -> DataLoader:
    return DataLoader(
        Batches(sampler), batch_size=BATCH, sampler=sampler, collate_fn=as_list, **kw
    )


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("rank", [0, 1])
def test_audit_plain_loader_delivers_the_shard_every_epoch(rank):
    s = ShardSampler(SIZES, rank, 2)
    for epoch in range(3):
        s.set_epoch(epoch)
        got = [i for batch in loader_of(s) for i in batch]
        assert got == s.order().tolist()


def test_audit_warns_once_when_the_loader_does_not_use_ds_sampler():
    s = ShardSampler(SIZES, 0, 2)
    ds = Batches(s)
    with pytest.warns(UserWarning, match="does not use ds.sampler") as caught:
        for _ in range(2):
            s.set_epoch(_)
            got = [i for b in DataLoader(ds, BATCH, shuffle=True, collate_fn=as_list)
                   for i in b]  # fmt: skip
    assert sorted(got) == list(range(sum(SIZES)))  # read, as asked
    assert len([w for w in caught if "ds.sampler" in str(w.message)]) == 1


@pytest.mark.parametrize("split_batches", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_audit_batch_sampler_shard_stops_at_the_first_batch(rank, split_batches):
    s = ShardSampler(SIZES, rank, 2)
    for batch_sampler in (BatchSampler(s, BATCH, False), s.batches(BATCH)):
        shard = BatchSamplerShard(
            batch_sampler, num_processes=2, process_index=rank,
            split_batches=split_batches,
        )  # fmt: skip
        loader = DataLoader(Batches(s), batch_sampler=shard, collate_fn=as_list)
        delivered = []
        with pytest.raises(ShardedTwiceError, match="accelerator.prepare"):
            for batch in loader:
                delivered.append(batch)
        assert delivered == []


def test_audit_workers_stop_by_their_second_batch():
    # A worker's copy of the sampler does not see what the loader read, so
    # each worker tells at its second batch: the loader's batch 3 of 2 workers.
    s = ShardSampler(SIZES, 0, 2)
    shard = BatchSamplerShard(BatchSampler(s, BATCH, False), 2, 0)
    loader = DataLoader(
        Batches(s), batch_sampler=shard, collate_fn=as_list, num_workers=2
    )
    delivered = []
    with pytest.raises(ShardedTwiceError):
        for batch in loader:
            delivered.append(batch)
    assert len(delivered) == 2


def test_audit_resumed_stateful_loader_is_no_split():
    s = ShardSampler(SIZES, 1, 2)
    s.set_epoch(1)
    loader = StatefulDataLoader(
        Batches(s), batch_size=BATCH, sampler=s, collate_fn=as_list
    )
    it = iter(loader)
    head = [i for _ in range(3) for i in next(it)]
    state = loader.state_dict()

    again = ShardSampler(SIZES, 1, 2)
    again.set_epoch(1)
    resumed = StatefulDataLoader(
        Batches(again), batch_size=BATCH, sampler=again, collate_fn=as_list
    )
    resumed.load_state_dict(state)
    tail = [i for batch in resumed for i in batch]
    assert head + tail == s.order().tolist()


def test_shard_batch_sampler_rejects_a_trainers_own_sampler():
    ds = Batches(ShardSampler(SIZES, 0, 2))
    with pytest.raises(ConfigError, match="use_distributed_sampler=False"):
        ShardBatchSampler(DistributedSampler(ds, 2, 0), BATCH)

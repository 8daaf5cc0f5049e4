"""Elastic resume and StatefulDataLoader through DistributedCachedDataset on the real
2-node Ray cluster, Redis and the S3 emulator."""

from __future__ import annotations

import socket
import sys
from collections import Counter

import pytest
import ray
import ray.cloudpickle
from torch.utils.data import DataLoader

from shardcache import DistributedCachedDataset
from shardcache.errors import ConfigError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow

OBJECTS = 60  # 12 chunks of 5: 3 whole chunks per rank at 4 ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(s3fs_client, bucket, count=OBJECTS):
    # Object i holds byte i, so a sample's first element names it.
    s3fs_client.pipe({f"{bucket}/e/{i:03d}.bin": bytes([i]) * 32 for i in range(count)})
    return f"s3://{bucket}/e/"


@ray.remote(num_cpus=0)
def _rank(cfg, rank, world, batch, steps, state=None, nodes=None, port=None):
    """One rank: (resume,) read ``steps`` batches of epoch 1 (0: to the end)."""
    import torch.distributed as dist

    if port is not None:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    try:
        ds = DistributedCachedDataset(
            cfg["url"],
            storage_options=cfg["storage_options"],
            redis_url=cfg["redis_url"],
            namespace=cfg["namespace"],
            rank=rank,
            world_size=world,
            seed=7,
            chunk_samples=5,
        )
        if state is not None:
            ds.load_state_dict(state, nodes=nodes)
        ds.set_epoch(1)
        ids, batches = [], 0
        for x in ds.loader(batch):
            ids += x[:, 0].tolist()
            batches += 1
            if batches == steps:
                break
        out = {
            "ids": ids,
            "batches": batches,
            "state": ds.state_dict(),
            "merged": ds.gather_state_dict() if port is not None else None,
            "node": ray.get_runtime_context().get_node_id(),
            "moved": ds.stats()["moved_on_resume"],
        }
        ds.close()
        return out
    finally:
        if port is not None:
            dist.destroy_process_group()


def _run(cfg, world, batch, steps, node_of, state=None, nodes=None, dist=False):
    port = _free_port() if dist else None
    calls = [
        _rank.options(resources={f"node{node_of(r)}": 0.01}).remote(
            cfg, r, world, batch, steps, state, nodes, port
        )
        for r in range(world)
    ]
    return ray.get(calls, timeout=300)


@pytest.mark.timeout(300)  # three rounds of Ray worker processes on 2 shared cores
def test_elastic_resume_4_ranks_to_2_and_6_every_remaining_sample_once(
    ray_cluster, node_ids, s3, s3fs_client, bucket, redis_url, namespace
):
    cfg = {
        "url": _data(s3fs_client, bucket),
        "storage_options": s3.storage_options(),
        "redis_url": redis_url,
        "namespace": namespace,
    }
    # 4 ranks, 2 per node, under gloo: 2 steps of 4, then the merged state.
    first = _run(cfg, 4, 4, 2, lambda r: r // 2, dist=True)
    seen = [i for res in first for i in res["ids"]]
    assert len(seen) == 4 * 8
    merged = first[0]["merged"]
    assert merged["consumed"] == [8] * 4 and merged == first[3]["merged"]
    assert merged["nodes"] == [node_ids[r // 2] for r in range(4)]

    # Shrink to 2 ranks (one per node; nodes gathered over gloo), batch 3.
    two = _run(cfg, 2, 3, 0, lambda r: r, state=merged, dist=True)
    rest = [i for res in two for i in res["ids"]]
    assert Counter(seen + rest) == Counter(range(OBJECTS))
    assert {res["batches"] for res in two} == {5}  # 14 samples each: 3,3,3,3,2
    assert all(res["moved"] == 0.0 for res in two)  # each node keeps its 14

    # Grow to 6 ranks, five on node0 and one on node1, from the per-rank list.
    nodes6 = [node_ids[0]] * 5 + [node_ids[1]]
    six = _run(
        cfg,
        6,
        5,
        0,
        lambda r: 0 if r < 5 else 1,
        state=[res["state"] for res in first],
        nodes=nodes6,
    )
    rest6 = [i for res in six for i in res["ids"]]
    assert Counter(seen + rest6) == Counter(range(OBJECTS))
    assert len({res["batches"] for res in six}) == 1  # DDP: same step count
    # node1 read 14 of the 28 left but has one rank of at most ceil(28/6) = 5:
    # at least 9 must move, and nothing else should.
    assert [res["moved"] for res in six] == [pytest.approx(9 / 28)] * 6


def test_elastic_resume_without_nodes_or_process_group_is_a_config_error(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    url = _data(s3fs_client, bucket, count=20)
    kw = dict(
        storage_options=s3.storage_options(),
        redis_url=redis_url,
        namespace=namespace,
        chunk_samples=5,
    )
    olds = [DistributedCachedDataset(url, rank=r, world_size=2, **kw) for r in (0, 1)]
    states = [ds.state_dict() for ds in olds]
    new = DistributedCachedDataset(url, rank=0, world_size=3, **kw)
    with pytest.raises(ConfigError, match="needs every new rank's node"):
        new.load_state_dict(states)
    with pytest.raises(ConfigError, match="every rank's state"):
        new.load_state_dict(states[0])


@pytest.mark.timeout(300)  # spawned DataLoader workers import torch and Ray
def test_stateful_dataloader_with_two_workers_resumes_mid_epoch_exactly(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    from torchdata.stateful_dataloader import StatefulDataLoader

    url = _data(s3fs_client, bucket, count=40)
    kw = dict(
        storage_options=s3.storage_options(),
        redis_url=redis_url,
        namespace=namespace,
        chunk_samples=5,
        seed=4,
    )

    def loader(ds):
        return StatefulDataLoader(
            ds,
            batch_size=4,
            sampler=ds.sampler,
            num_workers=2,
            collate_fn=list,
            multiprocessing_context="spawn",
            persistent_workers=True,  # one spawn for the resumed and next epoch
        )

    def ids(batch):
        return [int(t[0]) for t in batch]

    ds = DistributedCachedDataset(url, **kw)
    ds.set_epoch(1)
    first = loader(ds)
    it = iter(first)
    head = [i for _ in range(3) for i in ids(next(it))]
    saved = first.state_dict()
    rest = [i for b in it for i in ids(b)]
    assert sorted(head + rest) == list(range(40))

    # A new process would start here: a fresh dataset, no set_epoch, no
    # consumed count; only the loader's state.
    fresh = DistributedCachedDataset(url, **kw)
    resumed = loader(fresh)
    resumed.load_state_dict(saved)
    assert [i for b in resumed for i in ids(b)] == rest
    # The next epoch is whole again.
    fresh.set_epoch(2)
    assert sorted(i for b in resumed for i in ids(b)) == list(range(40))


@pytest.mark.timeout(300)  # spawned DataLoader workers import torch and Ray
def test_stateful_dataloader_with_workers_passes_one_epoch_twice(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    # torchdata asks each worker for the dataset's state_dict() when the
    # worker starts; a worker's sampler is the main process's, pickled after
    # a whole pass, and its own session read nothing: that is not the
    # "workers read ahead of the loop" case the main process refuses.
    from torchdata.stateful_dataloader import StatefulDataLoader

    url = _data(s3fs_client, bucket, count=16)
    ds = DistributedCachedDataset(
        url, storage_options=s3.storage_options(), redis_url=redis_url,
        namespace=namespace, chunk_samples=4, seed=4,
    )  # fmt: skip
    ds.set_epoch(0)
    loader = StatefulDataLoader(
        ds, batch_size=4, sampler=ds.sampler, num_workers=2, collate_fn=list,
        multiprocessing_context="spawn", persistent_workers=False,
    )  # fmt: skip
    for _ in range(2):  # the same epoch again, no set_epoch between
        assert sorted(int(t[0]) for b in loader for t in b) == list(range(16))


def test_a_peeked_sample_does_not_make_the_end_of_epoch_state_refused(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    # The workers-read check compares what the sampler handed out with what
    # this process read. A drop_last tail is handed out and never read; it
    # is less than a batch, and the batch is this epoch's, not the process's
    # first read: ds[0] (a shape check before the loop) was one sample.
    url = _data(s3fs_client, bucket, count=18)
    ds = DistributedCachedDataset(
        url, storage_options=s3.storage_options(), redis_url=redis_url,
        namespace=namespace, rank=0, world_size=1, chunk_samples=4,
    )  # fmt: skip
    assert ds[0].shape == (32,)
    ds.set_epoch(0)
    assert ds[1].shape == (32,)  # a peek inside the epoch counts 1 as well
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, drop_last=True)
    assert len(list(loader)) == 4  # 16 read, a tail of 2 handed out
    # ds[i] counts as read (it is how DataLoader(batch_size=None) delivers).
    assert ds.state_dict()["consumed"] == 17


def test_the_state_of_a_resumed_drop_last_epoch_end_is_not_refused(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    # Saved after the last full batch of a drop_last epoch, resumed: the rest
    # of the epoch is the tail alone, drawn and dropped, and this process read
    # nothing this epoch, so "a batch or more" has no batch to go by.
    url = _data(s3fs_client, bucket, count=18)

    def dataset() -> DistributedCachedDataset:
        return DistributedCachedDataset(
            url, storage_options=s3.storage_options(), redis_url=redis_url,
            namespace=namespace, rank=0, world_size=1, chunk_samples=4,
        )  # fmt: skip

    ds = dataset()
    ds.set_epoch(0)
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, drop_last=True)
    assert len(list(loader)) == 4
    state = ds.state_dict()
    assert state["consumed"] == 16
    again = dataset()
    again.load_state_dict(state)
    # The README's loop: for epoch in range(ds.sampler.epoch, N)
    again.set_epoch(again.sampler.epoch)
    loader = DataLoader(again, batch_size=4, sampler=again.sampler, drop_last=True)
    assert list(loader) == []  # the tail of 2, dropped
    assert again.state_dict()["consumed"] == 16


def test_the_state_of_an_elastic_resume_at_a_drop_last_epoch_end_is_not_refused(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    # Two ranks end a drop_last epoch with a tail of 1 each; resumed at one
    # rank, the epoch's rest is those 2 samples, under one batch: dropped.
    url = _data(s3fs_client, bucket, count=18)

    def dataset(rank: int, world: int) -> DistributedCachedDataset:
        return DistributedCachedDataset(
            url, storage_options=s3.storage_options(), redis_url=redis_url,
            namespace=namespace, rank=rank, world_size=world, chunk_samples=4,
        )  # fmt: skip

    states = []
    for rank in (0, 1):
        ds = dataset(rank, 2)
        loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, drop_last=True)
        assert len(list(loader)) == 2  # 8 of its 9
        states.append(ds.state_dict())
    merged = DistributedCachedDataset.merge_states(states)
    assert merged["batch"] == 4
    one = dataset(0, 1)
    one.load_state_dict(merged, nodes=[states[0]["node"]])
    one.set_epoch(one.sampler.epoch)
    loader = DataLoader(one, batch_size=4, sampler=one.sampler, drop_last=True)
    assert list(loader) == []  # the 2 left, under one batch
    one.state_dict()  # not refused

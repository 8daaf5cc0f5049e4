"""Real torch.distributed (gloo) ranks on two Ray nodes, and torchrun-style processes."""

from __future__ import annotations

import socket
import sys

import pytest
import ray
import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow

EPOCHS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rank(
    rank, world, port, url, storage_options, redis_url, namespace, shuffle=True
):
    """One DDP rank: 3 epochs through DistributedCachedDataset with a gloo all-reduce per step."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from shardcache import DistributedCachedDataset

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        ds = DistributedCachedDataset(
            url,
            storage_options=storage_options,
            redis_url=redis_url,
            namespace=namespace,
            shuffle=shuffle,
            seed=11,
            chunk_samples=5,  # 8 chunks: whole chunks per rank
        )
        loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, collate_fn=list)
        epochs = []
        for epoch in range(EPOCHS):
            ds.set_epoch(epoch)
            order = []
            for batch in loader:
                order += [int(t[0]) for t in batch]
                step = torch.ones(1)
                dist.all_reduce(step)  # lockstep, as a training step would be
            epochs.append(order)
        stats = ds.stats()
        locality = ds.cached_locality()
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        ds.close()
        return {
            "rank": ds.rank,
            "world": ds.world_size,
            "epochs": epochs,
            "stats": stats,
            "locality": locality,
            "node": node,
        }
    finally:
        dist.destroy_process_group()


@ray.remote(num_cpus=0)
class RankActor:
    def run(self, *args, **kwargs):
        return train_rank(*args, **kwargs)


def _data(s3fs_client, bucket, count=40):
    # Object i holds byte i, so a sample's first element names it.
    s3fs_client.pipe({f"{bucket}/d/{i:03d}.bin": bytes([i]) * 64 for i in range(count)})
    return f"s3://{bucket}/d/"


def test_ddp_ranks_on_two_nodes_read_stable_disjoint_local_shards(
    ray_cluster, node_ids, s3, s3fs_client, bucket, redis_url, namespace
):
    url = _data(s3fs_client, bucket)
    s3.reset_counts()
    port = _free_port()
    actors = [RankActor.options(resources={f"node{r}": 0.01}).remote() for r in (0, 1)]
    results = ray.get(
        [
            a.run.remote(r, 2, port, url, s3.storage_options(), redis_url, namespace)
            for r, a in enumerate(actors)
        ],
        timeout=300,
    )
    shards = [set(res["epochs"][0]) for res in results]
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(40))
    for res in results:
        assert all(
            set(e) == set(res["epochs"][0]) for e in res["epochs"]
        )  # stable shard
        assert res["epochs"][0] != res["epochs"][1]  # reshuffled within
        assert len(res["epochs"][0]) == 20
        # Each rank's shard is cached on its own node.
        assert res["locality"] == {res["node"]: 20}
    assert {res["node"] for res in results} == set(node_ids)
    assert s3.total_gets == 40  # 3 epochs, 2 ranks: each object read once


def test_ddp_global_shuffle_reads_across_nodes_once(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    url = _data(s3fs_client, bucket, count=24)
    s3.reset_counts()
    port = _free_port()
    actors = [RankActor.options(resources={f"node{r}": 0.01}).remote() for r in (0, 1)]
    results = ray.get(
        [
            a.run.remote(
                r,
                2,
                port,
                url,
                s3.storage_options(),
                redis_url,
                namespace,
                shuffle="global",
            )
            for r, a in enumerate(actors)
        ],
        timeout=300,
    )
    for e in range(EPOCHS):
        assert set(results[0]["epochs"][e]) | set(results[1]["epochs"][e]) == set(
            range(24)
        )
    assert set(results[0]["epochs"][0]) != set(
        results[0]["epochs"][1]
    )  # global reshuffle
    assert s3.total_gets == 24


def _spawned_rank(
    rank, world, port, address, url, storage_options, redis_url, namespace, out
):
    import ray as ray_mod

    ray_mod.init(address=address, log_to_driver=False, logging_level="WARNING")
    out.put(train_rank(rank, world, port, url, storage_options, redis_url, namespace))


def test_torchrun_style_processes_attach_to_cluster(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    import torch.multiprocessing as mp

    url = _data(s3fs_client, bucket, count=16)
    s3.reset_counts()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_spawned_rank,
            args=(
                r,
                2,
                port,
                ray_cluster.address,
                url,
                s3.storage_options(),
                redis_url,
                namespace,
                out,
            ),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=240) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert set(results[0]["epochs"][0]).isdisjoint(results[1]["epochs"][0])
    assert set(results[0]["epochs"][0]) | set(results[1]["epochs"][0]) == set(range(16))
    assert s3.total_gets == 16


def _train_loop(config):
    """Ray Train worker loop: ranks come from the process group Ray Train sets up."""
    from torch.utils.data import DataLoader

    from shardcache import DistributedCachedDataset

    ds = DistributedCachedDataset(
        config["url"],
        storage_options=config["storage_options"],
        redis_url=config["redis_url"],
        namespace=config["namespace"],
        seed=3,
    )
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, collate_fn=list)
    seen = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        seen.append(sorted(int(t[0]) for batch in loader for t in batch))
    import json
    from pathlib import Path

    report = {
        "rank": ds.rank,
        "world": ds.world_size,
        "epoch0": seen[0],
        "epoch1": seen[1],
        "remote_reads": ds.stats()["remote_reads"],
    }
    # Files, not ray.train.report: metrics without a checkpoint are not kept.
    Path(config["out_dir"], f"rank{ds.rank}.json").write_text(json.dumps(report))


def test_ray_train_torch_trainer_ranks_read_disjoint_stable_shards(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, tmp_path
):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    url = _data(s3fs_client, bucket, count=20)
    s3.reset_counts()
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={
            "url": url,
            "storage_options": s3.storage_options(),
            "redis_url": redis_url,
            "namespace": namespace,
            "out_dir": str(tmp_path),
        },
        scaling_config=ScalingConfig(
            num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}
        ),
        run_config=RunConfig(storage_path=str(tmp_path), name="shardcache-train"),
    )
    result = trainer.fit()
    assert result.error is None
    assert s3.total_gets == 20  # 2 epochs, 2 ranks: each object read once
    import json

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    assert all(r["epoch0"] == r["epoch1"] for r in ranks)  # stable shard across epochs
    assert set(ranks[0]["epoch0"]).isdisjoint(ranks[1]["epoch0"])
    assert set(ranks[0]["epoch0"]) | set(ranks[1]["epoch0"]) == set(range(20))

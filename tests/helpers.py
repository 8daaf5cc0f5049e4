"""Test helpers: Ray actors placed on given nodes (pickled by value), dataset setup."""

from __future__ import annotations

import sys

import ray
import ray.cloudpickle

from shardcache.client import CacheClient
from shardcache.config import ClientConfig

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0, max_concurrency=64)
class Reader:
    """A process on one node with many threads reading through the cache."""

    def __init__(self, redis_url: str, namespace: str):
        self.client = CacheClient(
            ClientConfig(redis_url=redis_url, namespace=namespace)
        )

    def register(self, spec, preprocess):
        self.client.register(spec, preprocess)

    def read(self, name, generation, items):
        results = self.client.get_refs(name, generation, items)
        values = ray.get([ref for _, ref in results])
        return [status for status, _ in results], [bytes(v) for v in values]

    def node(self):
        return ray.get_runtime_context().get_node_id()


def register_dataset(
    s3, prefix: str, redis_url: str, namespace: str, preprocess=None, name="ds"
):
    """List ``prefix`` and register it in the index; returns (index, spec, items)."""
    from shardcache.decoders import raw_bytes
    from shardcache.fingerprint import fingerprint
    from shardcache.index import RedisIndex
    from shardcache.source import list_source

    preprocess = preprocess or raw_bytes
    manifest = list_source(prefix, s3.storage_options())
    index = RedisIndex.from_url(redis_url, namespace)
    total = sum(o.size for o in manifest.objects)
    gen = index.register(name, prefix, fingerprint(preprocess), len(manifest), total)
    spec = {
        "name": name,
        "protocol": "s3",
        "storage_options": s3.storage_options(),
        "fingerprint": fingerprint(preprocess),
        "generation": gen,
    }
    return index, spec, [(o.url, o.etag, o.size) for o in manifest.objects]


@ray.remote(num_cpus=0)
class SoakRank:
    """One DDP rank that checks every sample against the source bytes."""

    def run(self, rank, world, port, cfg):
        import os

        import torch
        import torch.distributed as dist
        from torch.utils.data import DataLoader

        from shardcache import DistributedCachedDataset
        from shardcache.index import RedisIndex

        if rank in cfg["hold_nothing"]:  # these ranks ask the store every batch
            os.environ["SHARDCACHE_HOLD_BYTES"] = "0"
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        try:
            ds = DistributedCachedDataset(
                cfg["url"],
                storage_options=cfg["storage_options"],
                redis_url=cfg["redis_url"],
                namespace=cfg["namespace"],
                name="soak",
                seed=1,
            )
            loader = DataLoader(ds, batch_size=4, sampler=ds.sampler, collate_fn=list)
            bad, read, generations = 0, 0, []
            for epoch in range(cfg["epochs"]):
                if epoch in cfg["invalidate_before"] and rank == 0:
                    ds.invalidate()  # a new generation between epochs
                dist.barrier()
                ds.set_epoch(epoch)
                seen = set()
                for step, batch in enumerate(loader):
                    for t in batch:
                        # object i holds byte i, 64 times: every byte must match
                        bad += int(not bool((t == t[0]).all()) or t.numel() != 64)
                        read += 1
                    seen.add(ds.generation)
                    if epoch in cfg["invalidate_during"] and rank == 0 and step == 1:
                        # as the CLI would: from outside, while every rank reads
                        index = RedisIndex.from_url(cfg["redis_url"], cfg["namespace"])
                        index.invalidate("soak")
                    dist.all_reduce(torch.ones(1))
                generations.append(sorted(seen))
            ds.close()
            return {"bad": bad, "read": read, "generations": generations}
        finally:
            dist.destroy_process_group()

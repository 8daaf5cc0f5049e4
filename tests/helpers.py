"""Test helpers: Ray actors placed on given nodes (pickled by value), dataset setup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ray
import ray.cloudpickle

from shardcache.config import ClientConfig
from shardcache.transport.direct import CacheClient

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0, max_concurrency=64)
class Reader:
    """A process on one node with many threads reading through the cache."""

    def __init__(self, redis_url: str, namespace: str):
        self.client = CacheClient(
            ClientConfig(redis_url=redis_url, namespace=namespace)
        )

    def install(self, spec, preprocess):
        self.client.install(spec, preprocess)

    def read(self, name, generation, items, digest=None):
        results = self.client.get_refs(name, generation, items, digest)
        values = ray.get([ref for _, ref in results])
        return [status for status, _ in results], [chunk_bytes(v) for v in values]

    def node(self):
        return ray.get_runtime_context().get_node_id()

    def refresh(self, spec, token):
        """A rank's ``refresh()``: a new listing; returns (chunk items, digest)."""
        from shardcache.manifest import Manifest

        ref, digest = self.client.manifest(spec, token)
        manifest = Manifest.from_object(ray.get(ref))
        return manifest.chunk_items(range(len(manifest.layout))), digest


def chunk_bytes(columns) -> bytes:
    """Every sample of a chunk, concatenated (tests store raw bytes)."""
    from shardcache.chunks import Chunk

    chunk = Chunk(columns)
    return b"".join(bytes(chunk.sample(r)) for r in range(len(chunk)))


def register_dataset(
    s3,
    prefix: str,
    redis_url: str,
    namespace: str,
    preprocess=None,
    name="ds",
    chunk_samples=1,
):
    """List ``prefix`` and register it in the index; returns (index, spec, items).

    ``items`` are the chunk items a rank would send: ``(chunk key, version,
    source bytes)``; with the default ``chunk_samples=1`` chunk ``i`` is
    object ``i``, so per-object expectations read directly.
    """
    from shardcache.decoders import raw_bytes
    from shardcache.fingerprint import fingerprint
    from shardcache_server.index import ClusterIndex
    from shardcache_server.listing import list_with_layout

    preprocess = preprocess or raw_bytes
    spec = {
        "name": name,
        "urls": prefix,
        "protocol": "s3",
        "storage_options": s3.storage_options(),
        "chunk_samples": chunk_samples,
        "fingerprint": fingerprint(preprocess),
    }
    manifest = list_with_layout(spec, None)
    index = ClusterIndex.from_url(redis_url, namespace)
    gen = index.register(
        name, prefix, fingerprint(preprocess), len(manifest), manifest.total_bytes
    )
    spec.update(generation=gen, manifest=manifest.digest)
    return index, spec, manifest.chunk_items(range(len(manifest.layout)))


def local_build(settings):
    """A ``CacheShard(build=...)`` that builds chunks in a thread of this process."""
    import asyncio

    from shardcache_server.builder import build_request

    async def build(req):
        return await asyncio.to_thread(build_request, settings, req)

    return build


def local_shard(settings, node: str = "node-a"):
    """A ``CacheShard`` in this process: chunks built in its threads, values
    passed as they are (no object store), no peers."""
    from shardcache_server.store import CacheShard

    return CacheShard(
        settings, node, put=lambda v: v, get=lambda v: v, peer=lambda n: None,
        build=local_build(settings),
    )  # fmt: skip


def view(result):
    """A store result as a test reads it: ``(status, first sample)``, or the
    ``("error", class, message)`` of a failed member / failed chunk."""
    from shardcache.chunks import Chunk

    if result[0] not in ("hit", "fetched", "uncached", "remote-hit"):
        return result
    chunk = Chunk(result[1])
    if chunk.failed[0]:
        return ("error", *chunk.error(0))
    return (result[0], chunk.sample(0))


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
                chunk_samples=12,  # one whole chunk per rank: 96 objects, 8 ranks
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


def cached_samples(index, name, generation):
    """Samples the index says are cached (entries are per chunk)."""
    return sum(
        int(e.get("samples", 0)) for e in index.entries(name, generation).values()
    )


def self_signed_certificate(cert: Path, key: Path) -> tuple[Path, Path]:
    """A one-day certificate for 127.0.0.1 (``CN=localhost``) and its key, by openssl."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key

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

"""Ray actors the tests place on specific nodes (pickled by value into workers)."""

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

"""The store as a Ray actor: the only ``ray.remote`` of the store.

Ownership rule: everything that needs Ray to run a store lives here
(``ray.put``, awaitable ObjectRefs, peers by actor name, builds on the
node's build actors and listings as tasks pinned to the node);
``RayCacheShard`` passes them into the plain ``CacheShard``, which tests
drive without Ray.
"""

from __future__ import annotations

import functools
from typing import Any

from shardcache.errors import ConfigError
from shardcache_server.builder import BuildRequest, RayChunkBuilder
from shardcache_server.listing import Listed, PrefixSink, RayLister, listing_budget
from shardcache_server.settings import ServiceSettings
from shardcache_server.store.shard import CacheShard

__all__ = ["RayCacheShard", "ray_namespace", "start_shard", "store_name"]


def store_name(node_id: str) -> str:
    return f"store-{node_id}"


def ray_namespace(ns: str) -> str:
    return f"shardcache-{ns}"


class RayCacheShard(CacheShard):
    """A :class:`CacheShard` wired to Ray; ``start_shard`` makes it an actor.

    Args:
        settings: the service settings, as ``model_dump()`` (Ray pickles it).
        node_id: the Ray node this store serves (and is pinned to).
    """

    def __init__(self, settings: dict[str, Any] | ServiceSettings, node_id: str):
        settings = (
            settings
            if isinstance(settings, ServiceSettings)
            else ServiceSettings(**settings)
        )
        # Made at the first call, not here: it starts the node's build workers.
        self._builder: RayChunkBuilder | None = None
        super().__init__(
            settings,
            node_id,
            put=_ray_put,
            get=_awaitable_ref,
            peer=functools.partial(_ray_peer, settings.namespace),
            build=self._build_on_node,
            lister=self._list_on_node,
        )

    def _ensure_started(self) -> None:
        if self._builder is None:
            self._builder = RayChunkBuilder(
                self.settings,
                self.node_id,
                _build_workers(self.settings, self.node_id),
                ray_namespace(self.settings.namespace),
            )
        super()._ensure_started()

    async def _build_on_node(self, req: BuildRequest) -> tuple[Any, dict[str, Any]]:
        assert self._builder is not None
        return await self._builder.build(req)

    async def _list_on_node(
        self,
        spec: dict[str, Any],
        previous: Any,
        room_bytes: int,
        on_prefix: PrefixSink | None = None,
    ) -> Listed:
        lister = RayLister(
            self.node_id, listing_budget(self.settings), self.settings.stream_after_s
        )
        return await lister(spec, previous, room_bytes, on_prefix)


def start_shard(settings: ServiceSettings, node_id: str) -> Any:
    """Start (or find) the detached store actor pinned to ``node_id``.

    Raises:
        ConfigError: the settings are invalid.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not node_id:
        raise ConfigError("node_id must be a Ray node id hex string.")
    actor_cls = ray.remote(RayCacheShard)
    return actor_cls.options(
        name=store_name(node_id),
        namespace=ray_namespace(settings.namespace),
        lifetime="detached",
        get_if_exists=True,
        max_restarts=settings.max_restarts,
        max_concurrency=1000,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(settings.model_dump(), node_id)


def _ray_put(value: Any) -> Any:
    import ray

    return ray.put(value)


def _awaitable_ref(ref: Any) -> Any:
    return ref  # an ObjectRef is awaitable inside the async actor


def _build_workers(settings: ServiceSettings, node_id: str) -> int:
    """Chunk builds in flight: the setting, else the node's CPUs."""
    if settings.build_workers:
        return settings.build_workers
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return max(1, int(node.get("Resources", {}).get("CPU", 1)))
    return 1


def _ray_peer(ns: str, node_id: str) -> Any:
    import ray

    # A store pinned (soft=False) to a node that left the cluster can never be
    # rescheduled: calling it would hang, so a dead node means "no peer".
    if not any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
        return None
    try:
        return ray.get_actor(store_name(node_id), namespace=ray_namespace(ns))
    except ValueError:
        return None

"""Find or start the store actors: one per alive Ray node."""

from __future__ import annotations

import time
from typing import Any

from shardcache.errors import ShardUnavailable
from shardcache_server.settings import ServiceSettings
from shardcache_server.store import ray_namespace, start_shard, store_name

__all__ = [
    "alive_nodes",
    "ensure_stores",
    "ensure_stores_for",
    "kill_stores",
    "store_for_node",
]

STORE_START_TIMEOUT_S = 120.0  # a fresh worker process on a loaded 2-core node
RESTART_POLL_S = 0.5  # how often to re-ping a store that Ray is restarting


def alive_nodes() -> list[str]:
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def ensure_stores(settings: ServiceSettings, *, wait: bool = True) -> dict[str, Any]:
    """Start a store on every alive node that has none; return node -> handle.

    Raises:
        ShardUnavailable: a store did not come up in time.
    """
    import ray

    handles = {node: start_shard(settings, node) for node in alive_nodes()}
    if not wait:
        return handles
    deadline = time.monotonic() + STORE_START_TIMEOUT_S
    pending = dict(handles)
    while pending:
        node, handle = next(iter(pending.items()))
        try:
            ray.get(handle.ping.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            del pending[node]
        except ray.exceptions.ActorUnavailableError as exc:
            # Restarting after a crash (max_restarts): wait for it, not fail.
            if time.monotonic() > deadline:
                raise _not_started(exc) from exc
            time.sleep(RESTART_POLL_S)
        except ray.exceptions.RayError as exc:
            raise _not_started(exc) from exc
    return handles


def ensure_stores_for(redis_url: str, namespace: str) -> dict[str, Any]:
    """:func:`ensure_stores` for a rank's ``redis_url`` and ``namespace``, the
    rest of the settings from ``SHARDCACHE_*``: the sdk's start hook
    (``shardcache.starters``), which passes no cluster-side types.

    Raises:
        ShardUnavailable: a store did not come up in time.
    """
    return ensure_stores(ServiceSettings(redis_url=redis_url, namespace=namespace))


def _not_started(exc: BaseException) -> ShardUnavailable:
    return ShardUnavailable(
        f"cache stores did not start within {STORE_START_TIMEOUT_S:.0f}s: "
        f"{type(exc).__name__}. Check `ray status` and the store logs."
    )


def store_for_node(namespace: str, node_id: str) -> Any | None:
    import ray

    try:
        return ray.get_actor(store_name(node_id), namespace=ray_namespace(namespace))
    except ValueError:
        return None


def kill_stores(namespace: str) -> int:
    """Kill every store of a deployment (tests, ``shardcache local stop``)."""
    import ray

    killed = 0
    for node in alive_nodes():
        handle = store_for_node(namespace, node)
        if handle is not None:
            ray.kill(handle, no_restart=True)
            killed += 1
    return killed

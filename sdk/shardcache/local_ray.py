"""The embedded Ray head: private to one user, on loopback, found by our own state.

Three decisions, each against a failure a user met:

- **Found through ``<state dir>/ray.json``, never ``address="auto"``.** "auto"
  joins whatever Ray cluster runs on the machine, another user's included.
  The head shardcache starts is recorded in its state dir, and only that head
  is joined; joining another cluster is explicit (``ray_address=`` or
  ``RAY_ADDRESS``, see ``embedded.attach_ray``).
- **Token auth with a token of our own.** Ray 2.60 turns token auth on for
  ``ray start --head`` whenever ``~/.ray/auth_token`` exists (any local
  ``ray.init()`` writes it), but a driver that joins with an explicit address
  sends no token unless ``RAY_AUTH_MODE=token`` is set in it, so the first
  script after the demo failed with ``InvalidAuthToken``; with no token file
  the head ran with auth off. The head now always runs with
  ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` naming a 0600 token in
  the state dir, and the driver sets the same two before it joins. An explicit
  mode also silences Ray's "token authentication is enabled/disabled" warning,
  for this path only.
- **Loopback only.** Ray rewrites ``--node-ip-address=127.0.0.1`` (and a
  driver's ``127.0.0.1:port``) to the host's address unless
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (its "this machine only" switch);
  with it, GCS, raylet, object manager, agents, workers and the driver listen
  on 127.0.0.1 and record it. The dashboard is off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardcache.errors import ConfigError, ShardUnavailable
from shardcache.processes import (
    cmdline,
    processes_holding,
    processes_marked,
    processes_naming,
    terminate,
)

__all__ = [
    "HEAD_MARKER",
    "head_environment",
    "head_processes",
    "join_local_head",
    "ray_temp_dir",
    "recorded_address",
    "running_head",
    "start_head",
    "stop_head",
    "use_token_file",
    "write_token",
]

HEAD_MARKER = "SHARDCACHE_RAY_TEMP_DIR"  # in the env of every process of our head
LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps to 127.0.0.1
# How long `ray start --head` may take (a loaded node starts it slowly);
# SHARDCACHE_RAY_START_TIMEOUT_S sets it.
RAY_START_TIMEOUT_S = 120.0
RAY_TEMP_DIR_MAX_CHARS = 40  # session and socket names add ~65 of Ray's 107 bytes
PROBE_TIMEOUT_S = 0.5  # a TCP connect to our own loopback GCS
# ray.json's "format": 2 = token auth with our token, loopback; 3 = started
# without the launching job's variables (head_environment). A head of an
# older format is replaced by the next script, not joined: a format-2 head
# a torchrun job started keeps that job's TORCHELASTIC_* for good.
HEAD_FORMAT = 3


def ray_temp_dir(home: Path) -> Path:
    """The temp dir of the head shardcache starts under state dir ``home``.

    Ray makes its temp dir world-writable and keeps unauthenticated Unix
    sockets there (the object store's), so it always sits inside a 0700
    directory of ours: the state dir, or, when that path is too long for Ray's
    107-byte socket paths, a short one under /tmp (one per state dir: two
    HOMEs never share).

    Raises:
        ShardUnavailable: that /tmp directory exists but is not this user's.
    """
    own = home / "ray"
    if len(str(own)) <= RAY_TEMP_DIR_MAX_CHARS:
        return own
    digest = hashlib.sha256(str(home).encode()).hexdigest()[:10]
    parent = Path(tempfile.gettempdir()) / f"shardcache-{digest}"
    parent.mkdir(mode=0o700, exist_ok=True)
    info = parent.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ShardUnavailable(
            f"{parent} is not a private directory of this user (owner uid "
            f"{info.st_uid}, mode {info.st_mode & 0o777:o}); remove it, or set "
            "SHARDCACHE_HOME to a shorter path."
        )
    return parent / "ray"


def _token_path(home: Path) -> Path:
    return write_token(home / "ray_token")


def _token_digest(home: Path) -> str:
    return hashlib.sha256(_token_path(home).read_bytes()).hexdigest()


def write_token(path: Path) -> Path:
    """A Ray token at ``path``, created once, 0600 (O_EXCL: two ranks never
    both write it); returns ``path``."""
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def _recorded(home: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((home / "ray.json").read_text()))
    except (OSError, ValueError):
        return {}


def recorded_address(home: Path) -> str | None:
    """The address of the head recorded under ``home``, alive or not."""
    address = _recorded(home).get("address")
    return str(address) if address else None


def head_processes(home: Path) -> list[int]:
    """Every live process of the head started under ``home``: those carrying the
    marker, those whose command line names the temp dir (a head started by an
    older shardcache carried no marker), and those holding a file open under it
    (the runtime env agent, whose environment Ray scrubs)."""
    temp_dir = str(_recorded(home).get("temp_dir") or ray_temp_dir(home))
    return sorted(
        set(processes_marked(HEAD_MARKER, temp_dir))
        | set(processes_naming(temp_dir))
        | set(processes_holding(temp_dir))
    )


def running_head(home: Path) -> str | None:
    """The address of our recorded head when its GCS is up, else ``None``."""
    recorded = _recorded(home)
    address, temp_dir = recorded.get("address"), recorded.get("temp_dir")
    if not address or not temp_dir or recorded.get("format") != HEAD_FORMAT:
        # An older shardcache's head (auth off or ~/.ray's token, the host's
        # address) is not joined: start_head replaces it.
        return None
    if recorded.get("token_sha256") != _token_digest(home):
        # The token file was removed or rewritten since the head started: a
        # join would retry InvalidAuthToken for ~24 s and fail. Replace it.
        return None
    if not any("gcs_server" in cmdline(p) for p in processes_naming(str(temp_dir))):
        return None  # a reused port must not pass for our head
    host, _, port = str(address).rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            return str(address)
    except (OSError, ValueError):
        return None


# What the process that starts the head got from its own launcher, which the
# head must not keep: the head, its raylet and every worker and store actor it
# starts inherit this environment and outlive the job. torchrun's variables
# are the dangerous ones: a Ray Train worker that sees
# TORCHELASTIC_USE_AGENT_STORE=True assumes an agent hosts its rendezvous
# store, never starts one, and every later TorchTrainer hangs in
# init_process_group; RANK / WORLD_SIZE / MASTER_* would be another job's.
_JOB_VARIABLES = frozenset(
    {
        "RAY_ADDRESS",  # some other cluster's
        "RAY_AUTH_TOKEN",  # would win over our token file: some other cluster's
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
        "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "PYTHON_EXEC",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)  # fmt: skip
_JOB_PREFIXES = ("TORCHELASTIC_",)


def head_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment ``ray start --head`` gets: the caller's, less what
    belongs to the job that happens to start it (``_JOB_VARIABLES``). Under
    torchrun, also its ``OMP_NUM_THREADS=1`` (torchrun sets it for its
    ranks; the head's build workers are not ranks)."""
    launched_by_torchrun = "TORCHELASTIC_RUN_ID" in environ
    return {
        k: v
        for k, v in environ.items()
        if k not in _JOB_VARIABLES
        and not k.startswith(_JOB_PREFIXES)
        and not (launched_by_torchrun and k == "OMP_NUM_THREADS")
    }


def start_head(home: Path) -> str:
    """``ray start --head`` on loopback with our token and marker; returns its
    address and records it in ``ray.json``. Leftovers of an earlier head under
    the same temp dir (a half-dead one) are stopped first.

    Raises:
        ShardUnavailable: ``ray start`` failed.
    """
    temp_dir = ray_temp_dir(home)
    terminate(head_processes(home))
    env = head_environment(os.environ)
    env.update(_auth_env(home))
    env.update({
        LOCAL_ONLY: "0",
        HEAD_MARKER: str(temp_dir),
        "RAY_USAGE_STATS_ENABLED": "0",
    })  # fmt: skip
    cmd = [
        str(Path(sys.executable).parent / "ray"), "start", "--head",
        "--node-ip-address=127.0.0.1", "--include-dashboard=false",
        "--disable-usage-stats", f"--temp-dir={temp_dir}",
        "--port=0",  # never the default 6379 another Ray on the machine may hold
    ]  # fmt: skip
    timeout_s = _start_timeout_s()
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except subprocess.TimeoutExpired:
        terminate(head_processes(home))  # what it started so far serves nobody
        raise ShardUnavailable(
            f"`ray start --head` did not finish within {timeout_s:.0f} s (a busy "
            f"machine starts it slowly: set SHARDCACHE_RAY_START_TIMEOUT_S to "
            f"wait longer). Its logs are under {temp_dir}."
        ) from None
    if done.returncode != 0:
        terminate(head_processes(home))
        raise ShardUnavailable(
            f"`ray start --head` failed: {done.stderr.strip()[-500:]}. "
            f"Its logs are under {temp_dir}."
        )
    # With --temp-dir, Ray records the head's address there, not in /tmp/ray.
    address = (temp_dir / "ray_current_cluster").read_text().strip()
    state = {
        "format": HEAD_FORMAT,
        "started": time.time(),
        "temp_dir": str(temp_dir),
        "address": address,
        "token_sha256": _token_digest(home),
    }
    fd = os.open(home / "ray.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    return address


def _start_timeout_s() -> float:
    """``SHARDCACHE_RAY_START_TIMEOUT_S``, else ``RAY_START_TIMEOUT_S``."""
    raw = os.environ.get("SHARDCACHE_RAY_START_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else RAY_START_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"SHARDCACHE_RAY_START_TIMEOUT_S must be a number of seconds > 0, "
            f"got {raw!r}."
        )
    return value


def _auth_env(home: Path) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(_token_path(home))}


def use_token_file(token_file: Path) -> None:
    """Make this process, and the processes it starts, use Ray token auth with
    the token in ``token_file`` (a private cluster's: ours, or the demo's).

    Ray reads the auth mode and token once and caches them (``RayConfig``, the
    C++ token loader), and this process may have imported ray long before, so
    both are refreshed here, as Ray's own ``_enable_token_auth`` does.
    ``RAY_AUTH_TOKEN`` would win over the file; it belongs to some other
    cluster, so it goes. An explicit mode also keeps Ray from warning that it
    turned token auth on (or off) by itself.
    """
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def join_local_head(home: Path, address: str, **init_kwargs: Any) -> None:
    """``ray.init`` this process into our head at ``address``, with our token
    and kept to loopback.

    Raises:
        ShardUnavailable: the head refused or did not answer.
    """
    import ray
    from ray._private import ray_constants

    use_token_file(_token_path(home))
    # Read at import time from LOCAL_ONLY; without it Ray turns our
    # "127.0.0.1:port" into the host's address and the connect times out.
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address=address, **init_kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ShardUnavailable(
            f"cannot join the embedded Ray head at {address}: {exc}. "
            "`shardcache local stop` stops it; the next script starts a new one."
        ) from exc


def stop_head(home: Path) -> str | None:
    """Stop every process of our head and forget it; a line saying what was
    stopped, or ``None`` when nothing of it was recorded or running."""
    recorded = (home / "ray.json").exists()
    pids = terminate(head_processes(home))
    (home / "ray.json").unlink(missing_ok=True)
    if not recorded and not pids:
        return None
    temp_dir = _recorded(home).get("temp_dir") or ray_temp_dir(home)
    return f"ray ({len(pids)} processes under {temp_dir})"

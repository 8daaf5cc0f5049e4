"""``shardcache local stop`` stops what shardcache started, and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardcache import embedded, local_ray, processes
from shardcache.errors import ConfigError, ShardUnavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # two Ray heads start


def test_local_stop_stops_only_the_ray_head_and_redis_shardcache_started(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SHARDCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Started from a torchrun rank, as the README's first script is: the head
    # outlives that job and must not keep its variables (a later Ray Train
    # worker seeing TORCHELASTIC_USE_AGENT_STORE=True never starts its store).
    torchrun_env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "none",
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    for k, v in {**torchrun_env, "SC_USER_SETTING": "kept"}.items():
        monkeypatch.setenv(k, v)
    # Someone else's Ray head on the same machine (a temp dir of its own).
    foreign = Path(f"/tmp/sc-foreign-{uuid.uuid4().hex[:8]}")
    ray_bin = Path(sys.executable).parent / "ray"
    subprocess.run(
        [str(ray_bin), "start", "--head", "--node-ip-address=127.0.0.1",
         "--include-dashboard=false", "--disable-usage-stats", "--port=0",
         f"--temp-dir={foreign}"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        home = embedded.state_dir()
        address = local_ray.start_head(home)
        redis_url = embedded.local_redis_url()
        ours = local_ray.head_processes(home)
        theirs = processes.processes_naming(str(foreign))
        assert address and ours and theirs and not set(ours) & set(theirs)
        (raylet,) = [p for p in ours if processes.cmdline(p).split(" ")[0].endswith("raylet")]
        head_env = dict(
            item.split("=", 1)
            for item in Path(f"/proc/{raylet}/environ").read_text().split("\0")
            if "=" in item
        )
        assert not set(torchrun_env) & set(head_env), set(torchrun_env) & set(head_env)
        assert head_env["SC_USER_SETTING"] == "kept"
        # A long state dir gets a short Ray temp dir (socket paths fit 107 bytes)
        # inside a private directory (Ray makes the temp dir itself 0777).
        temp_dir = local_ray.ray_temp_dir(home)
        assert len(str(temp_dir)) <= 40
        assert temp_dir.parent.stat().st_mode & 0o077 == 0

        t0 = time.monotonic()
        stopped = embedded.stop_local()
        stop_s = time.monotonic() - t0

        assert any(s.startswith("redis") for s in stopped), stopped
        assert any(s.startswith("ray (") for s in stopped), stopped
        assert not embedded._redis_alive(redis_url)
        assert not [p for p in ours if _alive(p)]
        assert all(_alive(p) for p in theirs)  # never every Ray process
        assert embedded.stop_local() == []  # nothing left of ours
        assert stop_s < 3.0, stop_s
    finally:
        processes.terminate(processes.processes_naming(str(foreign)))


def test_the_embedded_redis_keeps_no_password_file_once_it_answers(tmp_path):
    import redis

    proc, url = embedded.start_redis_server(tmp_path, password="pw-in-a-file")
    try:
        assert list(tmp_path.glob("redis-*.conf")) == []  # read at start-up only
        assert redis.Redis.from_url(url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url.replace(":pw-in-a-file@", "")).get("x")
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _alive(pid: int) -> bool:
    return processes.is_alive(pid)


def test_running_head_ignores_a_head_recorded_by_an_older_shardcache(
    tmp_path, monkeypatch
):
    # An older head ran without our token (or with ~/.ray's) on the host's
    # address: it is never joined; start_head replaces it.
    monkeypatch.setenv("SHARDCACHE_HOME", str(tmp_path / "home"))
    home = embedded.state_dir()
    (home / "ray.json").write_text(
        json.dumps({"temp_dir": str(tmp_path), "address": "127.0.0.1:1"})
    )
    assert local_ray.running_head(home) is None


def test_running_head_ignores_a_head_started_with_another_token(tmp_path, monkeypatch):
    # Joining would retry InvalidAuthToken for ~24 s: the head is replaced.
    monkeypatch.setenv("SHARDCACHE_HOME", str(tmp_path / "home"))
    home = embedded.state_dir()
    (home / "ray.json").write_text(
        json.dumps({
            "format": local_ray.HEAD_FORMAT, "temp_dir": str(tmp_path),
            "address": "127.0.0.1:1", "token_sha256": "0" * 64,
        })
    )  # fmt: skip
    assert local_ray.running_head(home) is None


def test_a_ray_head_that_starts_too_slowly_is_stopped_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    home = embedded.state_dir()
    # A machine too busy to start Ray in time, stood in for by a short limit.
    monkeypatch.setenv("SHARDCACHE_RAY_START_TIMEOUT_S", "0.5")
    with pytest.raises(ShardUnavailable, match="SHARDCACHE_RAY_START_TIMEOUT_S"):
        local_ray.start_head(home)
    deadline = time.monotonic() + 30
    while local_ray.head_processes(home) and time.monotonic() < deadline:
        time.sleep(0.2)  # `ray start` exits on its own once its child is killed
    assert local_ray.head_processes(home) == []
    monkeypatch.setenv("SHARDCACHE_RAY_START_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="SHARDCACHE_RAY_START_TIMEOUT_S"):
        local_ray.start_head(home)


def test_a_ray_address_where_nothing_listens_fails_fast_and_named(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "from shardcache.embedded import attach_ray\n"
        f"attach_ray('127.0.0.1:{port}')\n"
    )
    # Ray alone retries such an address for minutes (a hang, caught by the
    # timeout); with the probe it is an error at once.
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("shardcache.errors.ShardUnavailable: nothing answers at")
    assert f"127.0.0.1:{port}" in last

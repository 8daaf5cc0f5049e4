"""Real local servers, session-scoped: redis-server, moto's S3 over HTTP, a 2-node Ray cluster."""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# Keep every Ray socket on loopback: Ray otherwise advertises the host's
# interface address, and tests talk only to 127.0.0.1. Must precede `import ray`.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from shardcache.embedded import start_redis_server
from shardcache_server.emulator import FaultPlan, S3Emulator

OBJECT_STORE_BYTES = 120 * 2**20  # per node: small, so two nodes fit in CI


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis-url",
        default=None,
        help="reuse an external Redis instead of starting one",
    )


@pytest.fixture(scope="session")
def redis_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    external = request.config.getoption("--redis-url")
    if external:
        yield external
        return
    proc, url = start_redis_server(
        tmp_path_factory.mktemp("redis"), password="test-" + uuid.uuid4().hex
    )
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session", autouse=True)
def _private_state_dir(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Tests never touch the real ``~/.cache/shardcache``: whatever falls back
    to the embedded defaults (a spawned worker, a subprocess that inherits
    this environment) starts them in a temp state dir, stopped at the end.
    Tests that need a state dir of their own still set ``SHARDCACHE_HOME``."""
    from shardcache.embedded import stop_local

    patch = pytest.MonkeyPatch()
    patch.setenv("SHARDCACHE_HOME", str(tmp_path_factory.mktemp("state")))
    yield
    stop_local()
    patch.undo()


@pytest.fixture
def redis(redis_url: str) -> Iterator[Any]:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Emulator]:
    emu = S3Emulator().start()
    yield emu
    emu.stop()


@pytest.fixture(autouse=True)
def _s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fake credentials so nothing ever reaches a real account.
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def s3(s3_server: S3Emulator) -> Iterator[S3Emulator]:
    """The emulator with counters and faults reset for this test."""
    import s3fs

    s3_server.reset_counts()
    s3_server.set_faults(FaultPlan())
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3_server
    s3_server.set_faults(FaultPlan())


@pytest.fixture
def s3fs_client(s3: S3Emulator) -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())


@pytest.fixture
def bucket(s3fs_client: Any) -> str:
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3fs_client.mkdir(name)
    return name


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two Ray nodes on 127.0.0.1 (token authentication on, as Ray 2.60 defaults)."""
    import ray

    from shardcache.embedded import start_loopback_cluster

    cluster = start_loopback_cluster(2, OBJECT_STORE_BYTES)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh deployment namespace; its store actors are killed afterwards."""
    ns = f"t{uuid.uuid4().hex[:10]}"
    yield ns
    if "ray_cluster" in request.fixturenames:
        from shardcache_server.cluster import kill_stores

        kill_stores(ns)


@pytest.fixture
def node_ids(ray_cluster: Any) -> list[str]:
    """[head node id, worker node id]."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    by_res = {
        ("node0" if "node0" in n["Resources"] else "node1"): n["NodeID"] for n in nodes
    }
    return [by_res["node0"], by_res["node1"]]


@pytest.fixture(autouse=True)
def _destroy_process_group() -> Iterator[None]:
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


# The chart ships an example training script; chart tests load it from there.
EXAMPLE = (
    Path(__file__).resolve().parents[1] / "helm" / "shardcache" / "examples"
) / "ray_train.py"


@pytest.fixture(scope="session")
def ray_train_example() -> ModuleType:
    """helm/shardcache/examples/ray_train.py as a module."""
    import ray.cloudpickle

    spec = importlib.util.spec_from_file_location(
        "shardcache_ray_train_example", EXAMPLE
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # Submitted as a job the script is __main__ and pickled by value; imported
    # here, its functions must be too, since Ray workers cannot import the file.
    ray.cloudpickle.register_pickle_by_value(module)
    return module

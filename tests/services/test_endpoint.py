"""Issue 18: training pods outside Ray read through the cache worker of their node.

Simulated pods on one machine, all real components: the cache worker (a Ray
node plus the endpoint driving it, ``endpoint_worker.py``) runs in a mount
namespace of its own with its socket on a "hostPath" directory and its chunk
files in a tmpfs of its own; the training pod (two spawned gloo ranks,
``endpoint_job.py``) runs in a second mount namespace that sees only that
directory (at ``/mnt``) and has no ``/tmp`` of the host (no Ray session
directory), and in a network namespace of its own, so it cannot reach Redis
or the S3 server: everything goes through the socket. A pod on another node
reads over the TCP stream and over Arrow Flight, both with TLS and the token.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardcache.embedded import free_port
from shardcache.usage import UsageReader

from helpers import self_signed_certificate

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
OBJECTS = 16
CHUNK = 2  # samples per chunk (chunk_samples)
TOKEN = "flight-" + uuid.uuid4().hex

pytestmark = [
    pytest.mark.slow,
    # A Ray node and subprocess ranks on a 2-core machine shared with others:
    # the default 120 s is for one process, not for a simulated node.
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="needs root and unshare(1) for mount and network namespaces",
    ),
]


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHARDCACHE_", "RAY_", "AWS_"))
    }
    env["PYTHONPATH"] = f"{ROOT / 'sdk'}:{ROOT / 'services'}"
    env.update(extra)
    return env


def _pod(
    script: str,
    *args: str,
    hostpath: Path | None,
    own_net: bool,
    env: dict,
    results: Path | None = None,
):
    """Run ``script`` in a fresh mount namespace: the hostPath (if any)
    read-only at /mnt as the chart mounts it, a results directory at /srv, a
    private /tmp; with ``own_net`` also a network namespace with only loopback
    (up, for the ranks' gloo rendezvous)."""
    steps = []
    if own_net:
        steps.append("ip link set lo up")
    if hostpath is not None:
        steps += [f"mount --bind {hostpath} /mnt", "mount -o remount,bind,ro /mnt"]
    if results is not None:
        steps.append(f"mount --bind {results} /srv")
    steps += [*_private_tmp(), 'exec "$0" "$@"']
    flags = ["-m", "--propagation", "private"] + (["-n"] if own_net else [])
    return (
        ["unshare", *flags, "sh", "-c", " && ".join(steps)],
        [
            sys.executable,
            *(script.split() if script.startswith("-m ") else [str(HERE / script)]),
            *args,
        ],
        env,
    )


def _private_tmp() -> list[str]:
    """Shell steps that give the namespace an empty /tmp (no Ray session
    directory of the host) while keeping this checkout, with its .venv,
    visible when it lives under /tmp itself (CI clones there): it is bound
    aside on a private tmpfs first, then back at its own path."""
    repo = str(HERE.parents[1])
    if not (repo + "/").startswith("/tmp/"):
        return ["mount -t tmpfs tmpfs /tmp"]
    return [
        "mount -t tmpfs tmpfs /var/tmp",
        "mkdir /var/tmp/checkout",
        f"mount --bind {repo} /var/tmp/checkout",
        "mount -t tmpfs tmpfs /tmp",
        f"mkdir -p {repo}",
        f"mount --bind /var/tmp/checkout {repo}",
    ]


def _run(cmd, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    wrapper, argv, env = cmd
    return subprocess.run(
        [*wrapper, *argv], env=env, capture_output=True, text=True, timeout=timeout
    )


def _certificate(directory: Path) -> tuple[Path, Path]:
    return self_signed_certificate(directory / "flight.crt", directory / "flight.key")


def _start_worker(tmp_path: Path, redis_url: str, namespace: str, hostpath: Path):
    """Start the cache worker pod (its own session and mount namespace, socket
    on the hostPath); returns once a socket it bound is there."""
    cert, key = tmp_path / "flight.crt", tmp_path / "flight.key"
    if not cert.exists():
        _certificate(tmp_path)
    flight_port, stream_port = free_port(), free_port()
    env = _env(
        SHARDCACHE_REDIS_URL=redis_url,
        SHARDCACHE_NAMESPACE=namespace,
        SHARDCACHE_ENDPOINT_SOCKET="/mnt/endpoint.sock",
        SHARDCACHE_ENDPOINT_SHM_DIR="/dev/shm/shardcache",
        SHARDCACHE_NODE_NAME="node-a",
        SHARDCACHE_CACHE_BYTES=str(64 * 2**20),
        SHARDCACHE_BUILD_WORKERS="1",
        SHARDCACHE_FLIGHT_PORT=str(flight_port),
        SHARDCACHE_STREAM_PORT=str(stream_port),
        SHARDCACHE_FLIGHT_TOKEN=TOKEN,
        # The worker's own /dev/shm (object store and chunk files) and /tmp
        # (Ray's session directory); the certificate is copied before /tmp is
        # covered.
        SHARDCACHE_FLIGHT_TLS_CERT="/dev/shm/flight.crt",
        SHARDCACHE_FLIGHT_TLS_KEY="/dev/shm/flight.key",
        **{k: v for k, v in os.environ.items() if k.startswith("AWS_")},
    )
    wrapper = [
        "unshare", "-m", "--propagation", "private", "sh", "-c",
        f"mount --bind {hostpath} /mnt && mount -t tmpfs -o size=512m tmpfs /dev/shm "
        f"&& cp {cert} {key} /dev/shm/ && " + " && ".join(_private_tmp()) + ' '
        '&& exec "$0" "$@"',
    ]  # fmt: skip
    sock = hostpath / "endpoint.sock"
    log_path = tmp_path / f"worker-{uuid.uuid4().hex[:6]}.log"
    log = open(log_path, "w")
    # A session of its own: a crash is simulated by SIGKILL to the whole group.
    proc = subprocess.Popen(
        [*wrapper, sys.executable, str(HERE / "endpoint_worker.py")],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    # Ready when the socket accepts: a crashed pod's socket file may still be
    # there (and a new one can reuse its inode number).
    while not _accepts(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(log_path.read_text()[-3000:])
        time.sleep(0.2)
    return {
        "proc": proc,
        "hostpath": hostpath,
        "namespace": namespace,
        "flight_port": flight_port,
        "stream_port": stream_port,
        "cert": cert,
        "log": log_path,
        "log_file": log,
    }


def _accepts(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _stop_worker(worker: dict) -> None:
    proc = worker["proc"]
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    worker["log_file"].close()


@pytest.fixture
def worker(tmp_path, redis_url, s3):
    """The cache worker pod: its own mount namespace, socket on the hostPath."""
    hostpath = tmp_path / "hostpath"
    hostpath.mkdir()
    started = _start_worker(tmp_path, redis_url, f"t{uuid.uuid4().hex[:10]}", hostpath)
    yield started
    _stop_worker(started)


def _objects(s3fs_client, bucket: str, same_size: bool = False) -> str:
    prefix = f"{bucket}/data"
    for i in range(OBJECTS):
        s3fs_client.pipe(
            f"{prefix}/{i:03d}.bin", bytes([i]) * (64 + i * (not same_size))
        )
    return f"s3://{prefix}/"


def test_endpoint_ranks_outside_ray_read_mapped_shards_through_the_socket(
    worker, s3, s3fs_client, bucket, redis
):
    url = _objects(s3fs_client, bucket)
    changed = f"{url}005.bin"
    hostpath = worker["hostpath"]
    cfg = {
        "url": url,
        "storage_options": s3.storage_options(),
        "name": "pods",
        "port": free_port(),
        "shared": "/srv",
        "changed_url": changed,
    }
    pod_env = _env(
        SHARDCACHE_ENDPOINT="/mnt/endpoint.sock",
        SHARDCACHE_NODE_NAME="node-a",
        SHARDCACHE_NAMESPACE=worker["namespace"],
    )
    results = hostpath.parent / "results"
    results.mkdir()
    wrapper, argv, env = _pod(
        "endpoint_job.py", "ranks", json.dumps(cfg), hostpath=hostpath, own_net=True,
        env=pod_env, results=results,
    )  # fmt: skip
    ranks = subprocess.Popen([*wrapper, *argv], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 180
    while not (results / "read-twice").exists():
        if ranks.poll() is not None or time.monotonic() > deadline:
            ranks.kill()
            pytest.fail(
                f"{ranks.stdout.read()[-4000:]}\n{worker['log'].read_text()[-3000:]}"
            )
        time.sleep(0.2)
    # Two epochs read: every object fetched once, by the cache worker.
    assert s3.total_gets == OBJECTS
    assert all(n == 1 for n in s3.gets.values())
    s3fs_client.pipe(changed.removeprefix("s3://"), bytes([200]) * (64 + 5))
    (results / "changed").write_text("")
    out, _ = ranks.communicate(timeout=180)
    assert ranks.returncode == 0, out[-4000:]

    ranks_out = [json.loads((results / f"rank{r}.json").read_text()) for r in (0, 1)]
    # The changed object, and only it, was read again.
    assert s3.total_gets == OBJECTS + 1
    assert max(s3.gets.values()) == 2
    for res in ranks_out:
        assert not res["ray_imported"] and not res["server_imported"]
        assert res["refreshed"] == [changed]
        for epoch in res["epochs"]:
            assert epoch["bad"] == 0
            # every chunk is a read-only shared mapping of a chunk file, and
            # every sample the rank received is a copy of its own
            assert epoch["mapped"] == len(epoch["seen"]) == OBJECTS // 2
    # Disjoint shards covering the dataset, stable across epochs.
    for e in range(3):
        a, b = (set(r["epochs"][e]["seen"]) for r in ranks_out)
        assert not a & b and len(a | b) == OBJECTS
    # Cluster figures as the Ray path records them: epoch 0 and the changed
    # object from the source (its chunk's other rows were copied from the
    # old chunk, not read: hits), the rest from the cache.
    totals = UsageReader(redis, worker["namespace"]).totals("pods")
    assert totals.samples == 3 * OBJECTS
    assert totals.samples_source == OBJECTS + 1
    assert ranks_out[0]["stats"]["cluster"]["hit_rate"] == pytest.approx(
        1 - (OBJECTS + 1) / (3 * OBJECTS)
    )  # read by the rank through the socket


def test_endpoint_rank_without_the_mount_gets_endpoint_unavailable(worker, s3, bucket):
    cfg = {"url": f"s3://{bucket}/data/", "storage_options": s3.storage_options(),
           "name": "nomount"}  # fmt: skip
    env = _env(
        SHARDCACHE_ENDPOINT="/mnt/endpoint.sock",
        SHARDCACHE_NODE_NAME="node-b",
        SHARDCACHE_NAMESPACE=worker["namespace"],
    )
    done = _run(_pod("endpoint_job.py", "nomount", json.dumps(cfg), hostpath=None,
                     own_net=True, env=env))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] == "EndpointUnavailable" and not result["server_imported"]
    assert "node-b" in result["message"] and "/mnt/endpoint.sock" in result["message"]


def test_endpoint_allow_remote_streams_from_another_nodes_worker_over_tcp_and_flight_tls(
    worker, s3, s3fs_client, bucket
):
    url = _objects(s3fs_client, bucket)
    cfg = {"url": url, "storage_options": s3.storage_options(), "name": "remote"}
    env = _env(
        SHARDCACHE_NODE_NAME="node-c",  # a node with no cache worker
        SHARDCACHE_NAMESPACE=worker["namespace"],
        SHARDCACHE_REMOTE_URL=f"tls://127.0.0.1:{worker['stream_port']}",
        SHARDCACHE_REMOTE_TOKEN=TOKEN,
        SHARDCACHE_REMOTE_CA="/mnt/flight.crt",
    )
    flight_env = {
        **env,
        "SHARDCACHE_REMOTE_URL": f"grpc+tls://127.0.0.1:{worker['flight_port']}",
    }
    ca_dir = worker["hostpath"].parent / "ca"
    ca_dir.mkdir(exist_ok=True)
    shutil.copy(worker["cert"], ca_dir / "flight.crt")
    # Without allow_remote the pod is told there is no endpoint on its node.
    refused = _run(_pod("endpoint_job.py", "nomount", json.dumps(cfg),
                        hostpath=ca_dir, own_net=False, env=env))  # fmt: skip
    assert json.loads(refused.stdout.strip().splitlines()[-1])["error"] == (
        "EndpointUnavailable"
    ), refused.stderr[-3000:]
    # Cold and warm over the TCP stream (the chart's default), warm again
    # through DataLoader workers (a connection each), then warm over Flight:
    # the same cache, the same counts.
    for run, (mode, origin, run_env) in enumerate(
        (
            ("remote", "source", env),
            ("remote", "peer", env),
            ("remote-workers", "peer", env),
            ("remote", "peer", flight_env),
        )
    ):
        done = _run(_pod("endpoint_job.py", mode, json.dumps(cfg), hostpath=ca_dir,
                         own_net=False, env=run_env))  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result == {
            **result,
            "bad": 0,
            "read": OBJECTS,
            "ray_imported": False,
            "server_imported": False,
        }
        assert not result["env_ray"]  # no Ray session directory in this pod
        served = result["served"]
        # fetched by the remote worker, then served from its store: peer hits
        assert served[origin] == OBJECTS, (run, served)
        assert served["remote_bytes"] >= sum(64 + i for i in range(OBJECTS))
        assert served["remote_us"] > 0
    assert s3.total_gets == OBJECTS
    # A wrong token is refused on both ports, as the project's own errors.
    for run_env, error in ((env, "ConfigError"), (flight_env, "EndpointUnavailable")):
        bad = _run(_pod("endpoint_job.py", "remote", json.dumps(cfg), hostpath=ca_dir,
                        own_net=False, env={**run_env, "SHARDCACHE_REMOTE_TOKEN": "nope"}))  # fmt: skip
        assert json.loads(bad.stdout.strip().splitlines()[-1])["error"] == error, (
            bad.stderr[-3000:]
        )


def test_endpoint_example_torchrun_script_trains_in_a_pod_outside_ray(
    worker, s3, s3fs_client, bucket
):
    """The chart's PyTorchJob command, as rendered: torchrun with 2 ranks."""
    url = _objects(s3fs_client, bucket, same_size=True)
    script = ROOT / "helm" / "shardcache" / "examples" / "torchrun_train.py"
    env = _env(
        SHARDCACHE_ENDPOINT="/mnt/endpoint.sock",
        SHARDCACHE_NODE_NAME="node-a",
        SHARDCACHE_NAMESPACE=worker["namespace"],
    )
    port = free_port()
    done = _run(_pod(
        f"-m torch.distributed.run --nproc-per-node=2 --master-addr=127.0.0.1 "
        f"--master-port={port} {script}", url, "--epochs=2", "--batch-size=4",
        f"--storage-options={json.dumps(s3.storage_options())}",
        hostpath=worker["hostpath"], own_net=True, env=env,
    ), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert [x["epoch"] for x in lines] == [0, 1]
    assert all(
        x["samples"] == OBJECTS // 2 and x["bytes"] == 64 * OBJECTS // 2 for x in lines
    )
    assert s3.total_gets == OBJECTS


def test_endpoint_rank_reads_on_across_a_cache_worker_crash_and_restart(
    tmp_path, redis_url, s3, s3fs_client, bucket
):
    """The DaemonSet pod is SIGKILLed mid-job (every process of it) and a new
    one starts on the same hostPath: the training pod keeps its mapped
    chunks, reconnects, re-registers and reads on, with no error."""
    hostpath = tmp_path / "hostpath"
    hostpath.mkdir()
    namespace = f"t{uuid.uuid4().hex[:10]}"
    first = _start_worker(tmp_path, redis_url, namespace, hostpath)
    url = _objects(s3fs_client, bucket)
    results = tmp_path / "results"
    results.mkdir()
    cfg = {"url": url, "storage_options": s3.storage_options(), "name": "restart",
           "shared": "/srv"}  # fmt: skip
    env = _env(
        SHARDCACHE_ENDPOINT="/mnt/endpoint.sock",
        SHARDCACHE_NODE_NAME="node-a",
        SHARDCACHE_NAMESPACE=namespace,
        # Nothing held in the rank: every batch of the second epoch asks the
        # (new) endpoint, so the restart cannot hide behind the rank's cache.
        SHARDCACHE_HOLD_BYTES="0",
    )
    wrapper, argv, env = _pod("endpoint_job.py", "restart", json.dumps(cfg),
                              hostpath=hostpath, own_net=True, env=env,
                              results=results)  # fmt: skip
    job = subprocess.Popen([*wrapper, *argv], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)  # fmt: skip
    second = None
    try:
        deadline = time.monotonic() + 180
        while not (results / "read-once").exists():
            if job.poll() is not None or time.monotonic() > deadline:
                job.kill()
                pytest.fail(f"{job.stdout.read()[-4000:]}\n"
                            f"{first['log'].read_text()[-3000:]}")  # fmt: skip
            time.sleep(0.2)
        assert s3.total_gets == OBJECTS
        os.killpg(first["proc"].pid, signal.SIGKILL)  # the pod dies, Ray and all
        first["proc"].wait()
        first["log_file"].close()
        # Its socket file stays on the hostPath; the new pod replaces it.
        assert (hostpath / "endpoint.sock").exists()
        second = _start_worker(tmp_path, redis_url, namespace, hostpath)
        (results / "restarted").write_text("")
        out, _ = job.communicate(timeout=180)
        assert job.returncode == 0, out[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
        if second is not None:
            _stop_worker(second)
    result = json.loads(out.strip().splitlines()[-1])
    assert result.get("error") is None, result
    for epoch in result["epochs"]:
        assert epoch["bad"] == 0 and sorted(epoch["seen"]) == list(range(OBJECTS))
    # The new pod's store started empty: each object was read once more, by it.
    assert s3.total_gets == 2 * OBJECTS
    assert all(n == 2 for n in s3.gets.values())


def test_flight_mappings_send_a_rewritten_chunk_file_anew_and_drop_handed_over_ones(
    tmp_path,
):
    """The Flight server keeps chunk files mapped between requests; what it
    sends is still byte for byte the file under the name at request time."""
    import numpy as np

    from shardcache.chunk_file import write_chunk_file
    from shardcache_server.endpoint.flight import _Mappings

    mappings = _Mappings(max_files=2)
    path = tmp_path / "c.chunk"
    write_chunk_file(path, {"_": np.arange(64, dtype=np.int64)})
    first = path.read_bytes()
    assert mappings.buffer(path, unlink=False).to_pybytes() == first
    assert mappings.buffer(path, unlink=False).to_pybytes() == first  # kept mapped
    # Rewritten under its name (a new file renamed in, as ShmFiles does).
    write_chunk_file(path, {"_": np.arange(64, dtype=np.int64) * 3})
    assert path.read_bytes() != first
    assert mappings.buffer(path, unlink=False).to_pybytes() == path.read_bytes()
    # A file handed over once is sent, then gone.
    once = tmp_path / "u1.chunk"
    write_chunk_file(once, {"_": np.ones(8, dtype=np.uint8)})
    expected = once.read_bytes()
    assert mappings.buffer(once, unlink=True).to_pybytes() == expected
    assert not once.exists()
    # At most max_files stay mapped.
    for k in range(4):
        other = tmp_path / f"o{k}.chunk"
        write_chunk_file(other, {"_": np.full(8, k, dtype=np.uint8)})
        assert mappings.buffer(other, unlink=False).to_pybytes() == other.read_bytes()
    assert len(mappings._mapped) == 2

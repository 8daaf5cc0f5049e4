"""``rediss://`` end to end: a TLS-only redis-server with a password, the SDK,
the stores on a 2-node Ray cluster and the dashboard's reads all go over TLS."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardcache import DistributedCachedDataset
from shardcache.embedded import find_redis_server, free_port
from shardcache.errors import IndexUnavailable
from shardcache.index import RedisIndex

from helpers import cached_samples

pytestmark = pytest.mark.slow
PASSWORD = "tls-secret-pw"


def _start_tls_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    server.private_key_and_cert_chain_pem.write_to_path(str(tmp / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
    port = free_port()
    proc = subprocess.Popen(
        [
            find_redis_server(),
            "--port", "0",  # no plaintext listener at all
            "--tls-port", str(port),
            "--bind", "127.0.0.1",
            "--tls-cert-file", str(tmp / "server.pem"),
            "--tls-key-file", str(tmp / "server.pem"),
            "--tls-ca-cert-file", str(tmp / "ca.pem"),
            "--tls-auth-clients", "no",
            "--requirepass", PASSWORD,
            "--save", "", "--appendonly", "no", "--dir", str(tmp),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    return proc, port, tmp / "ca.pem"


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[dict[str, Any]]:
    proc, port, ca = _start_tls_redis(tmp_path)
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            if "tls" in out.lower():
                pytest.skip(
                    f"{find_redis_server()} was built without TLS; install Debian's "
                    "redis-server (scripts/test.sh does when run as root)"
                )
            raise RuntimeError(f"redis-server with TLS failed to start: {out[-500:]}")
        try:
            RedisIndex.from_url(url, "probe")
            break
        except IndexUnavailable:
            assert time.monotonic() < deadline, "TLS redis-server never answered"
            time.sleep(0.1)
    yield {"url": url, "port": port, "ca": ca}
    proc.terminate()
    proc.wait(timeout=10)


def test_rediss_end_to_end_sdk_stores_and_index(
    ray_cluster, s3, s3fs_client, bucket, tls_redis, namespace
):
    payload = {f"{bucket}/d/{i:02d}": bytes([i]) * 64 for i in range(16)}
    s3fs_client.pipe(payload)
    ds = DistributedCachedDataset(
        f"s3://{bucket}/d/",
        storage_options=s3.storage_options(),
        redis_url=tls_redis["url"],
        namespace=namespace,
        shuffle=False,
    )
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = [bytes(ds[i].numpy()) for i in range(16)]
        assert got == [payload[f"{bucket}/d/{i:02d}"] for i in range(16)]
    assert s3.total_gets == 16
    # The stores (Ray actors) recorded entries and flushed stats over TLS too.
    index = RedisIndex.from_url(tls_redis["url"], namespace)
    deadline = time.monotonic() + 15
    while index.stats(ds.name).remote_reads < 16:
        assert time.monotonic() < deadline, "store stats never reached Redis"
        time.sleep(0.2)
    assert cached_samples(index, ds.name, ds.generation) == 16
    ds.close()


def test_rediss_refuses_plaintext_and_unknown_ca_with_clear_errors(tls_redis):
    port = tls_redis["port"]
    with pytest.raises(IndexUnavailable) as plain:
        RedisIndex.from_url(f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
    assert PASSWORD not in str(plain.value)
    # Without the deployment's CA the server's certificate is not trusted.
    with pytest.raises(IndexUnavailable) as untrusted:
        RedisIndex.from_url(f"rediss://:{PASSWORD}@127.0.0.1:{port}/0")
    assert PASSWORD not in str(untrusted.value)
    assert "127.0.0.1" in str(untrusted.value)

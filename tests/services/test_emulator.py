"""The S3 emulator's own fault model, which the benchmark and the reliability
tests rely on: it must do what it says at the HTTP level."""

from __future__ import annotations

import http.client
import time
import urllib.request
from urllib.error import HTTPError

import pytest

from shardcache_server.emulator import FaultPlan


def test_emulator_caps_bandwidth_per_get(s3, s3fs_client, bucket):
    s3fs_client.pipe({f"{bucket}/big": b"x" * 2_000_000})
    s3.set_faults(FaultPlan(bandwidth_bytes_per_s=10e6))  # 2 MB at 10 MB/s
    started = time.monotonic()
    assert s3fs_client.cat_file(f"{bucket}/big") == b"x" * 2_000_000
    # A lower bound only: the pacing sleeps, so it can never be faster.
    assert time.monotonic() - started >= 0.18
    assert s3.gets[f"/{bucket}/big"] == 1


def test_emulator_answers_slowdown_at_the_http_level(s3, s3fs_client, bucket):
    s3fs_client.pipe({f"{bucket}/k{i}": b"v" for i in range(20)})
    s3.set_faults(FaultPlan(error_rate=1.0, error_status=503))
    with pytest.raises(HTTPError) as err:
        urllib.request.urlopen(f"{s3.endpoint_url}/{bucket}/k0", timeout=5)
    assert err.value.code == 503 and b"SlowDown" in err.value.read()


def test_emulator_drops_connection_before_any_response(s3, s3fs_client, bucket):
    s3fs_client.pipe({f"{bucket}/k": b"v"})
    s3.set_faults(FaultPlan(reset_rate=1.0))
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        urllib.request.urlopen(f"{s3.endpoint_url}/{bucket}/k", timeout=5)
    s3.set_faults(FaultPlan())  # the server itself keeps serving
    assert s3fs_client.cat_file(f"{bucket}/k") == b"v"


def test_emulator_stalls_past_the_client_timeout(s3, s3fs_client, bucket):
    s3fs_client.pipe({f"{bucket}/k": b"v"})
    s3.set_faults(FaultPlan(stall_rate=1.0, stall_s=1.0))
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(f"{s3.endpoint_url}/{bucket}/k", timeout=0.3)

"""The disk tier in the chart: a hostPath on every cache worker, and the
settings the stores read (SHARDCACHE_DISK_DIR / SHARDCACHE_DISK_BYTES)."""

from __future__ import annotations

import pytest
from test_chart import objects

from shardcache_server.settings import ServiceSettings

pytestmark = pytest.mark.helm


def _daemonset_and_config(values):
    objs = objects(values)
    ds = next(o for o in objs if o["kind"] == "DaemonSet")
    config = next(o for o in objs if o["kind"] == "ConfigMap")["data"]
    return ds["spec"]["template"]["spec"], config


def test_shard_daemonset_mounts_disk_tier_hostpath_when_disk_enabled_set():
    spec, config = _daemonset_and_config(
        {"cache": {"disk": {"enabled": True, "hostPath": "/nvme/sc", "bytes": 2**31}}}
    )
    volume = next(v for v in spec["volumes"] if v["name"] == "disk")
    assert volume["hostPath"] == {"path": "/nvme/sc", "type": "DirectoryOrCreate"}
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["disk"] == config["SHARDCACHE_DISK_DIR"] == "/cache-disk"
    settings = ServiceSettings(disk_dir=config["SHARDCACHE_DISK_DIR"],
                               disk_bytes=config["SHARDCACHE_DISK_BYTES"])  # fmt: skip
    assert settings.disk_bytes == 2**31


def test_shard_daemonset_has_no_disk_tier_when_disk_enabled_not_set():
    spec, config = _daemonset_and_config({"cache": {"eviction": "clairvoyant"}})
    assert all(v["name"] != "disk" for v in spec["volumes"])
    assert config["SHARDCACHE_DISK_DIR"] == ""  # the tier is off
    assert config["SHARDCACHE_EVICTION"] == "clairvoyant"

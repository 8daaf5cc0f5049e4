"""DiskTier on a real directory: budget, header checks, crash leftovers."""

from __future__ import annotations

import numpy as np

from shardcache_server.store.disk_tier import DiskTier

META = {"version": "v1", "generation": 1, "fingerprint": "fp"}


def _columns(fill: int) -> dict[str, np.ndarray]:
    return {"_": np.full((4, 256), fill, np.uint8), "__failed__": np.zeros(4, bool)}


def test_disk_tier_keeps_budget_by_deleting_least_recently_used(tmp_path):
    tier = DiskTier(str(tmp_path), "ns", budget_bytes=1)
    tier.write("ds", "c0", _columns(0), META)
    size = tier.used_bytes
    tier.budget_bytes = 2 * size  # room for two files
    tier.write("ds", "c1", _columns(1), META)
    assert tier.read("ds", "c0", META) is not None  # c0 is now the most recent
    dropped = tier.write("ds", "c2", _columns(2), META)
    assert dropped == [("ds", "c1")]
    assert not tier.path("ds", "c1").exists() and tier.used_bytes == 2 * size
    assert tier.read("ds", "c1", META) is None
    assert tier.read("ds", "c2", META)["_"][0, 0] == 2


def test_disk_tier_deletes_a_file_whose_header_does_not_match(tmp_path):
    tier = DiskTier(str(tmp_path), "ns", budget_bytes=2**20)
    tier.write("ds", "c0", _columns(7), META)
    assert tier.read("ds", "c0", {**META, "generation": 2}) is None
    assert not tier.path("ds", "c0").exists()
    tier.write("ds", "c0", _columns(7), META)
    assert tier.read("ds", "c0", {**META, "version": "v2"}) is None
    assert tier.summary()["disk_chunks"] == 0


def test_disk_tier_scan_adopts_files_and_deletes_crash_leftovers(tmp_path):
    first = DiskTier(str(tmp_path), "ns", budget_bytes=2**20)
    first.write("ds", "c0", _columns(3), META)
    first.write("ds", "c1", _columns(4), META)
    leftover = first.path("ds", "c2").with_name("c2.chunk.123.tmp")
    leftover.write_bytes(b"half a chunk")  # a write the crash interrupted
    first.path("ds", "c1").write_bytes(b"not a chunk file")  # a torn disk
    second = DiskTier(str(tmp_path), "ns", budget_bytes=2**20)  # after a restart
    assert second.scan() == 2 and not leftover.exists()
    assert second.read("ds", "c0", META)["_"][0, 0] == 3
    assert second.read("ds", "c1", META) is None  # corrupt: deleted, not served
    assert not second.path("ds", "c1").exists()
    assert second.summary()["disk_chunks"] == 1

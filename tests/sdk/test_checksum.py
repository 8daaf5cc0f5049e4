"""The rank's sampled content check (``checksum.check_resolved``) with a stand-in
client: a chunk failing its checksum is dropped at its store, asked for once
more and never served; a second failure is an error."""

from __future__ import annotations

import numpy as np
import pytest

from shardcache.checksum import check_resolved, is_intact, seal
from shardcache.errors import CorruptChunkError

ITEMS = [("c0", "v0", 10), ("c1", "v1", 10)]


def _good(value: int) -> dict[str, np.ndarray]:
    return seal({"_": np.full((2, 4), value, dtype=np.int32)})


def _bad(value: int) -> dict[str, np.ndarray]:
    cols = _good(value)
    cols["_"][0, 0] += 1  # written after the checksum: in-place corruption
    return cols


class _Client:
    def __init__(self, rebuilt):
        self.rebuilt = rebuilt
        self.dropped: list[tuple[str, int, str, str]] = []
        self.resolved: list[list[str]] = []

    def drop_corrupt(self, name, generation, chunk, version):
        self.dropped.append((name, generation, chunk, version))
        return True

    def resolve(self, name, generation, items, digest, reader=""):
        self.resolved.append([chunk for chunk, _, _ in items])
        return [("fetched", self.rebuilt) for _ in items]


def test_check_resolved_drops_and_rebuilds_a_corrupt_chunk_once():
    client = _Client(_good(1))
    results = [("hit", _bad(1)), ("hit", _good(2))]
    out = check_resolved(client, "ds", 3, "dg", ITEMS, results, rate=1.0)
    assert client.dropped == [("ds", 3, "c0", "v0")] and client.resolved == [["c0"]]
    assert out[0][0] == "fetched" and is_intact(out[0][1]) and out[1] is results[1]


def test_check_resolved_raises_when_the_rebuilt_chunk_fails_too():
    client = _Client(_bad(1))
    with pytest.raises(CorruptChunkError, match="chunk c0 .*verify ds --repair"):
        check_resolved(client, "ds", 3, "dg", ITEMS, [("hit", _bad(1))], rate=1.0)


def test_check_resolved_at_rate_zero_checks_nothing():
    client = _Client(_good(1))
    results = [("hit", _bad(1))]
    assert check_resolved(client, "ds", 3, "dg", ITEMS, results, rate=0.0) is results
    assert client.dropped == []

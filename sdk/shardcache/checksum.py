"""Content checksums of chunks: written when a chunk is built, checked when read.

A chunk lives in shared memory (the Ray object store, or a chunk file a
rank maps), and anything with a pointer into it can write there: a rank
that mutates a zero-copy tensor in place, a bad DIMM, a stray ctypes
write. The index and the ETags cannot see that; only the bytes can.
So every chunk carries one more column, ``__checksum__``: the xxh3_64 of
every other column's name, dtype, shape and bytes. It is a column, not
metadata beside the object, so it travels with the chunk through every
path that moves columns (the object store, the disk tier's chunk files,
the node-local endpoint's shared-memory files, the remote stream) and a
chunk spilled and loaded back still verifies.

xxh3_64 and not a cryptographic hash: this guards against accidents, not
adversaries, and it costs ~0.035 ms per MB (27 GB/s on this project's
2-core machine: ``python -m shardcache.checksum``), so a 16 MB chunk is
checked in about half a millisecond.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from shardcache.errors import CorruptChunkError
from shardcache.transport.base import Transport

__all__ = ["CHECKSUM", "checksum", "check_resolved", "is_intact", "seal"]

log = logging.getLogger("shardcache")

CHECKSUM = "__checksum__"  # the column holding the chunk's checksum (uint64, 1 value)


def checksum(columns: dict[str, np.ndarray]) -> int:
    """The xxh3_64 of every column but ``__checksum__``, in name order.

    Name, dtype and shape are hashed with the bytes, so a column renamed,
    reshaped or reinterpreted does not verify either.

    >>> cols = {"_": np.arange(4, dtype=np.int32)}
    >>> checksum(cols) == checksum({"_": np.arange(4, dtype=np.int32)})
    True
    >>> checksum(cols) == checksum({"_": np.arange(4, dtype=np.int64)})
    False
    """
    h = xxhash.xxh3_64()
    for name in sorted(columns):
        if name == CHECKSUM:
            continue
        array = columns[name]
        h.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        # A view of the bytes, no copy, for the contiguous columns chunks have.
        h.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return h.intdigest()


def seal(columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add the ``__checksum__`` column to a newly built chunk (in place) and
    return it."""
    columns[CHECKSUM] = np.array([checksum(columns)], dtype=np.uint64)
    return columns


def is_intact(columns: dict[str, np.ndarray]) -> bool:
    """Whether the chunk's contents match the checksum written when it was built.

    A chunk without a checksum (a chunk file written before checksums
    existed) is not intact: nothing vouches for it, so it is rebuilt.

    >>> is_intact(seal({"_": np.zeros(3)}))
    True
    >>> cols = seal({"_": np.zeros(3)}); cols["_"][1] = 7.0
    >>> is_intact(cols)
    False
    """
    stored = columns.get(CHECKSUM)
    if stored is None or stored.shape != (1,):
        return False
    return int(stored[0]) == checksum(columns)


def check_resolved(
    client: Transport,
    name: str,
    generation: int,
    digest: str | None,
    items: Sequence[tuple[str, str, int]],
    results: list[tuple[str, Any]],
    rate: float,
    reader: str = "",
) -> list[tuple[str, Any]]:
    """The sampled check of chunks a rank just resolved: each is checked with
    probability ``rate``; one that fails is never served. The stores drop it,
    it is asked for once more (built again from the source) and that copy is
    always checked.

    Raises:
        CorruptChunkError: the rebuilt chunk fails its checksum too.
    """
    bad = [
        j
        for j, (_, columns) in enumerate(results)
        if rate > 0 and random.random() < rate and not is_intact(columns)
    ]
    if not bad:
        return results
    for j in bad:
        chunk, version, _ = items[j]
        log.warning(
            "dataset %r chunk %s failed its content checksum; dropped and rebuilt "
            "from the source",
            name,
            chunk,
        )
        client.drop_corrupt(name, generation, chunk, version)
    again = client.resolve(
        name, generation, [items[j] for j in bad], digest, reader=reader
    )
    out = list(results)
    for j, (status, columns) in zip(bad, again, strict=True):
        if not is_intact(columns):
            raise CorruptChunkError(
                f"dataset {name!r} chunk {items[j][0]} fails its content checksum "
                "even after it was rebuilt from the source; the node's memory or "
                "disk may be faulty. Run `shardcache verify "
                f"{name} --repair` and check the store's node."
            )
        out[j] = (status, columns)
    return out


def _measure(megabytes: int = 64, repeats: int = 5) -> float:
    """Milliseconds per MB of :func:`checksum` on random bytes."""
    columns = {
        "_": np.random.default_rng(0).integers(0, 255, megabytes * 2**20, np.uint8)
    }
    checksum(columns)
    started = time.perf_counter()
    for _ in range(repeats):
        checksum(columns)
    return (time.perf_counter() - started) / repeats / megabytes * 1e3


if __name__ == "__main__":  # python -m shardcache.checksum: the cost per MB here
    print(f"checksum: {_measure():.3f} ms per MB")

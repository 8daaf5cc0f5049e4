"""The listing of a dataset as a few numpy arrays, published once per cluster.

One store lists the source and puts the manifest in the Ray object store;
every rank and store maps that same object (zero-copy, shared memory)
instead of listing again. Per sample it holds the URL bytes, the version
(ETag) bytes, the size and a 64-bit hash of (URL, ETag); per chunk, where it
starts (``chunk_starts``). No Python object per sample, so a rank's
anonymous memory does not grow with the dataset.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from shardcache.chunks import ChunkLayout, plan_chunks
from shardcache.keys import chunk_key

__all__ = ["ChunkItem", "Manifest", "sample_hash"]

ChunkItem = tuple[
    str, str, int
]  # (chunk key, version, source bytes): what a store is asked

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def sample_hash(url: str, etag: str) -> int:
    """64-bit identity of one object version: changes with the URL or the ETag."""
    digest = hashlib.blake2b(f"{url}\0{etag}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser: positions and hashes mixed so that swapping two
    # members of a chunk changes its version.
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _blob(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [s.encode() for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


class Manifest:
    """The ordered objects of a dataset as arrays.

    >>> m = Manifest.from_entries("file", ["/d/a", "/d/b"], [3, 4], ["e1", "e2"])
    >>> len(m), m.url(1), m.etag(0), m.size(1), m.members(0, 2)[1]
    (2, '/d/b', 'e1', 4, ('/d/b', 'e2', 4))
    """

    def __init__(self, protocol: str, columns: dict[str, np.ndarray]):
        self.protocol = protocol
        self.columns = columns
        self.sizes = columns["sizes"]
        self.hashes = columns["hashes"]
        self._names, self._name_offsets = columns["names"], columns["name_offsets"]
        self._etags, self._etag_offsets = columns["etags"], columns["etag_offsets"]
        # columns may gain "chunk_starts" (services' listing.py) before publishing
        self._digest: str | None = None

    @classmethod
    def from_entries(
        cls,
        protocol: str,
        urls: Sequence[str],
        sizes: Sequence[int],
        etags: Sequence[str],
    ) -> Manifest:
        """Build from parallel lists (already in the dataset's order)."""
        names, name_offsets = _blob(urls)
        etag_blob, etag_offsets = _blob(etags)
        hashes = np.fromiter(
            (sample_hash(u, e) for u, e in zip(urls, etags, strict=True)),
            dtype=np.uint64,
            count=len(urls),
        )
        return cls(
            protocol,
            {
                "names": names,
                "name_offsets": name_offsets,
                "etags": etag_blob,
                "etag_offsets": etag_offsets,
                "sizes": np.asarray(sizes, dtype=np.int64),
                "hashes": hashes,
            },
        )

    # -- the object-store form ------------------------------------------------------
    def to_object(self) -> dict[str, Any]:
        """What goes into the object store: arrays plus the protocol."""
        return {"protocol": self.protocol, **self.columns}

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> Manifest:
        """Map a published manifest; a packed one (it names its ``format``)
        comes back as a :class:`~shardcache.packed_manifest.PackedManifest`,
        which answers the same questions per chunk."""
        if "format" in obj:
            from shardcache.packed_manifest import PackedManifest

            return PackedManifest.from_object(obj)  # type: ignore[return-value]
        columns = {k: v for k, v in obj.items() if k != "protocol"}
        return cls(str(obj["protocol"]), columns)

    # -- per object (cluster side, cold path) -----------------------------------------
    def __len__(self) -> int:
        return len(self.sizes)

    def url(self, i: int) -> str:
        off = self._name_offsets
        return bytes(self._names[int(off[i]) : int(off[i + 1])]).decode()

    def etag(self, i: int) -> str:
        off = self._etag_offsets
        return bytes(self._etags[int(off[i]) : int(off[i + 1])]).decode()

    def size(self, i: int) -> int:
        return int(self.sizes[i])

    def members(self, lo: int, hi: int) -> list[tuple[str, str, int]]:
        """``(url, etag, size)`` of objects ``lo`` to ``hi`` (one chunk's members)."""
        return [(self.url(i), self.etag(i), self.size(i)) for i in range(lo, hi)]

    def urls(self) -> list[str]:
        """Every URL (a Python list: for tools and tests, not the training path)."""
        return [self.url(i) for i in range(len(self))]

    # -- whole-dataset views ----------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def digest(self) -> str:
        """Changes when any object is added, removed, renamed or rewritten."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=8)
            h.update(np.ascontiguousarray(self.hashes).tobytes())
            h.update(np.ascontiguousarray(self.sizes).tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def plan(self, max_bytes: int, max_samples: int) -> ChunkLayout:
        """Cut this listing into chunks (see :func:`~shardcache.chunks.plan_chunks`)."""
        return plan_chunks(self.sizes, max_bytes, max_samples)

    @property
    def layout(self) -> ChunkLayout:
        """The chunks the publishing store cut (kept across refreshes of the same URLs)."""
        starts = self.columns.get("chunk_starts")
        if starts is None:
            raise KeyError("this manifest was never cut into chunks (no chunk_starts)")
        return ChunkLayout(starts)

    def chunk_versions(self, layout: ChunkLayout) -> np.ndarray:
        """One 64-bit version per chunk: changes when any member's URL or ETag does."""
        if len(self) == 0:
            return np.zeros(0, dtype=np.uint64)
        positions = _mix(np.arange(1, len(self) + 1, dtype=np.uint64))
        mixed = _mix(self.hashes ^ positions)
        return np.bitwise_xor.reduceat(mixed, layout.starts[:-1])

    def chunk_items(
        self, chunks: Iterable[int], versions: np.ndarray | None = None
    ) -> list[ChunkItem]:
        """What a reader asks a store for, per chunk; ``versions`` from
        :meth:`chunk_versions` when the caller keeps them (per-batch use)."""
        layout = self.layout
        if versions is None:
            versions = self.chunk_versions(layout)
        starts = layout.starts
        return [
            (
                chunk_key(c),
                f"{int(versions[c]):016x}",
                int(self.sizes[starts[c] : starts[c + 1]].sum()),
            )
            for c in chunks
        ]

    def chunk_source_bytes(self, chunk: int) -> int:
        lo, hi = self.layout.bounds(chunk)
        return int(self.sizes[lo:hi].sum())

    def sample_bytes(self, indices: np.ndarray, chunk_ids: np.ndarray) -> np.ndarray:
        """Source bytes of each sample (``chunk_ids``: their chunks, unused here)."""
        return self.sizes[indices]

    def row_hashes(self, lo: int, hi: int) -> np.ndarray:
        """The identity of rows ``lo`` to ``hi``, kept with a built chunk so that
        a rebuild re-reads only the rows that changed."""
        return self.hashes[lo:hi]

    def changed_rows(self, lo: int, hi: int, old_hashes: np.ndarray) -> np.ndarray:
        """Rows of chunk ``[lo, hi)`` whose member differs from ``old_hashes``."""
        now = self.hashes[lo:hi]
        if len(old_hashes) != len(now):
            return np.arange(hi - lo)
        return np.flatnonzero(now != old_hashes)

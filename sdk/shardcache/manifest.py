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
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from shardcache.chunks import ChunkLayout, plan_chunks
from shardcache.keys import chunk_key

__all__ = [
    "PREFIX_COLUMN",
    "PREFIX_ENDS",
    "ChunkItem",
    "Manifest",
    "ManifestWriter",
    "sample_hash",
]

# Marks a manifest published while its listing still ran: the listing's
# first objects, cut at a chunk boundary (its value: how many). Its chunks
# are the finished listing's chunks; more objects follow.
PREFIX_COLUMN = "listing_prefix"
# The length of every prefix a listing published, in order (on each prefix
# and on the finished listing): where its first epoch's segments end.
PREFIX_ENDS = "prefix_ends"

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


class ManifestWriter:
    """Objects appended one at a time into the manifest's columns, as a
    listing streams them: URL and version bytes go to two growing blobs, the
    ends, sizes and hashes to typed arrays. Nothing per object survives the
    append (28 B of arrays plus the URL and version bytes per object), so a
    listing of millions never holds a list of dicts or strings.

    >>> w = ManifestWriter()
    >>> w.add("/d/a", 3, "e1"); w.add("/d/b", 4, "e2")
    >>> Manifest.concat("file", [w]).members(0, 2)
    [('/d/a', 'e1', 3), ('/d/b', 'e2', 4)]
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Drop every object appended (their memory is freed)."""
        self.names = bytearray()
        self.name_ends = array("q")
        self.etags = bytearray()
        self.etag_ends = array("q")
        self.sizes = array("q")
        self.hashes = array("Q")

    def __len__(self) -> int:
        return len(self.sizes)

    def add(self, url: str, size: int, etag: str) -> None:
        """Append one object (in the dataset's order)."""
        self.add_bytes(url.encode(), size, etag.encode())

    def add_bytes(self, url: bytes, size: int, etag: bytes) -> None:
        # The hash is sample_hash(url, etag), computed from the bytes at hand.
        digest = hashlib.blake2b(url + b"\0" + etag, digest_size=8).digest()
        self.names += url
        self.name_ends.append(len(self.names))
        self.etags += etag
        self.etag_ends.append(len(self.etags))
        self.sizes.append(size)
        self.hashes.append(int.from_bytes(digest, "little"))


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
        writer = ManifestWriter()
        for url, size, etag in zip(urls, sizes, etags, strict=True):
            writer.add(url, int(size), etag)
        return cls.concat(protocol, [writer])

    @classmethod
    def concat(
        cls, protocol: str, parts: Sequence[ManifestWriter], *, clear: bool = True
    ) -> Manifest:
        """The objects of ``parts``, one after another, as one manifest. Each
        writer is emptied once copied (``clear``), so a listing's peak is the
        manifest plus one part, not two copies of everything; a prefix
        published while the listing runs keeps them (``clear=False``)."""
        n = sum(len(p) for p in parts)
        names = np.empty(sum(len(p.names) for p in parts), np.uint8)
        etags = np.empty(sum(len(p.etags) for p in parts), np.uint8)
        name_offsets, etag_offsets = (
            np.zeros(n + 1, np.int64),
            np.zeros(n + 1, np.int64),
        )
        sizes, hashes = np.empty(n, np.int64), np.empty(n, np.uint64)
        row = name_at = etag_at = 0
        for part in parts:
            k, rows = len(part), slice(row + 1, row + len(part) + 1)
            if k:
                name_offsets[rows] = np.frombuffer(part.name_ends, np.int64) + name_at
                etag_offsets[rows] = np.frombuffer(part.etag_ends, np.int64) + etag_at
                sizes[row : row + k] = np.frombuffer(part.sizes, np.int64)
                hashes[row : row + k] = np.frombuffer(part.hashes, np.uint64)
                names[name_at : name_at + len(part.names)] = np.frombuffer(
                    part.names, np.uint8
                )
                etags[etag_at : etag_at + len(part.etags)] = np.frombuffer(
                    part.etags, np.uint8
                )
            row, name_at, etag_at = (
                row + k,
                name_at + len(part.names),
                etag_at + len(part.etags),
            )
            if clear:
                part.clear()
        return cls(
            protocol,
            {
                "names": names,
                "name_offsets": name_offsets,
                "etags": etags,
                "etag_offsets": etag_offsets,
                "sizes": sizes,
                "hashes": hashes,
            },
        )

    def head(self, n: int) -> Manifest:
        """The first ``n`` objects (views of these columns; no chunks cut).

        >>> m = Manifest.from_entries("file", ["/a", "/b", "/c"], [1, 2, 3], ["x", "y", "z"])
        >>> h = m.head(2); len(h), h.url(1), h.etag(1), h.total_bytes
        (2, '/b', 'y', 3)
        """
        names_end = int(self._name_offsets[n])
        etags_end = int(self._etag_offsets[n])
        columns = {
            "names": self._names[:names_end],
            "name_offsets": self._name_offsets[: n + 1],
            "etags": self._etags[:etags_end],
            "etag_offsets": self._etag_offsets[: n + 1],
            "sizes": self.sizes[:n],
            "hashes": self.hashes[:n],
        }
        return Manifest(self.protocol, columns)

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

    @property
    def is_prefix(self) -> bool:
        """Published while its listing still ran: more objects follow."""
        return PREFIX_COLUMN in self.columns

    @property
    def prefix_ends(self) -> np.ndarray:
        """The lengths of the prefixes its listing published while it ran
        (empty for a listing that published only its whole; ``[0, n]`` for
        one published whole whose first epoch is one segment read chunk by
        chunk: ``shardcache.segments.WHOLE_LISTING``)."""
        return np.asarray(self.columns.get(PREFIX_ENDS, ()), dtype=np.int64)

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

"""The listing of a packed dataset: a few files, each cut into units (= chunks).

A packed source (WebDataset tar shards, Parquet, HDF5, LMDB, a big .npy, or
a user's map-style Dataset) holds many samples per file. Its listing is a
table of files and a table of **units**: a run of consecutive samples of
one file (a slab of rows, a span of tar members, a range of LMDB keys),
cut to at most ``chunk_samples`` samples and about ``chunk_bytes`` source
bytes. Each unit is exactly one chunk of the cache, so the per-sample cost
of a listing is nothing for row formats (a 10M-row .npy is one file and a
few thousand units) and the sample keys for the formats whose samples have
names (tar basenames, LMDB keys).

A unit's version hashes its file's URL and ETag (or mtime), its bounds and
the format options: a rewritten file changes exactly its own units.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.chunks import ChunkLayout
from shardcache.keys import chunk_key

__all__ = [
    "FORMAT_EXTENSIONS",
    "FileUnits",
    "PackedManifest",
    "format_of",
    "objects_preprocess",
    "unit_hash",
    "unit_version",
]

# The file extensions that name a packed format when ``format=`` is not given
# (the stores' format modules read these files; the SDK only names them).
FORMAT_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "tar": (".tar",),
    "parquet": (".parquet", ".pq"),
    "hdf5": (".h5", ".hdf5"),
    "lmdb": (".lmdb", ".mdb"),
    "npy": (".npy",),
}


# Files of these formats hold either one sample or many rows: the extension
# alone cannot say which, so only a single file (not a glob, a list or a
# prefix) is read as packed rows without ``format=``.
PER_FILE_OR_ROWS = ("npy",)
_GLOB_CHARS = "*?["
_PROBED_URLS = 64  # listed objects whose extension is looked at (per-object listings)


def format_of(urls: str | Sequence[str]) -> str | None:
    """The packed format the URL's (or every URL's) extension names, else None.

    A glob or a list of ``.npy`` files names no format: like a prefix over the
    same files, each file is one sample (pass ``format="npy"`` for rows).

    >>> format_of("s3://b/shards/train-*.tar"), format_of(["/d/a.jpg"])
    ('tar', None)
    >>> format_of("/nfs/features.npy"), format_of("/nfs/feats/*.npy")
    ('npy', None)
    """
    found = _extension_format(urls)
    is_one_file = isinstance(urls, str) and not any(c in urls for c in _GLOB_CHARS)
    if found in PER_FILE_OR_ROWS and not is_one_file:
        return None
    return found


def objects_preprocess(
    manifest_urls: Sequence[str], source: str | Sequence[str]
) -> Any:
    """The default preprocess of a per-object listing, from what it listed:
    ``decode_npy`` for .npy files (one array per file, whether listed by
    prefix, glob or list), ``None`` (raw bytes) for anything else.

    Raises:
        ConfigError: every listed object is a container file (tar, Parquet,
            HDF5, LMDB) that a prefix listed: each would become one sample of
            raw bytes, which is rarely meant. Pass ``format=`` (or a glob, which
            names it) to read the samples inside, or ``preprocess=`` to read
            each file as one sample.
    """
    from shardcache.decoders import decode_npy
    from shardcache.errors import ConfigError

    found = _extension_format(list(manifest_urls[:_PROBED_URLS]))
    if found is None:
        return None
    if found in PER_FILE_OR_ROWS:
        return decode_npy
    raise ConfigError(
        f"{source!r} lists {FORMAT_EXTENSIONS[found][0]} files, which hold many "
        f"samples each; read as objects each file would be one sample of raw "
        f"bytes. Pass format={found!r} to read the samples inside them (a glob "
        f"such as '*{FORMAT_EXTENSIONS[found][0]}' does so too), or pass "
        "preprocess= to read each file as one sample."
    )


def _extension_format(urls: str | Sequence[str]) -> str | None:
    names = {
        next(
            (
                f
                for f, exts in FORMAT_EXTENSIONS.items()
                if u.rstrip("/").lower().endswith(exts)
            ),
            None,
        )
        for u in ([urls] if isinstance(urls, str) else urls)
    }
    return names.pop() if len(names) == 1 else None


def unit_hash(url: str, etag: str, lo: int, hi: int, options: str) -> int:
    """64-bit version of one unit: changes with the file's version, its bounds
    or the format options (e.g. the Parquet columns read)."""
    text = f"{url}\0{etag}\0{lo}\0{hi}\0{options}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _options_text(options: dict[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, default=str)


def unit_version(url: str, etag: str, lo: int, hi: int, options: dict[str, Any]) -> str:
    """A unit's version as the stores write it (the chunk version of its items).

    >>> len(unit_version("s3://b/x.tar", "e1", 0, 1024, {}))
    16
    """
    return f"{unit_hash(url, etag, lo, hi, _options_text(options)):016x}"


@dataclass
class FileUnits:
    """What a format found in one file: its units and, optionally, sample keys.

    ``bounds[u] = (lo, hi)`` are positions inside the file in the format's own
    terms (rows for Parquet/HDF5/.npy/LMDB/Datasets, byte offsets for a tar
    span); ``samples[u]`` and ``nbytes[u]`` count the unit's samples and
    source bytes. ``keys`` names every sample of the file in order (tar
    basenames, LMDB keys as bytes), or is empty when samples are rows.
    """

    url: str
    etag: str
    size: int
    bounds: list[tuple[int, int]] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


def _blob(items: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in items], out=offsets[1:])
    return np.frombuffer(b"".join(items), dtype=np.uint8), offsets


def _slice(blob: np.ndarray, offsets: np.ndarray, i: int) -> bytes:
    return bytes(blob[int(offsets[i]) : int(offsets[i + 1])])


class PackedManifest:
    """Files and units of a packed dataset, as arrays (the object-store form).

    >>> f = FileUnits("s3://b/x.npy", "e1", 80, [(0, 6), (6, 10)], [6, 4], [48, 32])
    >>> m = PackedManifest.from_files("s3", "npy", [f], options={})
    >>> len(m), len(m.layout), m.unit(1), m.url(7), m.chunk_source_bytes(0)
    (10, 2, ('s3://b/x.npy', 'e1', 6, 10), 's3://b/x.npy#7', 48)
    """

    def __init__(self, protocol: str, fmt: str, columns: dict[str, np.ndarray]):
        self.protocol = protocol
        self.format = fmt
        self.columns = columns
        self._starts = columns["chunk_starts"]
        self._digest: str | None = None

    @classmethod
    def from_files(
        cls,
        protocol: str,
        fmt: str,
        files: Sequence[FileUnits],
        options: dict[str, Any],
        metas: Sequence[bytes] = (),
    ) -> PackedManifest:
        """Lay out what the format found in each file (in the dataset's order)."""
        option_text = _options_text(options)
        names, name_offsets = _blob([f.url.encode() for f in files])
        etags, etag_offsets = _blob([f.etag.encode() for f in files])
        unit_file = np.concatenate(
            [np.full(len(f.bounds), i, np.int32) for i, f in enumerate(files)]
            or [np.zeros(0, np.int32)]
        )
        bounds = np.array([b for f in files for b in f.bounds], dtype=np.int64).reshape(
            -1, 2
        )
        samples = np.array([n for f in files for n in f.samples], dtype=np.int64)
        starts = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(samples, out=starts[1:])
        hashes = np.fromiter(
            (
                unit_hash(f.url, f.etag, lo, hi, option_text)
                for f in files
                for lo, hi in f.bounds
            ),
            dtype=np.uint64,
            count=len(samples),
        )
        columns = {
            "names": names,
            "name_offsets": name_offsets,
            "etags": etags,
            "etag_offsets": etag_offsets,
            "file_sizes": np.array([f.size for f in files], dtype=np.int64),
            "unit_file": unit_file,
            "unit_bounds": bounds,
            "unit_bytes": np.array([b for f in files for b in f.nbytes], np.int64),
            "unit_hashes": hashes,
            "chunk_starts": starts,
            "options": np.frombuffer(option_text.encode(), dtype=np.uint8),
        }
        metas = list(metas) or [b""] * len(files)
        columns["file_meta"], columns["file_meta_offsets"] = _blob(metas)
        if any(f.keys for f in files):
            keys, key_offsets = _blob([k for f in files for k in f.keys])
            columns.update(keys=keys, key_offsets=key_offsets)
        return cls(protocol, fmt, columns)

    # -- the object-store form ------------------------------------------------------
    def to_object(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "format": self.format, **self.columns}

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> PackedManifest:
        columns = {k: v for k, v in obj.items() if k not in ("protocol", "format")}
        return cls(str(obj["protocol"]), str(obj["format"]), columns)

    # -- files and units (cluster side, per chunk) ----------------------------------
    @property
    def options(self) -> dict[str, Any]:
        return json.loads(bytes(self.columns["options"]) or b"{}")

    @property
    def num_files(self) -> int:
        return len(self.columns["file_sizes"])

    def file(self, i: int) -> tuple[str, str, int]:
        """``(url, etag, size)`` of file ``i``."""
        c = self.columns
        return (
            _slice(c["names"], c["name_offsets"], i).decode(),
            _slice(c["etags"], c["etag_offsets"], i).decode(),
            int(c["file_sizes"][i]),
        )

    def file_urls(self) -> list[str]:
        return [self.file(i)[0] for i in range(self.num_files)]

    def file_meta(self, i: int) -> bytes:
        """What the listing kept about file ``i`` for its reads (a Parquet footer)."""
        return _slice(self.columns["file_meta"], self.columns["file_meta_offsets"], i)

    def file_units(self, i: int) -> FileUnits:
        """File ``i`` as its format listed it (a refresh reuses an unchanged file's)."""
        url, etag, size = self.file(i)
        units = np.flatnonzero(self.columns["unit_file"] == i)
        starts = self._starts
        return FileUnits(
            url,
            etag,
            size,
            [(int(lo), int(hi)) for lo, hi in self.columns["unit_bounds"][units]],
            [int(starts[u + 1] - starts[u]) for u in units],
            [int(b) for b in self.columns["unit_bytes"][units]],
            self.keys(int(starts[units[0]]), int(starts[units[-1] + 1]))
            if len(units)
            else [],
        )

    def unit_file(self, u: int) -> int:
        return int(self.columns["unit_file"][u])

    def unit(self, u: int) -> tuple[str, str, int, int]:
        """``(file url, file etag, lo, hi)`` of unit (= chunk) ``u``."""
        url, etag, _ = self.file(int(self.columns["unit_file"][u]))
        lo, hi = self.columns["unit_bounds"][u]
        return url, etag, int(lo), int(hi)

    def key(self, i: int) -> bytes | None:
        """Sample ``i``'s own key (tar basename, LMDB key), or None for rows."""
        if "keys" not in self.columns:
            return None
        return _slice(self.columns["keys"], self.columns["key_offsets"], i)

    def keys(self, lo: int, hi: int) -> list[bytes]:
        return [k for i in range(lo, hi) if (k := self.key(i)) is not None]

    def url(self, i: int) -> str:
        """A name for sample ``i`` in messages and ``target``: ``file#key``
        (tar, LMDB) or ``file#row`` (row formats)."""
        u = int(np.searchsorted(self._starts, i, side="right") - 1)
        url, _, lo, _ = self.unit(u)
        key = self.key(i)
        if key is not None:
            return f"{url}#{key.decode(errors='backslashreplace')}"
        return f"{url}#{lo + i - int(self._starts[u])}"

    # -- what every manifest answers ------------------------------------------------
    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def total_bytes(self) -> int:
        return int(self.columns["unit_bytes"].sum())

    # Packed files are listed file by file, never published before the end
    # (listing.list_with_layout): never a prefix, no segments.
    is_prefix = False

    @property
    def prefix_ends(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    @property
    def digest(self) -> str:
        if self._digest is None:
            h = hashlib.blake2b(digest_size=8)
            h.update(np.ascontiguousarray(self.columns["unit_hashes"]).tobytes())
            h.update(np.ascontiguousarray(self._starts).tobytes())
            self._digest = h.hexdigest()
        return self._digest

    @property
    def layout(self) -> ChunkLayout:
        return ChunkLayout(self._starts)

    def chunk_versions(self, layout: ChunkLayout) -> np.ndarray:
        return self.columns["unit_hashes"]

    def chunk_source_bytes(self, chunk: int) -> int:
        return int(self.columns["unit_bytes"][chunk])

    def chunk_items(
        self, chunks: Iterable[int], versions: np.ndarray | None = None
    ) -> list[tuple[str, str, int]]:
        hashes, nbytes = self.columns["unit_hashes"], self.columns["unit_bytes"]
        return [
            (chunk_key(c), f"{int(hashes[c]):016x}", int(nbytes[c])) for c in chunks
        ]

    def sample_bytes(self, indices: np.ndarray, chunk_ids: np.ndarray) -> np.ndarray:
        """Source bytes per sample: the unit's bytes shared evenly by its samples
        (exact for fixed-size rows; a unit's total is always exact)."""
        sizes = np.diff(self._starts)[chunk_ids]
        return self.columns["unit_bytes"][chunk_ids] // np.maximum(sizes, 1)

    def row_hashes(self, lo: int, hi: int) -> np.ndarray:
        """Per-row identity for partial rebuilds: a unit is rebuilt whole, so
        every row carries its unit's version."""
        u = int(np.searchsorted(self._starts, lo, side="right") - 1)
        return np.full(hi - lo, self.columns["unit_hashes"][u], dtype=np.uint64)

    def changed_files(self, old: PackedManifest) -> list[str]:
        """URLs of files added, removed or rewritten since ``old``."""
        before = {old.file(i)[0]: old.file(i)[1] for i in range(old.num_files)}
        now = {self.file(i)[0]: self.file(i)[1] for i in range(self.num_files)}
        return sorted(
            u for u in before.keys() | now.keys() if before.get(u) != now.get(u)
        )

"""HDF5 files: one or more datasets indexed along axis 0, a unit per slab of rows.

The listing opens each file once with h5py over an uncached fsspec file
(every metadata read is one exact ranged GET: the superblock, object
headers and chunk B-tree, a few KB) and keeps each dataset's storage
layout in the manifest: the data offset of a contiguous dataset, or the
byte offset and size of every chunk (``chunk_iter``), sorted by row, as
raw arrays that a build views in place and binary-searches for its unit's
chunks (no parse or copy of the file's whole table per unit). A build never opens
the file: it reads its slab's bytes (a contiguous dataset's rows, or the
chunks holding them, touching ones in one GET) and places them with numpy.
Chunks that went through filters (gzip, shuffle, a plugin) are decoded by
HDF5 itself: the listing also keeps a *template* (a tiny in-memory file
with an empty dataset of the same type, shape and filter pipeline), and
the build writes the raw chunks into a copy of it (``write_direct_chunk``)
and reads the slab back. Units hold whole chunks (``cut_rows(align=)``) so
no chunk is read by two units. Compact datasets (data inside the header,
at most 64 KB) are kept whole with the listing; virtual and external
datasets point at other files and are refused.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import numpy as np

from shardcache.errors import SourceFormatError
from shardcache.packed_manifest import FORMAT_EXTENSIONS, FileUnits
from shardcache_server.formats.base import (
    SourceFile,
    SourceFormat,
    UnitRequest,
    cut_rows,
)

__all__ = ["Hdf5Format"]

_METADATA_BLOCK_BYTES = 64 * 2**10  # h5py asks for header pieces; none is cached


def _open(file: SourceFile) -> Any:
    import h5py

    try:
        if file.url.startswith("/") or file.url.startswith("file://"):
            return h5py.File(file.path, "r")
        # cache_type="none": each metadata read is one GET of exactly its
        # bytes (a read-ahead cache would fetch blocks of raw data with it);
        # size= spares the HEAD the file object would send for it.
        handle = file.fs.open(
            file.path,
            "rb",
            block_size=_METADATA_BLOCK_BYTES,
            cache_type="none",
            size=file.size,
        )
        return h5py.File(handle, "r")
    except OSError as exc:
        raise SourceFormatError(
            f"{file.url} is not a readable HDF5 file: {exc}"
        ) from exc


def _datasets(h5: Any, options: dict[str, Any], url: str) -> list[str]:
    import h5py

    names = options.get("datasets")
    available = sorted(k for k, v in h5.items() if isinstance(v, h5py.Dataset))
    if not names:
        names = available
    missing = [n for n in names if n not in h5 or not isinstance(h5[n], h5py.Dataset)]
    if missing or not names:
        raise SourceFormatError(
            f"{url} has no dataset(s) {missing or names}; its root holds "
            f"{available}. Pass format_options={{'datasets': [...]}}."
        )
    lengths = {n: h5[n].shape[0] if h5[n].shape else 0 for n in names}
    if len(set(lengths.values())) != 1:
        raise SourceFormatError(
            f"{url}: datasets {lengths} differ in length along axis 0; choose ones "
            "of one length with format_options={'datasets': [...]}."
        )
    return list(names)


def _chunk_table(dsid: Any) -> np.ndarray:
    """``(n, rank + 3)`` int64: each allocated chunk's logical offset, then its
    byte offset, stored size and filter mask."""
    rows: list[tuple[int, ...]] = []

    def add(info: Any) -> None:
        rows.append((*info.chunk_offset, info.byte_offset, info.size, info.filter_mask))

    try:
        dsid.chunk_iter(add)  # HDF5 >= 1.12.3: one walk of the B-tree
    except AttributeError:
        for i in range(dsid.get_num_chunks()):
            add(dsid.get_chunk_info(i))
    rank = dsid.rank
    table = np.array(rows, dtype=np.int64).reshape(-1, rank + 3)
    # By first row (then the other axes): a unit finds its chunks by binary
    # search (B-tree order is by offset too, but it is not promised).
    return table[np.lexsort(table[:, :rank][:, ::-1].T)] if len(table) else table


def _template(dsid: Any) -> bytes:
    """A file image holding an empty dataset created like ``dsid`` (type,
    shape, chunks, filters, fill value): the build's decoder."""
    import h5py

    dcpl = dsid.get_create_plist()
    # Allocate chunks only as they are written: an early-allocated template
    # would hold the whole dataset.
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_INCR)
    buf = io.BytesIO()
    with h5py.File(buf, "w") as image:
        h5py.h5d.create(image.id, b"d", dsid.get_type(), dsid.get_space(), dcpl=dcpl)
    return buf.getvalue()


def _describe(
    h5: Any, i: int, name: str, url: str, arrays: dict[str, np.ndarray]
) -> dict[str, Any]:
    """What a build needs to read dataset ``i`` (``name``) without opening
    the file; its arrays go to ``arrays`` under names ending in ``i``."""
    import h5py

    d = h5[name]
    dsid, dcpl = d.id, d.id.get_create_plist()
    if d.dtype.hasobject or not d.shape:
        raise SourceFormatError(
            f"{url}: dataset {name!r} is "
            f"{'of variable-length or string type' if d.shape else 'a scalar'}; "
            "it cannot be cached as tensors. Choose numeric datasets with "
            "format_options={'datasets': [...]}."
        )
    entry: dict[str, Any] = {
        "name": name,
        "dtype": np.lib.format.dtype_to_descr(d.dtype),
        "shape": list(d.shape),
    }
    layout = dcpl.get_layout()
    if layout == h5py.h5d.CONTIGUOUS and not dcpl.get_external_count():
        offset = dsid.get_offset()
        entry.update(layout="contiguous", offset=-1 if offset is None else offset)
        if offset is None:  # never written: every row is the fill value
            arrays[f"f{i}"] = np.full(1, d.fillvalue, dtype=d.dtype)
    elif layout == h5py.h5d.CHUNKED:
        table = _chunk_table(dsid)
        complete = len(table) == math.prod(
            -(-n // c) for n, c in zip(d.shape, d.chunks, strict=True)
        )
        direct = not dcpl.get_nfilters() and complete and d.dtype.fields is None
        entry.update(layout="chunked", chunks=list(d.chunks), direct=direct)
        arrays[f"c{i}"] = table
        if not direct:
            arrays[f"t{i}"] = np.frombuffer(_template(dsid), np.uint8)
    elif layout == h5py.h5d.COMPACT:
        entry.update(layout="compact")
        arrays[f"d{i}"] = np.ascontiguousarray(d[()]).view(np.uint8).ravel()
    else:
        raise SourceFormatError(
            f"{url}: dataset {name!r} is virtual or stored in external files, "
            "which are not read in place. Copy it into a plain dataset "
            "(h5repack -l CHUNK or CONTI)."
        )
    arrays.setdefault(f"c{i}", np.zeros((0, 0), np.int64))
    return entry


_KEPT_MAGIC = b"SCH5"  # what the listing keeps: magic, header length, header, arrays
_KEPT_ALIGN = 64  # each array starts at a multiple of this


def _keep(entries: list[dict[str, Any]], arrays: dict[str, np.ndarray]) -> bytes:
    """The entries (JSON) and raw arrays at aligned offsets: a build views
    the arrays it needs in place (no parse, no copy of a whole chunk table
    per unit, as an ``.npz`` would load)."""
    placed, blobs, at = {}, [], 0
    for name, array in arrays.items():
        data = np.ascontiguousarray(array)
        placed[name] = [np.lib.format.dtype_to_descr(data.dtype), list(data.shape), at]
        blobs.append(data.tobytes())
        at += -(-len(blobs[-1]) // _KEPT_ALIGN) * _KEPT_ALIGN
    header = json.dumps({"entries": entries, "arrays": placed}).encode()
    start = -(-(len(_KEPT_MAGIC) + 8 + len(header)) // _KEPT_ALIGN) * _KEPT_ALIGN
    out = bytearray(start + at)
    out[:4], out[4:12] = _KEPT_MAGIC, len(header).to_bytes(8, "little")
    out[12 : 12 + len(header)] = header
    for (_, _, offset), blob in zip(placed.values(), blobs, strict=True):
        out[start + offset : start + offset + len(blob)] = blob
    return bytes(out)


class _Kept:
    """What the listing kept, read in place: ``arrays[name]`` is a view of
    the manifest's bytes, made only for the arrays a unit asks for."""

    def __init__(self, meta: bytes):
        if meta[:4] != _KEPT_MAGIC:
            raise SourceFormatError(
                "the HDF5 layout kept by the listing is of another version; "
                "call DistributedCachedDataset.refresh() to list the files again."
            )
        length = int.from_bytes(meta[4:12], "little")
        header = json.loads(bytes(meta[12 : 12 + length]))
        self.entries: list[dict[str, Any]] = header["entries"]
        self._placed = header["arrays"]
        self._start = -(-(12 + length) // _KEPT_ALIGN) * _KEPT_ALIGN
        self._meta = meta

    def __contains__(self, name: str) -> bool:
        return name in self._placed

    def __getitem__(self, name: str) -> np.ndarray:
        descr, shape, offset = self._placed[name]
        if isinstance(descr, list):
            descr = [tuple(f) for f in descr]
        dtype = np.lib.format.descr_to_dtype(descr)
        count = math.prod(shape)
        return np.frombuffer(self._meta, dtype, count, self._start + offset).reshape(
            shape
        )


def _dtype(entry: dict[str, Any]) -> np.dtype:
    descr = entry["dtype"]
    if isinstance(descr, list):
        descr = [tuple(f) for f in descr]
    return np.lib.format.descr_to_dtype(descr)


def _row_bytes(entry: dict[str, Any]) -> int:
    return math.prod(entry["shape"][1:]) * _dtype(entry).itemsize


def _unit_chunks(table: np.ndarray, rows: int, lo: int, hi: int) -> np.ndarray:
    """The chunks (rows of ``table``, sorted by first row) holding rows ``lo``
    to ``hi``: two binary searches, not a scan of the file's chunk table.

    >>> t = np.array([[0, 0, 8, 0], [0, 4, 8, 0], [4, 0, 8, 0], [8, 0, 8, 0]])
    >>> _unit_chunks(t, 4, 4, 8)[:, :2].tolist()
    [[4, 0]]
    """
    first = table[:, 0]
    a = np.searchsorted(first, lo - rows + 1, side="left")
    b = np.searchsorted(first, hi, side="left")
    return table[a:b]


def _ranges(entry: dict[str, Any], chunks: np.ndarray, lo: int, hi: int) -> list:
    if entry["layout"] == "contiguous":
        if entry["offset"] < 0:
            return []
        width = _row_bytes(entry)
        return [(entry["offset"] + lo * width, entry["offset"] + hi * width)]
    if entry["layout"] == "chunked":
        return [(int(r[-3]), int(r[-3] + r[-2])) for r in chunks]
    return []


def _place(
    entry: dict[str, Any], chunks: np.ndarray, got: dict, lo: int, hi: int
) -> np.ndarray:
    """Unfiltered chunks copied into the slab (edge chunks are stored whole)."""
    dtype, shape, size = _dtype(entry), entry["shape"], entry["chunks"]
    out = np.empty((hi - lo, *shape[1:]), dtype)
    for r in chunks:
        start, at, nbytes = r[: len(shape)], int(r[-3]), int(r[-2])
        block = np.frombuffer(got[(at, at + nbytes)], dtype).reshape(size)
        src, dst = [], []
        for axis, (a, n, c) in enumerate(zip(start, shape, size, strict=True)):
            b = min(int(a) + c, n)
            if axis == 0:
                a, b = max(int(a), lo), min(b, hi)
                src.append(slice(a - int(start[0]), b - int(start[0])))
                dst.append(slice(a - lo, b - lo))
            else:
                src.append(slice(0, b - int(a)))
                dst.append(slice(int(a), b))
        out[tuple(dst)] = block[tuple(src)]
    return out


def _decode(
    template: np.ndarray, chunks: np.ndarray, got: dict, lo: int, hi: int
) -> np.ndarray:
    """Filtered (or partly unallocated) chunks decoded by HDF5's own pipeline."""
    import h5py

    with h5py.File(io.BytesIO(template.tobytes()), "r+") as image:
        dsid = image["d"].id
        rank = dsid.rank
        for r in chunks:
            at, nbytes = int(r[-3]), int(r[-2])
            offset = tuple(int(x) for x in r[:rank])
            dsid.write_direct_chunk(
                offset, got[(at, at + nbytes)], filter_mask=int(r[-1])
            )
        return image["d"][lo:hi]


class Hdf5Format(SourceFormat):
    name = "hdf5"
    options = ("datasets",)
    extensions = FORMAT_EXTENSIONS["hdf5"]

    def list_file(
        self,
        file: SourceFile,
        options: dict[str, Any],
        chunk_samples: int,
        chunk_bytes: int,
    ) -> tuple[FileUnits, bytes]:
        arrays: dict[str, np.ndarray] = {}
        with _open(file) as h5:
            names = _datasets(h5, options, file.url)
            entries = [
                _describe(h5, i, n, file.url, arrays) for i, n in enumerate(names)
            ]
        rows = entries[0]["shape"][0]
        row_bytes = sum(_row_bytes(e) for e in entries)
        # Whole chunks of the dataset holding most bytes per row: its chunks
        # are never read twice (another's, if its chunk rows differ, are
        # read again where a unit boundary cuts one).
        chunked = [e for e in entries if e["layout"] == "chunked"]
        align = max(chunked, key=lambda e: _row_bytes(e))["chunks"][0] if chunked else 1
        bounds, samples, nbytes = cut_rows(
            rows, row_bytes, chunk_samples, chunk_bytes, align=align
        )
        units = FileUnits(file.url, file.etag, file.size, bounds, samples, nbytes)
        return units, _keep(entries, arrays)

    def stacks_columns(self, unit: UnitRequest) -> bool:
        return True

    def read_columns(self, unit: UnitRequest) -> dict[str, np.ndarray]:
        arrays = _Kept(unit.meta)
        entries = arrays.entries
        lo, hi = unit.lo, unit.hi
        picked = []
        for i, e in enumerate(entries):
            table = arrays[f"c{i}"]
            chunks = (
                _unit_chunks(table, e["chunks"][0], lo, hi)
                if e["layout"] == "chunked"
                else table
            )
            picked.append(chunks)
        wanted = [
            r
            for e, c in zip(entries, picked, strict=True)
            for r in _ranges(e, c, lo, hi)
        ]
        got = unit.file.read(wanted)  # one GET per run of touching ranges
        slabs = {}
        for i, (e, chunks) in enumerate(zip(entries, picked, strict=True)):
            dtype, row_shape = _dtype(e), tuple(e["shape"][1:])
            if e["layout"] == "compact":
                whole = arrays[f"d{i}"].view(dtype).reshape(e["shape"])
                slabs[e["name"]] = whole[lo:hi].copy()  # not a view of the manifest
            elif f"f{i}" in arrays:
                fill = arrays[f"f{i}"].astype(dtype)
                slabs[e["name"]] = np.full((hi - lo, *row_shape), fill[0], dtype)
            elif f"t{i}" in arrays:
                slabs[e["name"]] = _decode(arrays[f"t{i}"], chunks, got, lo, hi)
            elif e["layout"] == "chunked":
                slabs[e["name"]] = _place(e, chunks, got, lo, hi)
            else:
                (span,) = _ranges(e, chunks, lo, hi)
                slabs[e["name"]] = np.frombuffer(got[span], dtype).reshape(
                    (hi - lo, *row_shape)
                )
        names = [e["name"] for e in entries]
        return {"_": slabs[names[0]]} if len(names) == 1 else slabs

    def read_samples(self, unit: UnitRequest) -> list[tuple[str, Any]]:
        slabs = self.read_columns(unit)
        n = unit.hi - unit.lo
        rows: list[Any] = (
            [slabs["_"][i] for i in range(n)]
            if list(slabs) == ["_"]
            else [{k: v[i] for k, v in slabs.items()} for i in range(n)]
        )
        return [(f"{unit.file.url}#{unit.lo + i}", r) for i, r in enumerate(rows)]

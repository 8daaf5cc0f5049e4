"""Chunk files: a chunk's numpy columns in one self-describing, mappable file.

The disk tier and the node-local endpoint both keep chunks outside the Ray
object store, so a chunk needs a byte layout that any process can map
read-only and that never goes through pickle (a file on a shared hostPath
is as untrusted as anything read from Redis).

Layout::

    MAGIC (8 bytes) | header length (8 bytes, little-endian) | header JSON
    | padding to 64 | column 0 | padding to 64 | column 1 | ...

The header names each column's dtype (numpy ``dtype.str``, plain numeric
kinds only), shape and byte offset, plus free-form ``meta`` (the dataset,
chunk key and version, so a restarted store can check them in the index).
Columns are 64-byte aligned so the mapped arrays are aligned for SIMD
gathers, as they are in the Ray object store.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from shardcache.errors import ChunkFileError

__all__ = [
    "ALIGN_BYTES",
    "MAGIC",
    "aligned_empty",
    "aligned_start",
    "read_chunk_buffer",
    "read_chunk_file",
    "will_need",
    "write_chunk_file",
]

MAGIC = b"SHCHUNK1"
ALIGN_BYTES = 64  # cache-line alignment of every column, relative to the file start
_KINDS = "biuf"  # bool, signed, unsigned, float: nothing that needs pickle


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def aligned_empty(size: int, raw: np.ndarray | None = None) -> np.ndarray:
    """``size`` bytes starting on an ``ALIGN_BYTES`` boundary, for a chunk's
    bytes received from a socket (its columns are aligned relative to the
    start): a view of ``raw`` (at least ``size + ALIGN_BYTES`` bytes), or of
    a new array."""
    if raw is None:
        raw = np.empty(size + ALIGN_BYTES, dtype=np.uint8)
    start = aligned_start(raw)
    return raw[start : start + size]


def aligned_start(raw: np.ndarray) -> int:
    """The offset of the first ``ALIGN_BYTES`` boundary in ``raw``'s bytes."""
    return -raw.ctypes.data % ALIGN_BYTES


def _header(columns: dict[str, np.ndarray], meta: dict[str, Any]) -> bytes:
    entries, offset = [], 0
    for name, array in columns.items():
        if array.dtype.kind not in _KINDS:
            raise ChunkFileError(
                f"column {name!r} has dtype {array.dtype}, which a chunk file cannot "
                "hold; preprocess must return numeric arrays (bool, int, uint, float)."
            )
        entries.append(
            {
                "name": name,
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "offset": offset,
            }
        )
        offset = _aligned(offset + array.nbytes)
    return json.dumps({"columns": entries, "meta": meta}).encode()


def write_chunk_file(
    path: str | os.PathLike[str],
    columns: dict[str, np.ndarray],
    meta: dict[str, Any] | None = None,
) -> int:
    """Write ``columns`` to ``path`` atomically (temp file, fsync, rename).

    A reader never sees a half-written file: a crash mid-write leaves only a
    ``.tmp`` file, which :func:`read_chunk_file` never opens.

    Returns:
        The file's size in bytes.

    Raises:
        ChunkFileError: a column's dtype cannot be stored without pickle.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> n = write_chunk_file(f"{d}/c0", {"_": np.arange(6, dtype=np.int16).reshape(2, 3)})
    >>> cols, meta = read_chunk_file(f"{d}/c0")
    >>> cols["_"].tolist(), meta
    ([[0, 1, 2], [3, 4, 5]], {})
    """
    header = _header(columns, meta or {})
    body_start = _aligned(len(MAGIC) + 8 + len(header))
    target = Path(path)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(MAGIC + len(header).to_bytes(8, "little") + header)
        out.seek(body_start)
        start = out.tell()
        for array in columns.values():
            out.seek(start + _aligned(out.tell() - start))
            out.write(np.ascontiguousarray(array).data)
        out.flush()
        os.fsync(out.fileno())
        size = out.tell()
    os.replace(tmp, target)
    return size


def read_chunk_file(
    path: str | os.PathLike[str],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Map ``path`` read-only and return its columns (zero-copy views) and meta.

    The mapping stays valid while any returned array is alive, even if the
    file is unlinked meanwhile (POSIX keeps the pages).

    Raises:
        ChunkFileError: the file is missing, truncated or not a chunk file.
    """
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise ChunkFileError(f"cannot map chunk file {path}: {exc}") from exc
    return read_chunk_buffer(mapped, str(path))


def read_chunk_buffer(
    buffer: Any, source: str = "buffer"
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The columns (zero-copy views of ``buffer``) and meta of a chunk file's
    bytes: a read-only ``mmap`` of a file descriptor handed over a socket, or
    bytes received over the network. ``source`` names it in errors.

    Raises:
        ChunkFileError: the bytes are truncated or not a chunk file.
    """
    view = memoryview(buffer)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ChunkFileError(f"{source} is not a chunk file (bad magic)")
    length = int.from_bytes(view[len(MAGIC) : len(MAGIC) + 8], "little")
    header_end = len(MAGIC) + 8 + length
    try:
        header = json.loads(bytes(view[len(MAGIC) + 8 : header_end]))
        body = view[_aligned(header_end) :]
        columns = {}
        for entry in header["columns"]:
            dtype = np.dtype(entry["dtype"])
            if dtype.kind not in _KINDS:
                raise ValueError(f"dtype {dtype} is not allowed")
            count = int(np.prod(entry["shape"], dtype=np.int64))
            array = np.frombuffer(body, dtype, count, entry["offset"])
            columns[entry["name"]] = array.reshape(entry["shape"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ChunkFileError(
            f"chunk file {source} is corrupt or truncated: {exc}"
        ) from exc
    return columns, header.get("meta", {})


try:  # numpy >= 2.0 moved it
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # numpy 1.26
    _byte_bounds = np.byte_bounds


def _mapping(array: np.ndarray) -> mmap.mmap | None:
    """The file mapping ``array`` views, if any (``read_chunk_file``'s columns
    and views of them: ndarray -> ... -> memoryview -> mmap)."""
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def will_need(array: np.ndarray) -> None:
    """Start reading the pages of ``array`` from its file in the background
    (``madvise(MADV_WILLNEED)``) if it views a mapped chunk file; nothing
    otherwise. A gather then finds them in the page cache instead of
    faulting each page in turn, as a DataLoader worker reading ahead would.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = write_chunk_file(f"{d}/c0", {"_": np.ones((4, 1024), np.float32)})
    >>> cols, _ = read_chunk_file(f"{d}/c0")
    >>> will_need(cols["_"][2]), will_need(np.ones(3))
    (None, None)
    """
    mapped = _mapping(array)
    if mapped is None or array.nbytes == 0 or not hasattr(mapped, "madvise"):
        return
    try:
        low, high = _byte_bounds(array)  # any strides: the span it touches
        base = np.frombuffer(mapped, np.uint8).__array_interface__["data"][0]
        start = low - base
        aligned = start - start % mmap.PAGESIZE
        mapped.madvise(mmap.MADV_WILLNEED, aligned, high - base - aligned)
    except (OSError, ValueError):
        pass  # advice only: the gather faults the pages in as before

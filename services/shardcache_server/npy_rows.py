"""Local ``.npy`` files read straight into a chunk's column.

The general build reads each file into a bytes object, decodes a view of
it and copies that into the chunk's column: every byte is written twice
before the chunk goes to the object store, and each 150 KB bytes object is
a fresh allocation the kernel faults in page by page. For the default
preprocess of ``.npy`` objects (``decode_npy``) on local files, the file's
array already is the row: this module parses each header (from a 128-byte
``pread``; a dataset's files share a handful of headers, parsed once per
process) and ``preadv``s the data into the row of one column allocated for
the chunk. A 16.5 MB chunk of 110 (3, 224, 224) uint8 files is read in
~4 ms instead of ~21 ms on this project's 2-core machine (``python -m
shardcache_server.npy_rows``).

Anything this fast path does not model (a file whose shape, dtype or
order differs from the first one's, an object dtype, a Fortran-ordered
array, a missing, short or changed file) makes it answer ``None``, and the
caller builds the chunk the general way, which gives every such member its
usual answer (its own error, a ragged column, numpy's own message).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from shardcache.decoders import npy_data_offset, npy_layout
from shardcache_server.objects import local_changed

__all__ = ["read_npy_column"]

HEAD = 128  # np.save pads headers to a multiple of 64: most fit in one read


def _layout(
    fd: int, size: int
) -> tuple[int, tuple[tuple[int, ...], str, np.dtype]] | None:
    """``(data offset, layout)`` of the file behind ``fd``, or ``None``."""
    head = os.pread(fd, min(HEAD, size), 0)
    end = npy_data_offset(head)
    if end is None:
        return None
    if end > len(head):
        head += os.pread(fd, end - len(head), len(head))
    layout = npy_layout(bytes(head[:end])) if len(head) >= end else None
    return None if layout is None else (end, layout)


def read_npy_column(
    members: Sequence[tuple[str, str, int]], check_versions: bool = False
) -> np.ndarray | None:
    """Rows of one C-ordered column read from local ``.npy`` files, or ``None``.

    ``members`` are ``(url, etag, size)`` as the manifest lists them; a
    file whose size (or, ``check_versions``, mtime) differs from the
    listing's is not read here (the general path reports it as changed).
    """
    column: np.ndarray | None = None
    expected = None
    for row, (url, etag, size) in enumerate(members):
        try:
            fd = os.open(url.split("://", 1)[-1], os.O_RDONLY)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != size:
                return None
            found = _layout(fd, size)
            if found is None:
                return None
            end, layout = found
            if column is None:
                shape, order, dtype = layout
                if order != "C":
                    return None
                expected = layout
                column = np.empty((len(members), *shape), dtype=dtype)
            elif layout != expected:
                return None
            target = memoryview(column[row]).cast("B")
            if (
                end + target.nbytes != size
                or os.preadv(fd, [target], end) != target.nbytes
            ):
                return None
            if check_versions and local_changed(url, etag, os.fstat(fd)) is not None:
                return None  # rewritten since the listing: the general path says so
        finally:
            os.close(fd)
    return column


if __name__ == "__main__":  # pragma: no cover - a measurement, run by hand
    import tempfile
    import time
    from pathlib import Path

    from shardcache.decoders import npy_view

    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i in range(110):
            path = Path(tmp) / f"{i:04d}.npy"
            np.save(path, np.full((3, 224, 224), i % 251, np.uint8))
            files.append((f"file://{path}", "", path.stat().st_size))
        for name, build in (
            ("read, decode a view, copy into the column", None),
            ("read_npy_column", read_npy_column),
        ):
            started = time.perf_counter()
            for _ in range(20):
                if build is None:
                    rows = [npy_view(Path(u[7:]).read_bytes()) for u, _, _ in files]
                    np.stack(rows)
                else:
                    build(files)
            print(
                f"{name}: {(time.perf_counter() - started) / 20 * 1000:.1f} ms per chunk"
            )

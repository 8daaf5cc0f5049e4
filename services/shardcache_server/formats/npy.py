"""``.npy`` files: one big array, one sample per row along axis 0.

The listing reads exactly the header (its length, then the rest: two small
ranged reads); a unit is a slab of rows read with one ranged read.
"""

from __future__ import annotations

import io
import json
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

__all__ = ["NpyFormat"]

_PREFIX_BYTES = 12  # magic (6) + version (2) + header length (2 in v1, 4 after)


def _header(file: SourceFile) -> tuple[tuple[int, ...], np.dtype, int]:
    # The prefix gives the header's length, then exactly the rest of the
    # header is read: no data byte is read at listing (its slab's build reads it).
    head = file.fs.cat_file(file.path, start=0, end=min(file.size, _PREFIX_BYTES))
    if len(head) == _PREFIX_BYTES and head[:6] == b"\x93NUMPY":
        width = 2 if head[6] == 1 else 4
        offset = 8 + width + int.from_bytes(head[8 : 8 + width], "little")
        if offset > _PREFIX_BYTES:
            head += file.fs.cat_file(
                file.path, start=_PREFIX_BYTES, end=min(file.size, offset)
            )
    buf = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(buf)
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read(buf)
    except ValueError as exc:
        raise SourceFormatError(f"{file.url} is not a valid .npy file: {exc}") from exc
    if fortran and len(shape) > 1:
        raise SourceFormatError(
            f"{file.url} is a Fortran-ordered array; rows are not contiguous. Save it "
            "with np.save(np.ascontiguousarray(a))."
        )
    if dtype.hasobject or not shape:
        raise SourceFormatError(
            f"{file.url} holds {'an object' if dtype.hasobject else 'a 0-d'} array; "
            "a .npy source must be a numeric array with samples along axis 0."
        )
    offset = buf.tell()
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    if offset + shape[0] * row_bytes > file.size:
        raise SourceFormatError(
            f"{file.url} is truncated: its header promises {shape[0]} rows of "
            f"{row_bytes} bytes but the file has {file.size} bytes."
        )
    return tuple(shape), dtype, offset


class NpyFormat(SourceFormat):
    name = "npy"
    options = ()
    extensions = FORMAT_EXTENSIONS["npy"]

    def list_file(
        self,
        file: SourceFile,
        options: dict[str, Any],
        chunk_samples: int,
        chunk_bytes: int,
    ) -> tuple[FileUnits, bytes]:
        shape, dtype, offset = _header(file)
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        bounds, samples, nbytes = cut_rows(
            shape[0], row_bytes, chunk_samples, chunk_bytes
        )
        units = FileUnits(file.url, file.etag, file.size, bounds, samples, nbytes)
        header = {"dtype": dtype.str, "shape": list(shape), "offset": offset}
        return units, json.dumps(header).encode()

    def stacks_columns(self, unit: UnitRequest) -> bool:
        return True

    def read_columns(self, unit: UnitRequest) -> dict[str, np.ndarray]:
        header = json.loads(unit.meta)
        dtype = np.dtype(header["dtype"])
        row_shape = tuple(header["shape"][1:])
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        start = header["offset"] + unit.lo * row_bytes
        end = header["offset"] + unit.hi * row_bytes
        data = unit.file.read([(start, end)])[(start, end)]  # length checked
        rows = np.frombuffer(data, dtype=dtype).reshape((unit.hi - unit.lo, *row_shape))
        return {"_": rows}  # read-only is fine: the task's return value is copied

    def read_samples(self, unit: UnitRequest) -> list[tuple[str, Any]]:
        rows = self.read_columns(unit)["_"]
        return [(f"{unit.file.url}#{unit.lo + i}", rows[i]) for i in range(len(rows))]

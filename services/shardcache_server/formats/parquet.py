"""Parquet files: one sample per row, a unit per row group (split when large).

The listing reads each file's footer once (its length, then exactly the
footer: two small ranged reads) and keeps it in the manifest, so a build
reads only its row group's column chunks, with one ranged read, and never
the footer again: each byte of a file is read at most once.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardcache.errors import SourceFormatError
from shardcache.packed_manifest import FORMAT_EXTENSIONS, FileUnits
from shardcache_server.formats.base import (
    SourceFile,
    SourceFormat,
    UnitRequest,
    cut_rows,
)

__all__ = ["ParquetFormat"]

_TAIL_BYTES = 8  # footer length (4 bytes, little-endian) + b"PAR1"


def _read_footer(file: SourceFile) -> bytes:
    """The footer and the 8 bytes after it, read with two ranged reads: the
    length first, then exactly the footer. A speculative larger tail read
    would save a round trip but read the end of the last row group's data,
    which its build reads again; this way each byte is read once."""
    if file.size < 12:
        raise SourceFormatError(
            f"{file.url} is not a Parquet file: {file.size} bytes is too short."
        )
    tail = file.fs.cat_file(file.path, start=file.size - _TAIL_BYTES, end=file.size)
    if len(tail) != _TAIL_BYTES or tail[-4:] != b"PAR1":
        raise SourceFormatError(
            f"{file.url} is not a Parquet file or its footer is corrupt (no PAR1 "
            "magic at the end). Rewrite it with pyarrow.parquet.write_table."
        )
    length = int.from_bytes(tail[:4], "little")
    if length + 12 > file.size:
        raise SourceFormatError(f"{file.url} has a corrupt Parquet footer length")
    start = file.size - _TAIL_BYTES - length
    footer = file.fs.cat_file(file.path, start=start, end=file.size - _TAIL_BYTES)
    if len(footer) != length:
        raise SourceFormatError(
            f"{file.url} returned {len(footer)} bytes of a {length}-byte footer: "
            "the file changed while it was listed. List it again."
        )
    return footer + tail


def _metadata(footer: bytes, url: str) -> pq.FileMetaData:
    try:
        return pq.ParquetFile(pa.BufferReader(b"PAR1" + footer)).metadata
    except (pa.ArrowException, OSError) as exc:
        raise SourceFormatError(f"{url} has a corrupt Parquet footer: {exc}") from exc


def _columns(options: dict[str, Any], schema: pa.Schema, url: str) -> list[str]:
    wanted = options.get("columns") or schema.names
    missing = [c for c in wanted if c not in schema.names]
    if missing:
        raise SourceFormatError(
            f"{url} has no column(s) {missing}; it has {schema.names}. Fix "
            "format_options={'columns': [...]}."
        )
    return list(wanted)


def _byte_span(
    meta: pq.FileMetaData, groups: list[int], columns: list[str]
) -> tuple[int, int]:
    """The one byte range holding the chosen columns of ``groups``: a build
    reads it with a single ranged GET (pyarrow over a Python file object
    would issue one read per column chunk)."""
    lo, hi = None, 0
    for g in groups:
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            if chunk.path_in_schema.split(".", 1)[0] not in columns:
                continue
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and chunk.dictionary_page_offset:
                start = min(start, chunk.dictionary_page_offset)
            lo = start if lo is None else min(lo, start)
            hi = max(hi, start + chunk.total_compressed_size)
    return (lo or 0), hi


class _SpanFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``data`` at ``start``
    is present; pyarrow reads nothing else when given the footer."""

    def __init__(self, start: int, data: bytes, size: int):
        self._start, self._data, self._size, self._pos = start, data, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        at = self._pos - self._start
        if (
            at < 0
            or at + len(buffer) > len(self._data)
            and self._pos + len(buffer) <= self._size
        ):
            raise OSError(
                f"read at {self._pos} outside the fetched span (a footer that does "
                "not match the file: it changed since the listing)"
            )
        chunk = self._data[at : at + len(buffer)]
        buffer[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


class ParquetFormat(SourceFormat):
    name = "parquet"
    extensions = FORMAT_EXTENSIONS["parquet"]

    def list_file(
        self,
        file: SourceFile,
        options: dict[str, Any],
        chunk_samples: int,
        chunk_bytes: int,
    ) -> tuple[FileUnits, bytes]:
        footer = _read_footer(file)
        meta = _metadata(footer, file.url)
        _columns(options, meta.schema.to_arrow_schema(), file.url)
        units = FileUnits(file.url, file.etag, file.size)
        row = 0
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            rows = group.num_rows
            row_bytes = group.total_byte_size / max(rows, 1)
            bounds, samples, nbytes = cut_rows(
                rows, row_bytes, chunk_samples, chunk_bytes, row
            )
            units.bounds += bounds
            units.samples += samples
            units.nbytes += nbytes
            row += rows
        return units, footer

    def _table(self, unit: UnitRequest) -> pa.Table:
        meta = _metadata(unit.meta, unit.file.url)
        columns = _columns(unit.options, meta.schema.to_arrow_schema(), unit.file.url)
        groups, first, row = [], None, 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if row < unit.hi and row + n > unit.lo:
                groups.append(g)
                first = row if first is None else first
            row += n
        lo, hi = _byte_span(meta, groups, columns)
        data = unit.file.fs.cat_file(unit.file.path, start=lo, end=hi)
        try:
            reader = pq.ParquetFile(_SpanFile(lo, data, unit.file.size), metadata=meta)
            table = reader.read_row_groups(groups, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            raise SourceFormatError(
                f"reading rows {unit.lo}-{unit.hi} of {unit.file.url} failed: {exc}"
            ) from exc
        return table.slice(unit.lo - (first or 0), unit.hi - unit.lo)

    def stacks_columns(self, unit: UnitRequest) -> bool:
        schema = _metadata(unit.meta, unit.file.url).schema.to_arrow_schema()
        columns = _columns(unit.options, schema, unit.file.url)
        return all(pa.types.is_primitive(schema.field(c).type) for c in columns)

    def read_columns(self, unit: UnitRequest) -> dict[str, np.ndarray] | None:
        table = self._table(unit)
        out = {}
        for name in table.column_names:
            column = table.column(name)
            if not pa.types.is_primitive(column.type) or column.null_count:
                return None  # nulls: read again as per-row samples (rare)
            out[name] = column.to_numpy()
        return out

    def read_samples(self, unit: UnitRequest) -> list[tuple[str, Any]]:
        table = self._table(unit)
        # Numeric columns keep their dtype (a float32 column stays float32);
        # strings, binaries and lists come as Python values.
        values = {
            name: column.to_numpy()
            if pa.types.is_primitive(column.type) and not column.null_count
            else column.to_pylist()
            for name, column in zip(table.column_names, table.columns, strict=True)
        }
        return [
            (f"{unit.file.url}#{unit.lo + i}", {k: v[i] for k, v in values.items()})
            for i in range(table.num_rows)
        ]

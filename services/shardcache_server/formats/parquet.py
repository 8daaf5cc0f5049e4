"""Parquet files: one sample per row, a unit per run of whole row groups.

The listing reads each file's footer once (its length, then exactly the
footer: two small ranged reads) and keeps it in the manifest, so a build
reads only its row groups' chosen column chunks (the byte ranges the
footer gives, touching ones in one GET) and never the footer again. A row
group is the smallest piece a build can read, so a unit never splits one
unless it is larger than ``chunk_bytes`` (then each piece reads the whole
group: write smaller row groups to avoid it). Each byte is read at most once.
"""

from __future__ import annotations

import io
import threading
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
    which its build reads again; this way each byte is read once. Both reads
    are pinned to the listed version (``SourceFile.read``), so a file
    rewritten since it was listed fails here instead of keeping the new
    layout under the old ETag.

    Raises:
        SourceFormatError: not a Parquet file.
        StaleVersionError: rewritten since the listing.
    """
    if file.size < 12:
        raise SourceFormatError(
            f"{file.url} is not a Parquet file: {file.size} bytes is too short."
        )
    at = (file.size - _TAIL_BYTES, file.size)
    tail = file.read([at])[at]
    if len(tail) != _TAIL_BYTES or tail[-4:] != b"PAR1":
        raise SourceFormatError(
            f"{file.url} is not a Parquet file or its footer is corrupt (no PAR1 "
            "magic at the end). Rewrite it with pyarrow.parquet.write_table."
        )
    length = int.from_bytes(tail[:4], "little")
    if length + 12 > file.size:
        raise SourceFormatError(f"{file.url} has a corrupt Parquet footer length")
    span = (file.size - _TAIL_BYTES - length, file.size - _TAIL_BYTES)
    return file.read([span])[span] + tail


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


def _leaves(kind: pa.DataType) -> int:
    """How many Parquet leaf columns a field of this Arrow type is stored as
    (a struct or map one per leaf, a list as its values).

    >>> _leaves(pa.struct([("a", pa.int8()), ("b", pa.list_(pa.string()))]))
    2
    """
    if kind.num_fields == 0:
        return 1
    return sum(_leaves(kind.field(i).type) for i in range(kind.num_fields))


def _leaf_fields(meta: pq.FileMetaData, url: str) -> list[str]:
    """The top-level field each leaf column belongs to, by position. Names
    cannot tell: ``path_in_schema`` joins names with dots, so a column named
    ``f.x`` and the child ``x`` of a struct ``f`` have the same path.

    Raises:
        SourceFormatError: the schema's leaves do not add up (a corrupt footer).
    """
    out = []
    for field in meta.schema.to_arrow_schema():
        out += [field.name] * _leaves(field.type)
    if len(out) != meta.num_columns:
        raise SourceFormatError(
            f"{url}: its footer's schema has {len(out)} leaf columns but its "
            f"row groups {meta.num_columns}; the footer is corrupt. Rewrite the "
            "file with pyarrow.parquet.write_table."
        )
    return out


def _leaf_indices(meta: pq.FileMetaData, columns: list[str], url: str) -> list[int]:
    """The leaf columns storing ``columns``: what a build reads, by index
    (pyarrow's ``columns=`` takes ``f.x`` as the child ``x`` of ``f``)."""
    chosen = set(columns)
    return [i for i, name in enumerate(_leaf_fields(meta, url)) if name in chosen]


def _column_ranges(
    meta: pq.FileMetaData, groups: list[int], leaves: list[int]
) -> list[tuple[int, int]]:
    """The byte range of each chosen column chunk of ``groups``: a build reads
    these, touching ones with one GET (pyarrow over a Python file object
    would issue one read per page or column chunk), and nothing between."""
    out = []
    for g in groups:
        group = meta.row_group(g)
        for c in leaves:
            chunk = group.column(c)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and chunk.dictionary_page_offset:
                start = min(start, chunk.dictionary_page_offset)
            out.append((start, start + chunk.total_compressed_size))
    return out


class _RangesFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only the ``pieces``
    (``{(lo, hi): bytes}``) are present; pyarrow reads nothing else when
    given the footer."""

    def __init__(self, pieces: dict[tuple[int, int], bytes], size: int):
        # Touching pieces are joined: pyarrow reads neighbouring column
        # chunks with one read.
        runs: list[list[Any]] = []  # [lo, hi, parts]
        for (lo, hi), data in sorted(pieces.items()):
            if runs and runs[-1][1] == lo:
                runs[-1][1] = hi
                runs[-1][2].append(data)
            else:
                runs.append([lo, hi, [data]])
        self._pieces = [((lo, hi), b"".join(parts)) for lo, hi, parts in runs]
        self._size, self._pos = size, 0

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
        want = min(len(buffer), self._size - self._pos)
        if want <= 0:
            return 0
        for (lo, hi), data in self._pieces:
            if lo <= self._pos and self._pos + want <= hi:
                at = self._pos - lo
                buffer[:want] = data[at : at + want]
                self._pos += want
                return want
        raise OSError(
            f"read of {want} bytes at {self._pos} outside the fetched column "
            "chunks (a footer that does not match the file: it changed since "
            "the listing)"
        )


def _units(
    meta: pq.FileMetaData,
    columns: list[str],
    chunk_samples: int,
    chunk_bytes: int,
    url: str,
) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Units of whole row groups: consecutive groups join while the unit
    stays within ``chunk_samples`` rows and ``chunk_bytes`` bytes, and a
    group of more rows is one unit while it fits in ``chunk_bytes``, so no
    group is read twice. Only a group larger than ``chunk_bytes`` is cut
    into row ranges, each of which reads the whole group (Parquet pages
    are not addressable without a page index)."""
    bounds: list[tuple[int, int]] = []
    samples: list[int] = []
    nbytes: list[int] = []
    is_open = False  # whether the last unit may take the next group
    row = 0
    leaves = _leaf_indices(meta, columns, url)
    for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        size = sum(hi - lo for lo, hi in _column_ranges(meta, [g], leaves))
        if (
            is_open
            and samples[-1] + rows <= chunk_samples
            and nbytes[-1] + size <= chunk_bytes
        ):
            bounds[-1] = (bounds[-1][0], row + rows)
            samples[-1] += rows
            nbytes[-1] += size
        elif size <= chunk_bytes:
            # Whole, even past chunk_samples rows: splitting it would read the
            # group once per piece. A group of few but large rows is split.
            bounds.append((row, row + rows))
            samples.append(rows)
            nbytes.append(size)
            is_open = True
        else:
            cut = cut_rows(rows, size / max(rows, 1), chunk_samples, chunk_bytes, row)
            bounds += cut[0]
            samples += cut[1]
            nbytes += cut[2]
            is_open = False
        row += rows
    return bounds, samples, nbytes


class _Parsed(threading.local):
    """This thread's last unit, its parsed footer and columns, and the table
    its rows were read into (kept only between a ``read_columns`` that found
    nulls and the ``read_samples`` the builder calls next, so those bytes are
    not fetched twice). Matched by identity: a unit is one object per build."""

    def __init__(self) -> None:
        self.unit: UnitRequest | None = None
        self.meta: Any = None
        self.columns: list[str] = []
        self.table: pa.Table | None = None


_PARSED = _Parsed()


def _parsed(unit: UnitRequest) -> _Parsed:
    """The unit's footer parsed once, however many calls the build makes."""
    if _PARSED.unit is not unit:
        meta = _metadata(unit.meta, unit.file.url)
        schema = meta.schema.to_arrow_schema()
        _PARSED.unit, _PARSED.meta, _PARSED.table = unit, meta, None
        _PARSED.columns = _columns(unit.options, schema, unit.file.url)
    return _PARSED


class ParquetFormat(SourceFormat):
    name = "parquet"
    options = ("columns",)
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
        columns = _columns(options, meta.schema.to_arrow_schema(), file.url)
        bounds, samples, nbytes = _units(
            meta, columns, chunk_samples, chunk_bytes, file.url
        )
        units = FileUnits(file.url, file.etag, file.size, bounds, samples, nbytes)
        return units, footer

    def _table(self, unit: UnitRequest) -> pa.Table:
        parsed = _parsed(unit)
        if parsed.table is not None:
            return parsed.table
        meta, columns = parsed.meta, parsed.columns
        groups, first, row = [], None, 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if row < unit.hi and row + n > unit.lo:
                groups.append(g)
                first = row if first is None else first
            row += n
        leaves = _leaf_indices(meta, columns, unit.file.url)
        pieces = unit.file.read(_column_ranges(meta, groups, leaves))
        try:
            # pre_buffer=False: pyarrow reads each column chunk on its own
            # (pre-buffering coalesces them across the columns not chosen,
            # whose bytes were never fetched).
            reader = pq.ParquetFile(
                _RangesFile(pieces, unit.file.size), metadata=meta, pre_buffer=False
            )
            # By leaf index: pyarrow's columns= would read a column named
            # "f.x" as the child x of a struct f, whose bytes are not here.
            table = reader.reader.read_row_groups(
                groups, column_indices=leaves, use_threads=True
            ).select(columns)
        except (pa.ArrowException, OSError) as exc:
            raise SourceFormatError(
                f"reading rows {unit.lo}-{unit.hi} of {unit.file.url} failed: {exc}"
            ) from exc
        return table.slice(unit.lo - (first or 0), unit.hi - unit.lo)

    def stacks_columns(self, unit: UnitRequest) -> bool:
        parsed = _parsed(unit)
        schema = parsed.meta.schema.to_arrow_schema()
        return all(pa.types.is_primitive(schema.field(c).type) for c in parsed.columns)

    def read_columns(self, unit: UnitRequest) -> dict[str, np.ndarray] | None:
        table = self._table(unit)
        out = {}
        for name in table.column_names:
            column = table.column(name)
            if not pa.types.is_primitive(column.type) or column.null_count:
                # Nulls: the builder asks read_samples next; it gets this table.
                _parsed(unit).table = table
                return None
            out[name] = column.to_numpy()
        return out

    def read_samples(self, unit: UnitRequest) -> list[tuple[str, Any]]:
        table = self._table(unit)
        _parsed(unit).table = None  # the rows are this call's now
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

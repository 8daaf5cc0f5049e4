"""What a source format does: list a file into units, read a unit's samples.

A format never sees the cache: it turns one file into
:class:`~shardcache.packed_manifest.FileUnits` at listing time (reading only
what it must: a Parquet footer, an HDF5 header, a .npy header, a tar's
member headers) and, at build time, reads the samples of one unit with
ranged reads through fsspec. Both run on the cluster side, in store tasks:
no rank and no DataLoader worker ever opens a source file.

Every format (a registered one too) reads a unit with :meth:`SourceFile.read`:
the unit's byte ranges, sized from the file's own layout (what the listing
kept), one GET each, at the listed version. Never through a read-ahead or
block cache (s3fs's default ``readahead`` cache fetches whole blocks, so
neighbouring units read the same bytes again). A format that cannot be read
in ranges (LMDB is a memory-mapped file) says so in its docstring and
downloads the file once per node.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import ConfigError
from shardcache.packed_manifest import FileUnits
from shardcache_server.fetch import read_ranges

__all__ = ["SourceFile", "SourceFormat", "UnitRequest", "cut_rows"]


@dataclass(frozen=True)
class SourceFile:
    """One listed file: where it is and which version the listing saw."""

    fs: Any  # an fsspec filesystem
    path: str
    url: str
    etag: str
    size: int
    # At listing time, where a format that reads whole units (tar) hands
    # each unit's bytes: ``keep(lo, hi, data) -> kept`` (spans.py); else None.
    keep: Callable[[int, int, bytes], bool] | None = None
    # The source's request budget (``source_rps``) every GET takes a token
    # of, as the LISTs and per-object GETs do; None: no budget.
    budget: Any = None

    def read(self, ranges: list[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
        """The bytes of each ``[lo, hi)``, read at the listed version with one
        GET per run of touching ranges.

        Raises:
            StaleVersionError: the file was rewritten since it was listed.
            SourceNotFound, RemoteFetchError: it is gone, or the store failed.
        """
        return read_ranges(
            self.fs,
            self.path,
            ranges,
            url=self.url,
            etag=self.etag,
            size=self.size,
            budget=self.budget,
        )


@dataclass(frozen=True)
class UnitRequest:
    """One unit to read: rows (or a byte span) ``lo`` to ``hi`` of ``file``."""

    file: SourceFile
    lo: int
    hi: int
    keys: list[bytes]  # the listed sample keys (tar, LMDB), else empty
    meta: bytes  # what the listing kept about the file (a Parquet footer)
    options: dict[str, Any]
    data: Any = None  # the unit's bytes as the listing read them, else None


class SourceFormat:
    """Base class of a format: override ``list_file`` and ``read_samples``.

    ``read_columns`` is the fast path for formats whose samples are rows of
    arrays: when the user kept the default preprocess, a unit becomes its
    chunk's columns with one ranged read and one copy, no Python per sample.
    """

    name = ""
    extensions: tuple[str, ...] = ()
    # The format_options it reads, each a list of names (columns, datasets);
    # None: not declared (a user's format), so not checked.
    options: tuple[str, ...] | None = None
    # True when the listing reads every byte of a unit and offers it to
    # ``SourceFile.keep``, and ``read_samples`` uses ``UnitRequest.data``.
    keeps_spans = False

    def check_options(self, options: dict[str, Any]) -> None:
        """``format_options`` holds only :attr:`options`, each a list of names.

        Raises:
            ConfigError: an unknown key (the nearest known one suggested) or
                a value that is not a list of strings.
        """
        if self.options is None:
            return
        for key, value in options.items():
            if key not in self.options:
                near = difflib.get_close_matches(str(key), self.options, n=1)
                takes = ", ".join(map(repr, self.options)) or "none"
                hint = f"; did you mean {near[0]!r}?" if near else "."
                raise ConfigError(
                    f"format {self.name!r} takes no format_options key {key!r} "
                    f"(it takes {takes}){hint}"
                )
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, str) for v in value
            ):
                raise ConfigError(
                    f"format_options[{key!r}] must be a list of names, got "
                    f"{type(value).__name__} {value!r}; e.g. {{{key!r}: ['x']}}."
                )

    def list_file(
        self,
        file: SourceFile,
        options: dict[str, Any],
        chunk_samples: int,
        chunk_bytes: int,
    ) -> tuple[FileUnits, bytes]:
        """The file's units, and bytes to keep for its reads (or ``b""``)."""
        raise NotImplementedError

    def read_samples(self, unit: UnitRequest) -> list[tuple[str, Any]]:
        """``(key, raw sample)`` for every sample of the unit, in order."""
        raise NotImplementedError

    def stacks_columns(self, unit: UnitRequest) -> bool:
        """Whether :meth:`read_columns` can serve ``unit`` (decided without a read)."""
        return False

    def read_columns(self, unit: UnitRequest) -> dict[str, np.ndarray] | None:
        """The unit's rows stacked per field, or None when they turn out not to
        be (then the builder reads samples instead)."""
        return None


def cut_rows(
    rows: int,
    row_bytes: float,
    chunk_samples: int,
    chunk_bytes: int,
    start: int = 0,
    align: int = 1,
) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Cut ``rows`` rows starting at ``start`` into units of at most
    ``chunk_samples`` rows and about ``chunk_bytes`` bytes.

    ``align``: units hold whole multiples of ``align`` rows (the file's own
    storage blocks, e.g. HDF5 chunks), so no block is read by two units; a
    block of more than ``chunk_samples`` rows is one unit when it fits in
    ``chunk_bytes``, else it is split (and read once per piece).

    >>> cut_rows(10, 8, chunk_samples=4, chunk_bytes=10**6)
    ([(0, 4), (4, 8), (8, 10)], [4, 4, 2], [32, 32, 16])
    >>> cut_rows(10, 8, chunk_samples=4, chunk_bytes=10**6, align=3)[0]
    [(0, 3), (3, 6), (6, 9), (9, 10)]
    """
    per_unit = max(1, min(chunk_samples, int(chunk_bytes // max(row_bytes, 1)) or 1))
    if align > 1:
        if per_unit >= align:
            per_unit -= per_unit % align
        elif align * row_bytes <= chunk_bytes:
            per_unit = align
    bounds, samples, nbytes = [], [], []
    for lo in range(start, start + rows, per_unit):
        hi = min(lo + per_unit, start + rows)
        bounds.append((lo, hi))
        samples.append(hi - lo)
        nbytes.append(int(round((hi - lo) * row_bytes)))
    return bounds, samples, nbytes

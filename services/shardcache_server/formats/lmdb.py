"""LMDB databases (a local or shared-file-system path): one sample per key.

The listing walks the keys once (keys only, in the database's order) and
keeps them; a unit is a run of consecutive keys, read by one cursor that
starts at the unit's first key. The environment is opened read-only and
without locks, so no lock file is written beside someone else's database.
"""

from __future__ import annotations

import os
from typing import Any

from shardcache.errors import SourceFormatError
from shardcache.packed_manifest import FORMAT_EXTENSIONS, FileUnits
from shardcache_server.formats.base import (
    SourceFile,
    SourceFormat,
    UnitRequest,
    cut_rows,
)

__all__ = ["LmdbFormat"]


def _open(file: SourceFile) -> Any:
    import lmdb

    if "://" in file.url and not file.url.startswith(("file://", "local://")):
        raise SourceFormatError(
            f"{file.url}: LMDB is read from a local or shared-file-system path, not "
            "an object store; mount it and pass the path."
        )
    path = file.path
    try:
        return lmdb.open(
            path,
            readonly=True,
            lock=False,
            readahead=False,
            subdir=os.path.isdir(path),
            max_readers=1024,
        )
    except lmdb.Error as exc:
        raise SourceFormatError(f"{file.url} is not an LMDB database: {exc}") from exc


class LmdbFormat(SourceFormat):
    name = "lmdb"
    extensions = FORMAT_EXTENSIONS["lmdb"]

    def list_file(
        self,
        file: SourceFile,
        options: dict[str, Any],
        chunk_samples: int,
        chunk_bytes: int,
    ) -> tuple[FileUnits, bytes]:
        env = _open(file)
        try:
            with env.begin() as txn:
                keys = list(txn.cursor().iternext(keys=True, values=False))
                stat = txn.stat()
        finally:
            env.close()
        if not keys:
            raise SourceFormatError(f"{file.url} is an empty LMDB database")
        data_bytes = stat["psize"] * (stat["leaf_pages"] + stat["overflow_pages"])
        bounds, samples, nbytes = cut_rows(
            len(keys), data_bytes / len(keys), chunk_samples, chunk_bytes
        )
        return (
            FileUnits(file.url, file.etag, file.size, bounds, samples, nbytes, keys),
            b"",
        )

    def read_samples(self, unit: UnitRequest) -> list[tuple[str, Any]]:
        env = _open(unit.file)
        out: list[tuple[str, Any]] = []
        try:
            with env.begin(buffers=False) as txn:
                cursor = txn.cursor()
                found = cursor.set_key(unit.keys[0])
                for key in unit.keys:
                    if not found or cursor.key() != key:
                        raise SourceFormatError(
                            f"{unit.file.url}: key {key!r} is gone or out of order "
                            "since the listing; the database changed. Call refresh()."
                        )
                    out.append((key.decode(errors="backslashreplace"), cursor.value()))
                    found = cursor.next()
        finally:
            env.close()
        return out

"""LMDB databases: one sample per key.

The listing walks the keys once (keys only, in the database's order) and
keeps them; a unit is a run of consecutive keys, read by one cursor that
starts at the unit's first key. The environment is opened read-only and
without locks, so no lock file is written beside someone else's database.

LMDB cannot be read in ranges: it is a memory-mapped B-tree whose pages a
cursor visits in no order a listing could record. A database on a local or
shared file system is opened in place; one in an object store
(``s3://bucket/db.lmdb/`` holding ``data.mdb``) is downloaded once per node
and version (large ranged GETs at the listed version, into the node's
temporary directory; the listing's download serves the builds on its
node) and every unit on that node reads the local copy. A newer version
replaces the older copy.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
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


_DOWNLOAD_PART_BYTES = 64 * 2**20  # one GET each; a part is in memory at a time
_COPIES_DIR = "shardcache-lmdb"  # under the node's temporary directory


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith(("file://", "local://"))


def _local_copy(file: SourceFile) -> str:
    """A local directory holding ``data.mdb`` at the listed version: made
    once per node (an exclusive lock keeps builds in other processes from
    downloading it again) and reused by every later unit."""
    root = Path(tempfile.gettempdir()) / _COPIES_DIR
    name = hashlib.blake2b(file.url.encode(), digest_size=8).hexdigest()
    version = hashlib.blake2b(file.etag.encode(), digest_size=4).hexdigest()
    target = root / f"{name}-{version}"
    if (target / "data.mdb").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    obj = file.path if file.path.endswith(".mdb") else f"{file.path}/data.mdb"
    source = dataclasses.replace(file, path=obj)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "data.mdb").exists():
            return str(target)
        part = root / f"{name}-{version}.part{os.getpid()}"
        part.mkdir(exist_ok=True)
        with open(part / "data.mdb", "wb") as out:
            for lo in range(0, file.size, _DOWNLOAD_PART_BYTES):
                hi = min(file.size, lo + _DOWNLOAD_PART_BYTES)
                out.write(source.read([(lo, hi)])[(lo, hi)])
        os.rename(part, target)
        # Older versions of this database: readers that still map one keep
        # their pages (the inode lives until they close it).
        for old in root.glob(f"{name}-*"):
            if old != target and old.is_dir() and ".part" not in old.name:
                shutil.rmtree(old, ignore_errors=True)
    return str(target)


def _open(file: SourceFile) -> Any:
    import lmdb

    path = _local_copy(file) if _is_remote(file.url) else file.path
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

"""LMDB databases: one sample per key.

The listing walks the keys once (keys only, in the database's order) and
keeps them; a unit is a run of consecutive keys, read by one cursor that
starts at the unit's first key. The environment is opened read-only and
without locks, so no lock file is written beside someone else's database.

LMDB cannot be read in ranges: it is a memory-mapped B-tree whose pages a
cursor visits in no order a listing could record. A database on a local or
shared file system is opened in place; one in an object store
(``s3://bucket/db.lmdb/`` holding ``data.mdb``, or a single file) is
downloaded once per node
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

from shardcache.errors import ConfigError, SourceFormatError, StaleVersionError
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
_FREE_MARGIN_BYTES = 256 * 2**20  # left free beside a download, for the rest
_OPEN_TRIES = 3  # a newer version may replace the copy between two locks


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith(("file://", "local://"))


def _env(path: str, url: str) -> Any:
    import lmdb

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
        raise SourceFormatError(f"{url} is not an LMDB database: {exc}") from exc


def _data_object(file: SourceFile) -> SourceFile:
    """The object holding the database's pages: the listed object itself when
    it is a file (``x.mdb``, or a single-file ``x.lmdb``), else the
    ``data.mdb`` inside the listed prefix. A name cannot tell a single-file
    ``x.lmdb`` from a directory of that name, so the store is asked (one
    HEAD, once per node and version)."""
    is_file = file.path.endswith(".mdb") or file.fs.isfile(file.path)
    return file if is_file else dataclasses.replace(file, path=f"{file.path}/data.mdb")


def _discard(path: Path, root: Path) -> None:
    """Remove a copy: renamed out of the way first (one atomic step, so no
    reader finds half of it), then deleted. A reader that mapped it keeps
    its pages (the inode lives until it closes the file)."""
    trash = root / f".trash-{os.getpid()}-{path.name}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _download(file: SourceFile, part: Path, root: Path) -> None:
    """``data.mdb`` into ``part``, or nothing left behind.

    Raises:
        ConfigError: the temporary directory lacks room for the database.
    """
    free = shutil.disk_usage(root).free
    if free < file.size + _FREE_MARGIN_BYTES:
        raise ConfigError(
            f"{file.url} needs {file.size} bytes for its node copy but {root} has "
            f"{free} free. Point TMPDIR of the cluster's workers at a disk with "
            "room (not a tmpfs), or keep the database on a shared file system."
        )
    source = _data_object(file)
    part.mkdir(exist_ok=True)
    try:
        with open(part / "data.mdb", "wb") as out:
            for lo in range(0, file.size, _DOWNLOAD_PART_BYTES):
                hi = min(file.size, lo + _DOWNLOAD_PART_BYTES)
                out.write(source.read([(lo, hi)])[(lo, hi)])
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise


def _open_copy(file: SourceFile) -> Any:
    """The database opened from this node's copy at the listed version, made
    once per node (builds in other processes wait on a lock instead of
    downloading it again) and reused by every later unit.

    Readers hold the lock shared from the check through ``lmdb.open``; a
    download and the removal of older copies hold it exclusive, so no copy
    is removed between a reader's check and its open.
    """
    root = Path(tempfile.gettempdir()) / _COPIES_DIR
    name = hashlib.blake2b(file.url.encode(), digest_size=8).hexdigest()
    version = hashlib.blake2b(file.etag.encode(), digest_size=4).hexdigest()
    target = root / f"{name}-{version}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        for _ in range(_OPEN_TRIES):
            fcntl.flock(lock, fcntl.LOCK_SH)
            if (target / "data.mdb").exists():
                return _env(str(target), file.url)
            # Shared to exclusive is not one step: look again once it is held.
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / "data.mdb").exists():
                part = root / f"{name}-{version}.part{os.getpid()}"
                _download(file, part, root)
                os.rename(part, target)
                # Older versions and parts a killed download left: nobody
                # else holds the lock, so none of them is being read or made.
                for old in root.glob(f"{name}-*"):
                    if old != target:
                        _discard(old, root)
                for trash in root.glob(f".trash-*-{name}-*"):
                    shutil.rmtree(trash, ignore_errors=True)
    raise StaleVersionError(
        f"{file.url}: its node copy was replaced by a newer version {_OPEN_TRIES} "
        "times while opening it; the database changed. Call refresh()."
    )


def _open(file: SourceFile) -> Any:
    if _is_remote(file.url):
        return _open_copy(file)
    return _env(file.path, file.url)


class LmdbFormat(SourceFormat):
    name = "lmdb"
    options = ()
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

"""The disk tier: chunk files on the node's local disk, below the memory cache.

Every chunk the store caches is also written here (a chunk file, in the
background, once), so the tier is inclusive: when the eviction policy drops
a chunk from memory its file stays, and the next request for it maps the
file and puts it back into the object store instead of reading the source.
A local rank asking for a chunk that is only here is handed the file's path
instead (``Status.DISK``; see ``Spill.files``), and maps it itself. A store restarted on the same host (a process crash, a rolled DaemonSet pod
with a new Ray node id) finds the files again: each one names its dataset,
chunk key, chunk version, generation and preprocess fingerprint in its
header (``sdk/shardcache/chunk_file.py``), and is served only if those match
what the rank asks for (the version comes from the published manifest, the
generation from the index); a file that does not match is deleted.

Beyond ``disk_bytes`` the least recently used files are deleted. Writes are
atomic (temp file, fsync, rename), so a crash mid-write leaves a ``.tmp``
file, which :meth:`DiskTier.scan` deletes. One directory per host: two
stores on one host (tests) may share it, since a file is only ever served
after its header is checked.

Layout: ``{disk_dir}/{namespace}/{dataset}/{chunk key}.chunk``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from shardcache.checksum import is_intact
from shardcache.chunk_file import read_chunk_file, write_chunk_file
from shardcache.errors import ChunkFileError
from shardcache.keys import validate_name

__all__ = ["DiskTier"]

log = logging.getLogger(__name__)

SUFFIX = ".chunk"
CHECKED = ("dataset", "chunk", "version", "generation", "fingerprint")  # meta served on

Key = tuple[str, str]  # (dataset, chunk key)


class DiskTier:
    """Chunk files of one namespace under ``root``, within a byte budget.

    Thread-safe: the store writes and reads files in worker threads.

    Args:
        root: the node's disk directory (``SHARDCACHE_DISK_DIR``).
        namespace: the deployment; its files live in their own folder.
        budget_bytes: bytes of files kept (``SHARDCACHE_DISK_BYTES``).
    """

    def __init__(self, root: str, namespace: str, budget_bytes: int):
        self.root = Path(root) / validate_name("namespace", namespace)
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._files: OrderedDict[Key, int] = OrderedDict()  # least recent first
        self._lock = threading.Lock()

    def path(self, dataset: str, chunk: str) -> Path:
        return self.root / dataset / f"{chunk}{SUFFIX}"

    def scan(self) -> int:
        """Adopt the files a previous store left (their headers are checked
        when read); delete half-written ones. Returns the files found."""
        if not self.root.is_dir():
            return 0
        found = []
        for folder in self.root.iterdir():
            if not folder.is_dir():
                continue
            for f in folder.iterdir():
                if f.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        f.unlink()
                elif f.name.endswith(SUFFIX):
                    with contextlib.suppress(OSError):
                        st = f.stat()
                        found.append((st.st_mtime, folder.name, f.name, st.st_size))
        with self._lock:
            for _, dataset, name, size in sorted(found):
                key = (dataset, name[: -len(SUFFIX)])
                if key not in self._files:
                    self._files[key] = size
                    self.used_bytes += size
        dropped = self._trim(keep=None)
        self._unlink(dropped)
        return len(found)

    def has(self, dataset: str, chunk: str) -> bool:
        with self._lock:
            return (dataset, chunk) in self._files

    def write(
        self,
        dataset: str,
        chunk: str,
        columns: dict[str, np.ndarray],
        meta: dict[str, Any],
    ) -> list[Key]:
        """Write one chunk's file; returns the chunks whose files were deleted
        to stay within the budget.

        Raises:
            ChunkFileError: a column cannot be stored without pickle.
            OSError: the disk is full or not writable.
        """
        target = self.path(dataset, chunk)
        target.parent.mkdir(parents=True, exist_ok=True)
        size = write_chunk_file(
            target, columns, {**meta, "dataset": dataset, "chunk": chunk}
        )
        key = (dataset, chunk)
        with self._lock:
            self.used_bytes += size - self._files.pop(key, 0)
            self._files[key] = size
        dropped = self._trim(keep=key)
        self._unlink(dropped)
        return dropped

    def read(
        self, dataset: str, chunk: str, expect: dict[str, Any]
    ) -> dict[str, np.ndarray] | None:
        """The chunk's columns (mapped, read-only) if its file matches
        ``expect`` (version, generation, fingerprint), else ``None``; a file
        that does not match or is corrupt is deleted."""
        target = self.path(dataset, chunk)
        if not target.exists():
            self._forget((dataset, chunk))
            return None
        try:
            columns, meta = read_chunk_file(target)
        except ChunkFileError as exc:
            log.warning("deleting unreadable chunk file %s: %s", target, exc)
            self.remove(dataset, chunk)
            return None
        want = {"dataset": dataset, "chunk": chunk, **expect}
        if any(meta.get(k) != want[k] for k in CHECKED if k in want):
            self.remove(dataset, chunk)  # an older version or generation
            return None
        with self._lock:
            if (dataset, chunk) in self._files:
                self._files.move_to_end((dataset, chunk))
            else:  # written by another store on this host, or before a scan
                size = target.stat().st_size
                self._files[(dataset, chunk)] = size
                self.used_bytes += size
        return columns

    def check(
        self, dataset: str, chunk: str, expect: dict[str, Any]
    ) -> tuple[str, int] | None:
        """``(path, column bytes)`` of the chunk's file if its header matches
        ``expect``, else ``None`` (as :meth:`read`). Only the header's pages
        are read: a rank maps the file itself and reads the rows it gathers."""
        columns = self.read(dataset, chunk, expect)
        if columns is None:
            return None
        nbytes = int(sum(v.nbytes for v in columns.values()))
        return str(self.path(dataset, chunk)), nbytes

    def chunks(self, dataset: str) -> list[str]:
        """The chunk keys of ``dataset`` that have a file here."""
        with self._lock:
            return [k for ds, k in self._files if ds == dataset]

    def header(self, dataset: str, chunk: str) -> dict[str, Any] | None:
        """The chunk file's header (version, generation, fingerprint...), or
        ``None`` when it is gone or unreadable. The columns are mapped, not
        read."""
        try:
            columns, meta = read_chunk_file(self.path(dataset, chunk))
        except (ChunkFileError, OSError):
            return None
        return {**meta, "nbytes": int(sum(v.nbytes for v in columns.values()))}

    def is_intact(self, dataset: str, chunk: str) -> bool:
        """Whether the chunk's file exists and its contents match its checksum."""
        try:
            columns, _ = read_chunk_file(self.path(dataset, chunk))
        except ChunkFileError:
            return False
        return is_intact(columns)

    def remove(self, dataset: str, chunk: str) -> None:
        self._forget((dataset, chunk))
        with contextlib.suppress(OSError):
            self.path(dataset, chunk).unlink()

    def drop(self, dataset: str) -> int:
        """Delete every file of ``dataset``; returns how many."""
        with self._lock:
            keys = [k for k in self._files if k[0] == dataset]
        for k in keys:
            self.remove(*k)
        return len(keys)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            by_dataset: dict[str, int] = {}
            for (dataset, _), size in self._files.items():
                by_dataset[dataset] = by_dataset.get(dataset, 0) + size
            return {
                "disk_bytes": self.used_bytes,
                "disk_budget_bytes": self.budget_bytes,
                "disk_chunks": len(self._files),
                "disk_bytes_by_dataset": by_dataset,
            }

    def _forget(self, key: Key) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self.used_bytes -= size

    def _trim(self, keep: Key | None) -> list[Key]:
        dropped = []
        with self._lock:
            for key in list(self._files):
                if self.used_bytes <= self.budget_bytes:
                    break
                if key == keep:
                    continue
                self.used_bytes -= self._files.pop(key)
                dropped.append(key)
        return dropped

    def _unlink(self, keys: list[Key]) -> None:
        for dataset, chunk in keys:
            with contextlib.suppress(OSError):
                os.unlink(self.path(dataset, chunk))

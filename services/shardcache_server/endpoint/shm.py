"""Chunk files in the endpoint's memory-backed volume, written once per node.

A chunk a rank asks for is written once per node, as a chunk file in a
memory-backed volume (``endpoint_shm_dir``, an ``emptyDir`` with
``medium: Memory``), and handed over as a read-only file descriptor; ranks
map it, so the node holds at most one extra copy per chunk and none per
rank. Files are kept in an LRU within ``endpoint_shm_bytes``; evicting one
that ranks still map is safe (the pages live until they unmap).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardcache.chunk_file import write_chunk_file

__all__ = ["ShmFiles"]


class ShmFiles:
    """Chunk files in a memory-backed directory, one per (chunk, version), LRU-bounded.

    Args:
        directory: where to write them (created).
        max_bytes: bytes kept; past it the least recently handed over go.
    """

    def __init__(self, directory: str | Path, max_bytes: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[str, tuple[Path, int]] = OrderedDict()
        self._writing: dict[str, threading.Lock] = {}
        self._bytes = 0
        self._uncached = 0
        self.written = 0  # files written (each one copy of a chunk on this node)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def ensure(
        self,
        key: tuple[Any, ...],
        columns: Callable[[], dict[str, Any]],
        meta: dict[str, Any],
        keep: bool = True,
    ) -> tuple[Path, bool]:
        """The file of ``key``, written from ``columns()`` unless it exists.

        ``keep=False`` (a chunk the store did not cache) writes a file of its
        own that the caller unlinks once handed over. Returns ``(path, unlink)``.
        """
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
        if not keep:
            with self._lock:
                self._uncached += 1
                path = self.directory / f"u{self._uncached}-{name}.chunk"
            write_chunk_file(path, columns(), meta)
            self.written += 1
            return path, True
        with self._lock:
            found = self._files.get(name)
            if found is not None:
                self._files.move_to_end(name)
                return found[0], False
            writing = self._writing.setdefault(name, threading.Lock())
        with writing:  # two ranks asking at once: one writes, the other waits
            try:
                with self._lock:
                    found = self._files.get(name)
                    if found is not None:
                        return found[0], False
                path = self.directory / f"{name}.chunk"
                size = write_chunk_file(path, columns(), meta)
                self.written += 1
                with self._lock:
                    self._files[name] = (path, size)
                    self._bytes += size
                    self._evict(keep_name=name)
            finally:
                with self._lock:
                    self._writing.pop(name, None)
        return path, False

    def discard(self, key: tuple[Any, ...]) -> None:
        """Forget the file of ``key`` (it failed its checksum); ranks mapping
        it keep their pages, the next ``ensure`` writes a new one."""
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
        with self._lock:
            found = self._files.pop(name, None)
            if found is not None:
                self._bytes -= found[1]
        if found is not None:
            found[0].unlink(missing_ok=True)

    def _evict(self, keep_name: str) -> None:
        while self._bytes > self.max_bytes and len(self._files) > 1:
            name, (path, size) = next(iter(self._files.items()))
            if name == keep_name:
                self._files.move_to_end(name)
                continue
            del self._files[name]
            self._bytes -= size
            path.unlink(missing_ok=True)  # ranks mapping it keep their pages

    def clear(self) -> None:
        with self._lock:
            for path, _ in self._files.values():
                path.unlink(missing_ok=True)
            self._files.clear()
            self._bytes = 0

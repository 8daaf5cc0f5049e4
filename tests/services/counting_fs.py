"""A local filesystem that logs every open() and every byte range read.

A test passes ``storage_options={"log_path": LogPath(path)}``. Every process
that unpickles those options (a rank, a store, its listing and build tasks,
on either node) registers :class:`CountingFileSystem` for ``file`` (plain
paths) before it resolves the dataset's paths, so the reads go through it
(the test sends this module by value: workers cannot import the tests
directory). A filesystem built with ``log_path`` appends
one line per open and per read to that file (``O_APPEND`` writes of one
short line are atomic), so the counts survive across worker processes; any
other use of it (without ``log_path``) logs nothing.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem


def _log(log_path: str, line: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def counting_filesystem() -> type[LocalFileSystem]:
    """The class, built where it is used: a test sends this module by value
    (Ray workers cannot import the tests directory), and a class pickled by
    value would carry fsspec's instance cache and its lock."""
    found = fsspec.registry.get("file")
    if found is not None and found.__name__ == "CountingFileSystem":
        return found

    class _CountedFile(LocalFileOpener):
        def __init__(self, path: str, mode: str, log_path: str, **kwargs: Any):
            super().__init__(path, mode, **kwargs)
            self.log_path = log_path

        def read(self, *args: Any, **kwargs: Any) -> bytes:
            at = self.f.tell()
            data = self.f.read(*args, **kwargs)
            _log(self.log_path, f"read {self.path} {at} {len(data)} {os.getpid()}")
            return data

    class CountingFileSystem(LocalFileSystem):
        """``LocalFileSystem`` that logs to ``log_path`` (when given)."""

        def __init__(self, log_path: str = "", **kwargs: Any):
            super().__init__(**kwargs)
            self.log_path = log_path

        def _open(
            self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any
        ) -> Any:
            if not self.log_path or "r" not in mode:
                return super()._open(path, mode, block_size, **kwargs)
            path = self._strip_protocol(path)
            _log(self.log_path, f"open {path} {os.getpid()}")
            return _CountedFile(path, mode, self.log_path, fs=self, **kwargs)

    return CountingFileSystem


def register() -> None:
    """Plain paths resolve to CountingFileSystem in this process (for good:
    without ``log_path`` it is LocalFileSystem, so later users see no change)."""
    fsspec.register_implementation("file", counting_filesystem(), clobber=True)


class LogPath(str):
    """The log's path; unpickling it registers CountingFileSystem there."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _unpickle_log_path, (str(self),)


def _unpickle_log_path(path: str) -> LogPath:
    register()
    return LogPath(path)


def reads(log_path: str) -> tuple[dict[str, int], dict[str, list[tuple[int, int]]]]:
    """``(opens per path, sorted (offset, length) reads per path)`` from the log."""
    opens: dict[str, int] = defaultdict(int)
    ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
    with open(log_path) as log:
        for line in log:
            kind, path, *rest = line.split()
            if kind == "open":
                opens[path] += 1
            elif int(rest[1]):
                ranges[path].append((int(rest[0]), int(rest[1])))
    return dict(opens), {p: sorted(r) for p, r in ranges.items()}

"""Handing freed heap back to the operating system.

glibc keeps what a process frees in its arenas, and after large numpy
arrays come and go it raises its mmap threshold (up to 32 MiB), so later
arrays of that size come from the heap too and stay resident when freed.
A process that made a large transient structure once (a listing's
per-object rows, a rank's shard being dealt) would then hold it for its
life: 28 MB in the Ray worker that listed 1 M objects, counted against the
cache's bytes per sample. ``malloc_trim(0)`` returns those pages; it costs
a walk of the heap (milliseconds), so it runs after such a structure, not
per batch.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["trim"]


@functools.cache
def _malloc_trim() -> Any:
    try:  # the C library this process already runs on, not a search for one
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim() -> bool:
    """Return the free heap to the OS where the C library can (glibc);
    ``False`` where it cannot.

    >>> isinstance(trim(), bool)
    True
    """
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True

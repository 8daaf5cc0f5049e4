"""Buffers a process writes again once nothing views them: no new pages per batch or chunk.

A fresh buffer costs a page fault and the zeroing of each of its pages the
first time it is written: a 2.4 MB batch of 16 images gathered into a new
tensor spent ~230 us of its ~600 us there (``bench/loader.py``,
BENCHMARKS.md), and the TCP stream received 1 MiB chunks at 1.66 GB/s into
new buffers against 2.17 GB/s into reused ones (``bench/flight_cost.py``).

Safety comes from reference counts, not from trusting the caller: every
view of a buffer (a numpy slice, a tensor made with ``torch.from_numpy``,
any view of that tensor, a chunk's columns, the samples cut from it) keeps
the buffer object alive, so a buffer whose only references are this pool's
is free to be written again, and one still viewed anywhere is never
touched. A batch a training step still holds, or a sample a user kept
from three epochs ago, is therefore never overwritten.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import weakref

import numpy as np

from shardcache.chunk_file import ALIGN_BYTES, aligned_start

__all__ = ["BATCH_BUFFERS", "ReusedBuffers"]

_POOLS: weakref.WeakSet[ReusedBuffers] = weakref.WeakSet()


class ReusedBuffers:
    """64-byte-aligned byte buffers, reused once nothing views them.

    Args:
        kept: buffers kept for reuse; at most this many buffers' bytes stay
            allocated beyond what is in use.
    """

    def __init__(self, kept: int):
        self.kept = kept
        self._raw: list[tuple[np.ndarray, int]] = []  # (buffer, aligned start)
        self._lock = threading.Lock()
        _POOLS.add(self)

    def take(self, size: int) -> np.ndarray:
        """An aligned ``size``-byte array: a free kept buffer of about that size, else a new one.

        >>> pool = ReusedBuffers(kept=2)
        >>> a = pool.take(1000); a.ctypes.data % 64, len(a)
        (0, 1000)
        >>> pool.take(1000).ctypes.data == a.ctypes.data  # ``a`` still views it
        False
        >>> address = a.ctypes.data; del a
        >>> pool.take(1000).ctypes.data == address  # nothing views it any more
        True
        """
        need = size + ALIGN_BYTES
        with self._lock:
            for i in range(len(self._raw)):
                raw, start = self._raw[i]
                # References: the pool's tuple, ``raw``, getrefcount's argument.
                if need <= raw.nbytes <= 2 * need and sys.getrefcount(raw) == 3:
                    # By position: == on arrays compares values.
                    entry = self._raw.pop(i)
                    self._raw.append(entry)  # most recently used last
                    return raw[start : start + size]
            raw = np.empty(need, dtype=np.uint8)
            # The offset to the boundary, once: ``ctypes.data`` costs ~2 us.
            start = aligned_start(raw)
            self._raw.append((raw, start))
            if len(self._raw) > self.kept:
                del self._raw[0]  # dropped from the pool; its views keep it alive
            return raw[start : start + size]

    def take_array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An aligned, uninitialised array of ``shape`` and ``dtype`` from the pool."""
        dtype = np.dtype(dtype)
        count = math.prod(shape)  # np.prod's fixed cost is ~5 us a batch
        return self.take(count * dtype.itemsize).view(dtype).reshape(shape)

    def _forget(self) -> None:
        # A forked child (a DataLoader worker) starts with no buffers: the
        # parent's would be copied page by page on the first write.
        self._raw = []
        self._lock = threading.Lock()


def _after_fork() -> None:
    for pool in list(_POOLS):
        pool._forget()


os.register_at_fork(after_in_child=_after_fork)

# Collated batches: the one being gathered, the one the step uses, and one
# or two a DataLoader or a pin-memory thread still passes along.
BATCH_BUFFERS = ReusedBuffers(kept=4)

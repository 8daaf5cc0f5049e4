"""A rank's stable shard kept as its runs of consecutive sample indices.

A shard is made of whole chunks (``sharding.assign_chunks``), so its
ascending indices are a few long runs: one at one rank, about the chunks a
rank holds at many. Kept as an index array it was 4 bytes per sample for
the job's life, next to the epoch's order (another 4): at 1 M samples a
quarter of what a rank may keep per sample. As runs it is a few bytes per
chunk; the array is made when an epoch's order is dealt from it, then freed.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Runs"]


class Runs:
    """The runs ``[starts[i], ends[i])`` of an ascending set of indices.

    >>> r = Runs.of(np.array([0, 1, 2, 7, 8, 12]))
    >>> r.starts.tolist(), r.ends.tolist(), len(r)
    ([0, 7, 12], [3, 9, 13], 6)
    >>> r.array().tolist()
    [0, 1, 2, 7, 8, 12]
    >>> r.contains(np.array([2, 3, 12, -1])).tolist()
    [True, False, True, False]
    """

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        self.starts, self.ends = starts, ends

    @classmethod
    def of(cls, ascending: np.ndarray) -> Runs:
        """The runs of strictly ascending ``ascending``."""
        idx = np.asarray(ascending)  # its own dtype: no int64 copy of a shard
        if not len(idx):
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        starts = idx[np.concatenate(([0], breaks))].astype(np.int64)
        ends = idx[np.concatenate((breaks - 1, [len(idx) - 1]))].astype(np.int64) + 1
        return cls(starts, ends)

    @classmethod
    def span(cls, n: int) -> Runs:
        """All of ``0 .. n-1``."""
        return cls.of(np.arange(0)) if n <= 0 else cls(np.array([0]), np.array([n]))

    def __len__(self) -> int:  # the indices, not the runs
        return int(np.sum(self.ends - self.starts))

    def array(self) -> np.ndarray:
        """The indices, ascending: int32 while they fit (4 bytes a sample)."""
        top = int(self.ends[-1]) if len(self.ends) else 0
        dtype = np.int32 if top < 2**31 else np.int64
        out = np.empty(len(self), dtype=dtype)
        at = 0
        for a, b in zip(self.starts.tolist(), self.ends.tolist(), strict=True):
            out[at : at + b - a] = np.arange(a, b, dtype=dtype)
            at += b - a
        return out

    def contains(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` are in the set."""
        idx = np.asarray(idx)
        at = np.searchsorted(self.starts, idx, side="right") - 1
        inside = at >= 0
        inside[inside] &= idx[inside] < self.ends[at[inside]]
        return inside

"""How far a mixture's epoch has got, independent of the world size, and
which positions of the rest each rank reads.

An epoch is one global sequence (:mod:`shardcache.mix_order`); what is left
of it is every position from ``start`` on, less the few ``skipped`` ones
some rank already delivered ahead of the others. That pair is all a saved
state needs: any world deals the rest again.

Dealing is in rounds of ``world_size * block`` positions of the rest: rank
``r`` reads the ``r``-th run of ``block`` consecutive positions of each
round, so each rank batch of ``block`` samples is one window of the
sequence and holds the weights as every window does. The last, partial
round is split into one contiguous run per rank, lengths one apart. Ranks
that each read ``s`` whole batches leave a prefix behind (``skipped``
empty); any other counts are recorded exactly, position by position.

>>> p = Progress()
>>> [deal(p.rest(10), 2, r, 2).tolist() for r in (0, 1)]
[[0, 1, 4, 5, 8], [2, 3, 6, 7, 9]]
>>> q = p.advance(10, 2, 2, [2, 2])
>>> q.start, q.skipped, [deal(q.rest(10), 3, r, 2).tolist() for r in range(3)]
(4, (), [[4, 5], [6, 7], [8, 9]])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardcache.errors import ConfigError

__all__ = ["Progress", "deal", "deal_lengths"]


def deal_lengths(count: int, world_size: int, block: int) -> list[int]:
    """Every rank's share of ``count`` positions (one apart at most).

    >>> deal_lengths(11, 2, 2)
    [6, 5]
    """
    rounds, tail = divmod(count, world_size * block)
    q, extra = divmod(tail, world_size)
    return [rounds * block + q + (r < extra) for r in range(world_size)]


def deal(rest: np.ndarray, world_size: int, rank: int, block: int) -> np.ndarray:
    """The positions of ``rest`` that ``rank`` reads, in its order."""
    count = len(rest)
    rounds, tail = divmod(count, world_size * block)
    whole = (
        np.arange(rounds, dtype=np.int64)[:, None] * (world_size * block)
        + rank * block
        + np.arange(block, dtype=np.int64)[None, :]
    ).ravel()
    q, extra = divmod(tail, world_size)
    lo = rounds * world_size * block + rank * q + min(rank, extra)
    last = np.arange(lo, lo + q + (rank < extra), dtype=np.int64)
    return rest[np.concatenate((whole, last))]


@dataclass(frozen=True)
class Progress:
    """What is left of an epoch: the positions from ``start`` on, less
    ``skipped`` (ascending, all at or after ``start``)."""

    start: int = 0
    skipped: tuple[int, ...] = ()

    def rest(self, length: int) -> np.ndarray:
        """The positions not yet delivered, ascending."""
        left = np.arange(self.start, length, dtype=np.int64)
        if self.skipped:
            left = left[~np.isin(left, np.asarray(self.skipped, dtype=np.int64))]
        return left

    def advance(
        self, length: int, world_size: int, block: int, consumed: Sequence[int]
    ) -> Progress:
        """After a world of ``world_size`` ranks dealt the rest and rank
        ``r`` delivered the first ``consumed[r]`` of its share.

        Raises:
            ConfigError: a count that is negative or beyond its rank's share.
        """
        rest = self.rest(length)
        shares = deal_lengths(len(rest), world_size, block)
        done = np.zeros(len(rest), dtype=bool)
        for r, c in enumerate(consumed):
            if not 0 <= int(c) <= shares[r]:
                raise ConfigError(
                    f"rank {r} consumed {c} samples but its share of the epoch "
                    f"is {shares[r]}; the state does not belong to this mixture "
                    "or world."
                )
            mine = deal(np.arange(len(rest), dtype=np.int64), world_size, r, block)
            done[mine[: int(c)]] = True
        first = int(np.argmin(done)) if not done.all() else len(rest)
        start = int(rest[first]) if first < len(rest) else length
        ahead = rest[first:][done[first:]].tolist()
        old = [p for p in self.skipped if p >= start]
        return Progress(start, tuple(sorted(ahead + old)))

"""Checks that the batches a rank receives are the ones its sampler dealt.

``ds.sampler`` already gives each rank its own shard. A trainer that splits
the DataLoader over the ranks again (Accelerate's ``prepare()`` wraps every
DataLoader's batch sampler in ``BatchSamplerShard``, which keeps every N-th
batch) would make each rank skip part of its shard, silently. What a
process sees then is the tell: its batches are runs of this rank's order,
but consecutive ones lie ``world_size`` times further apart than a
DataLoader's workers space them. Only the first batches of a pass are
checked (one vector compare over the rank's order each), and a loader
whose batches are not runs of that order (another sampler, a stale epoch in
a persistent worker) switches the check off instead of guessing.
"""

from __future__ import annotations

import numpy as np

from shardcache.errors import ShardedTwiceError

__all__ = ["AUDIT_BATCHES", "DeliveryAudit"]

AUDIT_BATCHES = 4  # batches checked per pass and process: ~L/1e9 s each (L: shard)


class DeliveryAudit:
    """The first batches of one pass, as (start in the order, length)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new pass (epoch or iterator) starts."""
        self._checked = 0
        self._last: tuple[int, int] | None = None

    @property
    def is_done(self) -> bool:
        """Nothing more to check in this pass."""
        return self._checked >= AUDIT_BATCHES

    def check(
        self, order: np.ndarray, idx: np.ndarray, world_size: int, num_workers: int
    ) -> None:
        """Record one batch of ``idx``.

        Raises:
            ShardedTwiceError: two consecutive batches are ``world_size`` times
                further apart in this rank's ``order`` than ``num_workers``
                DataLoader workers space them.

        >>> a = DeliveryAudit(); order = np.arange(100)
        >>> a.check(order, np.arange(0, 10), 2, 1); a.check(order, np.arange(10, 20), 2, 1)
        >>> a.check(order, np.arange(30, 40), 2, 1)
        Traceback (most recent call last):
        ...
        shardcache.errors.ShardedTwiceError: ...
        """
        if self._checked >= AUDIT_BATCHES or world_size < 2 or len(idx) < 2:
            return
        self._checked += 1
        hits = np.flatnonzero(order == idx[0])
        n = len(idx)
        if not len(hits) or not np.array_equal(order[hits[0] : hits[0] + n], idx):
            self._checked = AUDIT_BATCHES  # not this order's runs: nothing to tell
            return
        last, self._last = self._last, (int(hits[0]), n)
        if (
            last is None
            or self._last[0] - last[0] != world_size * num_workers * last[1]
        ):
            return
        raise ShardedTwiceError(
            f"this rank receives only 1 in {world_size} of its own batches: "
            "the DataLoader was split over the ranks a second time, on top of "
            "ds.sampler, which already gives each rank its shard (Accelerate's "
            "accelerator.prepare() does this to every DataLoader it is given). "
            "Pass only the model and optimizer to accelerator.prepare() and "
            "iterate the DataLoader as built, moving batches to "
            "accelerator.device (docs/trainers.md)."
        )

"""Checks that the batches a rank receives are the ones its sampler dealt.

``ds.sampler`` already gives each rank its own shard. A trainer that splits
the DataLoader over the ranks again (Accelerate's ``prepare()`` wraps every
DataLoader's batch sampler in ``BatchSamplerShard``, which keeps every N-th
batch, or the N-th slice of each batch with ``split_batches=True``) would
make each rank skip part of its shard, silently. In the process that
iterates the sampler (the rank's own, for a DataLoader without workers,
as the README and the trainers' defaults have it), the first batch
already tells: a plain loader asks for each batch as soon as the sampler
has yielded it, so the first batch is the head of the pass and the
sampler is exactly one batch ahead of where the pass began. A loader split
N ways has read N batches' worth before its first (``BatchSamplerShard``
collects a batch for every rank before it hands out one, or cuts one batch
in N) and hands this rank the k-th of them (k < N). In a DataLoader worker
(whose copy of the sampler is not the one iterated) the second batch
tells: consecutive batches then lie N times further apart than the
workers space them.

Only the first batches of a pass are checked (one vector compare over the
rank's order each), and a loader whose batches are not runs of that order
(another sampler, a stale epoch in a persistent worker) switches the check
off instead of guessing. If such a batch holds samples of other ranks'
shards, the loader does not use ``ds.sampler`` at all (the Hugging Face
``Trainer``'s own ``RandomSampler``, or a DataLoader with ``shuffle=True``):
the data may still be right if something downstream splits it over the
ranks, but every rank reads from every node, so that is a warning, once.
"""

from __future__ import annotations

import warnings

import numpy as np

from shardcache.errors import ShardedTwiceError
from shardcache.runs import Runs

__all__ = ["AUDIT_BATCHES", "DeliveryAudit"]

AUDIT_BATCHES = 4  # batches checked per pass and process: ~L/1e9 s each (L: shard)


class DeliveryAudit:
    """The first batches of one pass, as (start in the order, length).

    Args:
        start: where in the order the pass begins (a resumed epoch skips).
    """

    def __init__(self, start: int = 0) -> None:
        self._warned = False  # the foreign-sampler warning: once per sampler
        self.reset(start)

    def reset(self, start: int | None = None) -> None:
        """A new pass (epoch or iterator) starts, at ``start`` if given."""
        self._checked = 0
        self._last: tuple[int, int] | None = None
        if start is not None:
            self._start = int(start)

    @property
    def is_done(self) -> bool:
        """Nothing more to check in this pass."""
        return self._checked >= AUDIT_BATCHES

    def check(
        self,
        order: np.ndarray,
        idx: np.ndarray,
        world_size: int,
        num_workers: int = 1,
        *,
        yielded: int | None = None,
        shard: Runs | None = None,
    ) -> None:
        """Record one batch of ``idx``.

        Args:
            order: this rank's order of the pass. world_size: ranks.
            num_workers: DataLoader workers (1: none).
            yielded: in the process that iterates the sampler, how far into
                ``order`` it has yielded (the pass began at :meth:`reset`'s
                ``start``); ``None`` in a DataLoader worker,
                whose copy of the sampler is not the one iterated.
            shard: this rank's stable shard, as runs (None: every rank
                reads from all samples, ``shuffle="global"``).

        Raises:
            ShardedTwiceError: the batch is not where a loader that gives
                this rank all of its samples would put it (see the module).

        >>> a = DeliveryAudit(); order = np.arange(100)
        >>> a.check(order, np.arange(0, 10), 2, yielded=10)  # a plain loader
        >>> DeliveryAudit().check(order, np.arange(0, 10), 2, yielded=20)
        Traceback (most recent call last):
        ...
        shardcache.errors.ShardedTwiceError: ...
        >>> DeliveryAudit().check(np.arange(20), np.arange(0, 10), 2, yielded=20)  # drained
        """
        if self._checked >= AUDIT_BATCHES or world_size < 2 or len(idx) < 2:
            return
        self._checked += 1
        hits = np.flatnonzero(order == idx[0])
        n = len(idx)
        if not len(hits) or not np.array_equal(order[hits[0] : hits[0] + n], idx):
            self._checked = AUDIT_BATCHES  # not this order's runs: nothing to tell
            if shard is not None and not self._warned and _outside(shard, idx):
                self._warned = True
                warnings.warn(_foreign_sampler(world_size), stacklevel=4)
            return
        pos = int(hits[0])
        if self._checked == 1 and yielded is not None:
            # A plain loader: offset 0, one batch ahead. Split N ways: the
            # k-th of the N batches (or slices) read, N batches ahead.
            ahead = yielded - self._start  # samples the sampler dealt this pass
            offset = pos - self._start  # where this batch starts in the pass
            # A sampler drained to its end (``list(ds.sampler)`` first, or a
            # pass of exactly N batches) tells nothing: the rule needs one.
            drained = yielded >= len(order)
            if not drained and ahead == world_size * n and offset in range(0, ahead, n):
                raise _split_again(world_size)
        last, self._last = self._last, (pos, n)
        if last is not None and pos - last[0] == world_size * num_workers * last[1]:
            raise _split_again(world_size)


def _outside(shard: Runs, idx: np.ndarray) -> bool:
    """Whether any of ``idx`` is not in ``shard``."""
    return not bool(np.all(shard.contains(idx)))


def _foreign_sampler(world_size: int) -> str:
    return (
        f"this rank (of {world_size}) is asked for samples of other ranks' "
        "shards: its DataLoader does not use ds.sampler (the Hugging Face "
        "Trainer's own sampler, or shuffle=True), so every rank reads from "
        "every node instead of its node-local shard, ds.set_epoch is not "
        "called through the sampler, and unless the trainer splits the loader "
        "over the ranks each rank reads the whole dataset. Use "
        "DataLoader(ds, batch_size=B, sampler=ds.sampler), or with the Hugging "
        "Face Trainer the subclass of docs/trainers.md."
    )


def _split_again(world_size: int) -> ShardedTwiceError:
    return ShardedTwiceError(
        f"this rank receives only 1 in {world_size} of its own batches: "
        "the DataLoader was split over the ranks a second time, on top of "
        "ds.sampler, which already gives each rank its shard (Accelerate's "
        "accelerator.prepare() and so the Hugging Face Trainer do this to "
        "every DataLoader they are given). Pass only the model and optimizer "
        "to accelerator.prepare() and iterate the DataLoader as built, moving "
        "batches to accelerator.device; with the Hugging Face Trainer, use "
        "the Trainer subclass of docs/trainers.md."
    )

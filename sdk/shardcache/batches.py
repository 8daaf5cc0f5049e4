"""Batches with the same number of steps on every rank, for a rank's order.

DDP needs every rank to take the same number of steps. Ranks hold equal
shares, except after an elastic resume (:mod:`shardcache.resume`), where
they differ by at most one sample: :func:`batch_bounds` cuts a rank's share
so that no rank takes a step more and no sample is skipped or repeated, and
:class:`ShardBatchSampler` is that cut as a DataLoader ``batch_sampler``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np
from torch.utils.data import Sampler, get_worker_info

from shardcache.errors import ConfigError

__all__ = ["RankOrder", "ShardBatchSampler", "batch_bounds", "read_elsewhere"]


class RankOrder(Protocol):
    """What a batch sampler needs of a rank's sampler (``ShardSampler``); a
    protocol, so that the sampler can hand out batches of itself without the
    two modules importing each other."""

    _yielded: int
    pending_skip: int

    def __len__(self) -> int: ...
    def lengths(self) -> list[int]: ...
    def order(self) -> np.ndarray: ...
    def _begin_pass(self) -> int: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def batch_bounds(
    length: int, shortest: int, batch_size: int, drop_last: bool = False
) -> list[tuple[int, int]]:
    """``(lo, hi)`` of each batch of a rank holding ``length`` samples when the
    shortest rank holds ``shortest``, such that every rank takes the same
    number of steps (DDP) and no sample is skipped or repeated.

    Lengths differ by at most one after an elastic resume. When the shortest
    rank ends on a full batch, a rank holding one sample more would need a
    step of its own; that sample joins its last batch instead (a batch of
    ``batch_size + 1``). With ``drop_last`` only full batches of the shortest
    length are taken on every rank.

    >>> batch_bounds(9, 8, 4)
    [(0, 4), (4, 9)]
    >>> batch_bounds(7, 6, 4)
    [(0, 4), (4, 7)]
    >>> batch_bounds(9, 8, 4, drop_last=True)
    [(0, 4), (4, 8)]
    """
    if drop_last:
        steps = shortest // batch_size
        return [(i * batch_size, (i + 1) * batch_size) for i in range(steps)]
    steps = -(-shortest // batch_size) if shortest else int(length > 0)
    bounds = [(i * batch_size, min((i + 1) * batch_size, length)) for i in range(steps)]
    if bounds and bounds[-1][1] < length:
        bounds[-1] = (bounds[-1][0], length)
    return bounds


class ShardBatchSampler(Sampler[list[int]]):
    """A rank's batches of the current epoch, every rank the same number of steps.

    Stateful like its sampler: the state is the sampler's (samples yielded).

    Args:
        sampler: the rank's ShardSampler. batch_size: samples per batch.
        drop_last: only full batches. Defaults to ``False``.

    Raises:
        ConfigError: ``batch_size`` < 1, or ``sampler`` is not a dataset's
            ``ds.sampler`` (a trainer put its own in its place).
    """

    def __init__(self, sampler: RankOrder, batch_size: int, drop_last: bool = False):
        if not hasattr(sampler, "_begin_pass"):  # not a dataset's ds.sampler
            # Lightning rebuilds a DataLoader's custom batch sampler around a
            # DistributedSampler of its own unless told not to.
            raise ConfigError(
                "ShardBatchSampler cuts the batches of a dataset's own sampler "
                f"(ds.sampler.batches(B)), got a {type(sampler).__name__}: a trainer "
                "put its own sampler in its place. With PyTorch Lightning pass "
                "Trainer(use_distributed_sampler=False), or use "
                "DataLoader(ds, batch_size=B, sampler=ds.sampler), which it leaves "
                "alone."
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(
                f"batch_size must be an integer >= 1, got {batch_size!r}."
            )
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def _bounds(self, start: int) -> list[tuple[int, int]]:
        s = self.sampler
        # Ranks move in lockstep, so every rank skipped ``start`` samples too.
        shortest = max(min(s.lengths()) - start, 0)
        return batch_bounds(len(s) - start, shortest, self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        s = self.sampler
        start = s._begin_pass()
        order = s.order()
        for lo, hi in self._bounds(start):
            s._yielded = start + hi
            yield order[start + lo : start + hi].tolist()

    def __len__(self) -> int:
        return len(self._bounds(self.sampler.pending_skip))

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def read_elsewhere(sampler: Any, read_here: int, epoch_batch: int) -> int | None:
    """What ``sampler`` handed out this epoch, where DataLoader workers read
    it (``state_dict()`` must then be told the count); ``None`` when the
    reads are this process's own.

    With workers the sampler runs here and the reads in the workers, which
    fetch ``prefetch_factor * num_workers`` batches ahead of the loop: the
    count read here (none) would resume the epoch from its start, replaying
    every batch taken. A ``drop_last`` tail the batch sampler drew and never
    read is less than this epoch's largest read (not the process's first:
    a sample peeked with ``ds[0]`` must not make the threshold 1).
    """
    if get_worker_info() is not None:
        # A worker's copy of the sampler is the main process's, pickled
        # (StatefulDataLoader asks a worker for the dataset's state; its
        # own snapshot is what resumes).
        return None
    handed_out = int(sampler.handed_out())
    return handed_out if handed_out - read_here >= max(epoch_batch, 1) else None

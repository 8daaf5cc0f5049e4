"""Clairvoyant (Belady's MIN): evict the chunk whose next use is furthest away.

The sampler's order is a pure function of ``(chunk sizes, world size, rank,
seed, epoch, shuffle)`` (``sdk/shardcache/sampler.py``), and every rank tells
its store those parameters when it registers (``order`` in the store spec).
So a store knows, for the ranks on its node, at which position of its own
order each rank will next need each chunk, this epoch and the next, and can
evict (or decline to cache) the chunk needed last.

What "next use" means on a node with several ranks (and DataLoader workers):

* A use of chunk ``c`` by rank ``r`` is a position in ``r``'s order whose
  sample lies in ``c``. A rank that holds its chunks asks the store once per
  epoch, at the chunk's *first* use (the prefetcher asks in first-use
  order); a rank that holds nothing (``hold_bytes=0``) asks at every batch
  that has a sample of ``c``. Keeping every use covers both.
* Each local rank has its own clock: its position in its own order, which
  the store infers from the requests (it never hears positions). A store
  call is one batch (or one prefetch group) of one process; the chunks in it
  belong to the rank whose shard holds them, and that rank's clock moves to
  the latest of their next uses. A use up to ``lag`` behind the clock still
  counts (a DataLoader worker a batch or two behind its siblings).
* The next use of ``c`` is the min over the local ranks that read it of
  (next position of ``c`` in the rank's order - the rank's clock): ranks
  advance in lockstep under DDP, so positions of different ranks compare.

With the whole future of every chunk known this is exactly Belady's MIN for
one rank per node; for several it is MIN up to how the ranks interleave.
Chunks of datasets whose order the store was not told (an older client, a
forwarded request for another node's ranks) have no known next use: they
are evicted first, and a chunk with no known next use is not cached over
one (static among themselves). Each eviction sorts the cached chunks (a few
thousand per node: one step per chunk, never per sample); the store keeps
two epochs of positions per local rank as int32 (8 bytes per sample).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardcache.errors import ConfigError
from shardcache.keys import parse_chunk_key
from shardcache.sampler import ShardSampler
from shardcache_server.eviction.base import EvictionPolicy

__all__ = ["ClairvoyantPolicy", "SamplerOrder", "rank_uses"]

NEVER = float("inf")  # next use of a chunk no known rank reads again
LAG_FRACTION = 1 / 16  # of an epoch: how far behind its rank's clock a request may be


@dataclass(frozen=True)
class SamplerOrder:
    """The sampler parameters of one dataset's job, as the ranks send them.

    Args:
        chunk_sizes: samples per chunk, in manifest order.
        world_size, seed, shuffle, drop_last: as for ``ShardSampler``.
        block: ``ShardSampler``'s ``shuffle_block``.
        ranks: the ranks that read on this node (each registered with it).
        epoch: the epoch the ranks were at when they registered.
    """

    chunk_sizes: tuple[int, ...]
    world_size: int
    seed: int
    shuffle: bool | str
    drop_last: bool
    ranks: tuple[int, ...]
    epoch: int = 0
    block: int = 0

    @classmethod
    def from_spec(cls, order: dict[str, Any], chunk_sizes: np.ndarray) -> SamplerOrder:
        """From the ``order`` a rank puts in its store spec.

        Raises:
            ConfigError: a field is missing or has the wrong type.
        """
        try:
            shuffle = order["shuffle"]
            return cls(
                tuple(int(n) for n in chunk_sizes),
                int(order["world_size"]),
                int(order["seed"]),
                shuffle if shuffle == "global" else bool(shuffle),
                bool(order["drop_last"]),
                (int(order["rank"]),),
                int(order.get("epoch", 0)),
                int(order.get("block", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"the sampler order a rank sent is malformed ({exc!r}): {order!r}. "
                "Upgrade shardcache on the ranks to the stores' version."
            ) from None

    def same_job(self, other: SamplerOrder) -> bool:
        return replace(self, ranks=(), epoch=0) == replace(other, ranks=(), epoch=0)


def rank_uses(
    sampler: ShardSampler, starts: np.ndarray, epoch: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``sampler``'s uses of each chunk in ``epoch`` and ``epoch + 1``.

    Returns ``(positions, bounds)``: positions (from the start of ``epoch``)
    sorted by chunk then position, and chunk ``c``'s slice
    ``bounds[c]:bounds[c + 1]``.

    >>> s = ShardSampler([2, 2], 0, 1, shuffle=False)
    >>> [a.tolist() for a in rank_uses(s, np.array([0, 2, 4]), 0)]
    [[0, 1, 4, 5, 2, 3, 6, 7], [0, 4, 8]]
    """
    length = sampler.num_samples
    samples = np.concatenate([sampler.order(epoch), sampler.order(epoch + 1)])
    chunks = np.searchsorted(starts, samples, side="right") - 1
    positions = np.arange(2 * length, dtype=np.int32)
    by_chunk = np.argsort(chunks, kind="stable")  # positions stay ascending
    bounds = np.searchsorted(chunks[by_chunk], np.arange(len(starts)))
    return positions[by_chunk], bounds


class _RankFuture:
    """One local rank's uses for its current epoch and the next, and its clock."""

    def __init__(self, sampler: ShardSampler, starts: np.ndarray, epoch: int):
        self.sampler, self.starts = sampler, starts
        self.length = max(sampler.num_samples, 1)
        self.lag = max(1, int(self.length * LAG_FRACTION))
        self._load(epoch)
        self.now = -1  # position from the start of ``self.epoch``

    def _load(self, epoch: int) -> None:
        self.epoch = epoch
        self.positions, self.bounds = rank_uses(self.sampler, self.starts, epoch)

    def reads(self, chunk: int) -> bool:
        return self.bounds[chunk] < self.bounds[chunk + 1]

    def after(self, chunk: int, position: int) -> int | None:
        """The first use of ``chunk`` at or after ``position``, if known."""
        lo, hi = self.bounds[chunk], self.bounds[chunk + 1]
        i = lo + int(np.searchsorted(self.positions[lo:hi], position, side="left"))
        return int(self.positions[i]) if i < hi else None

    def advance(self, to: int) -> None:
        self.now = max(self.now, to)
        if self.now >= self.length:  # into the next epoch: shift the window
            now = self.now - self.length
            self._load(self.epoch + 1)
            self.now = now


class _Future:
    """One dataset's local ranks."""

    def __init__(self, order: SamplerOrder):
        self.order = order
        sizes = np.asarray(order.chunk_sizes, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.ranks = [
            _RankFuture(
                ShardSampler(
                    sizes,
                    r,
                    order.world_size,
                    shuffle=order.shuffle,
                    seed=order.seed,
                    drop_last=order.drop_last,
                    shuffle_block=order.block,
                ),
                starts,
                order.epoch,
            )
            for r in order.ranks
        ]
        self.chunks = len(sizes)

    def access(self, chunks: list[int]) -> None:
        """One store call's chunks: move each rank's clock to their use."""
        latest: dict[int, int] = {}
        for c in chunks:
            if not 0 <= c < self.chunks:
                continue
            best = None
            for slot, rank in enumerate(self.ranks):
                if not rank.reads(c):
                    continue
                use = rank.after(c, rank.now - rank.lag)
                if use is not None and (best is None or use - rank.now < best[1]):
                    best = (slot, use - rank.now, use)
            if best is not None:
                latest[best[0]] = max(latest.get(best[0], -1), best[2])
        for slot, use in latest.items():
            self.ranks[slot].advance(use)

    def next_use(self, chunk: int) -> float:
        if not 0 <= chunk < self.chunks:
            return NEVER
        soonest = NEVER
        for rank in self.ranks:
            if rank.reads(chunk):
                use = rank.after(chunk, rank.now + 1)
                if use is not None:
                    soonest = min(soonest, use - rank.now)
        return soonest


def _chunk_index(key: Hashable) -> tuple[str, int] | None:
    if not (isinstance(key, tuple) and len(key) == 2):
        return None
    dataset, chunk = key
    try:
        return str(dataset), parse_chunk_key(chunk)
    except ConfigError:
        return None  # not a chunk of a listing: no rank's order names it


class ClairvoyantPolicy(EvictionPolicy):
    """Belady's MIN over the sampler's known order (keys are ``(dataset, "c<n>")``).

    When the budget is full, the chunks whose next use is furthest away go
    first, and a new chunk needed later than all of those is not cached at
    all (``admit`` returns False: it is served uncached). With shuffled epochs
    over a dataset larger than the cache this beats ``static`` (which holds
    the hit rate at cache/dataset) and ``lru`` (which thrashes).
    """

    def __init__(self, budget_bytes: int):
        super().__init__(budget_bytes)
        self._futures: dict[str, _Future] = {}

    def learn(self, dataset: str, order: SamplerOrder) -> None:
        """Take the order of a rank that registered ``dataset`` with this store.

        Ranks of the same job add to the node's set of ranks; a different
        job (other world size, seed or listing) replaces it. A registration
        more than one epoch away from the store's clocks (a job restarted
        or resumed with the same sampler) starts them again at its epoch.
        """
        known = self._futures.get(dataset)
        if known is not None and known.order.same_job(order):
            ranks = tuple(sorted(set(known.order.ranks) | set(order.ranks)))
            known_epoch = min(r.epoch for r in known.ranks)
            if abs(order.epoch - known_epoch) > 1:
                order = replace(order, ranks=ranks)
            elif ranks == known.order.ranks:
                return  # another worker of a known rank, or the rank again
            else:  # a rank joins: plan from the epoch the others are in
                order = replace(order, ranks=ranks, epoch=max(known_epoch, order.epoch))
        self._futures[dataset] = _Future(order)

    def next_use(self, key: Hashable) -> float:
        """How far (in node time units) the next use of ``key`` is; inf if unknown."""
        parsed = _chunk_index(key)
        if parsed is None or parsed[0] not in self._futures:
            return NEVER
        return self._futures[parsed[0]].next_use(parsed[1])

    def observe(self, keys: Iterable[Hashable]) -> None:
        by_dataset: dict[str, list[int]] = {}
        for key in keys:
            parsed = _chunk_index(key)
            if parsed is not None and parsed[0] in self._futures:
                by_dataset.setdefault(parsed[0], []).append(parsed[1])
        for dataset, chunks in by_dataset.items():
            self._futures[dataset].access(chunks)

    def touch(self, key: Hashable) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def admit(self, key: Hashable, nbytes: int) -> tuple[bool, list[Hashable]]:
        if nbytes > self.budget_bytes:
            return False, []
        if key in self._sizes:
            self._insert(key, nbytes)
            return True, []
        need = self.used_bytes + nbytes - self.budget_bytes
        if need <= 0:
            self._insert(key, nbytes)
            return True, []
        mine = self.next_use(key)
        # Furthest next use first; among equals (unknown futures) the oldest.
        ranked = sorted(
            enumerate(self._sizes.items()),
            key=lambda e: (-self.next_use(e[1][0]), e[0]),
        )
        victims, freed = [], 0
        for _, (victim, size) in ranked:
            if freed >= need:
                break
            if self.next_use(victim) <= mine:
                return False, []  # everything cached is needed sooner: bypass
            victims.append(victim)
            freed += size
        for victim in victims:
            self.remove(victim)
        self._insert(key, nbytes)
        return True, victims

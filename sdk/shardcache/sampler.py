"""A DistributedSampler replacement whose shard is stable across epochs.

It is stateful in the protocol torchdata's ``StatefulDataLoader`` expects
(``state_dict``/``load_state_dict``): the state is the epoch and how many
indices this epoch's iterator yielded, so a restored loader continues the
same order exactly. An epoch resumed at another world size
(:mod:`shardcache.resume`) is part of the state too, so it survives a
second save and load.

It is a :class:`~torch.utils.data.DistributedSampler` (same ``num_replicas``,
``rank``, ``epoch``, ``num_samples``, ``total_size`` and ``set_epoch``), so
trainers that re-shard any other sampler over the ranks (Lightning's default
``use_distributed_sampler=True``) leave it as it is. Its rank and world are
read at first use (:class:`~shardcache.world.LazyWorld`), and ``set_epoch``
starts the dataset's epoch too (whichever of the two a trainer calls).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler, get_worker_info

from shardcache.audit import DeliveryAudit
from shardcache.batches import ShardBatchSampler, batch_bounds
from shardcache.chunks import ChunkLayout
from shardcache.errors import ConfigError
from shardcache.resume import (
    STATE_VERSION,
    ResumePlan,
    make_basis,
    plan_resume,
    world_shards,
)
from shardcache.runs import Runs
from shardcache.segments import GrowingListing
from shardcache.sharding import (
    epoch_number,
    epoch_order,
    global_order,
    validate_world,
)
from shardcache.world import LazyWorld, World

log = logging.getLogger("shardcache")

__all__ = [
    "SHUFFLE_MODES",
    "ShardBatchSampler",
    "ShardSampler",
    "batch_bounds",
    "check_order",
    "first_steps",
]

SHUFFLE_MODES = (True, False, "shard", "global")


def check_order(
    rank: int | None,
    world_size: int | None,
    shuffle: Any,
    shuffle_block: Any,
    seed: Any,
    drop_last: Any,
) -> None:
    """Check the arguments that decide the order, before anything starts: a
    bad one is a ConfigError at construction, not after a cluster started
    and the source was listed (or, worse, taken as true: ``drop_last="no"``).

    >>> check_order(None, None, True, 0, 0, False)
    >>> check_order(None, None, 1, 0, 0, False)
    Traceback (most recent call last):
    ...
    shardcache.errors.ConfigError: shuffle must be True, False, 'shard' or 'global', got 1.
    """

    def integer(value: Any) -> bool:  # numpy's integers too, never a bool
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    for label, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and not integer(value):
            raise ConfigError(f"{label} must be an integer or None, got {value!r}.")
    if rank is not None and world_size is not None:
        validate_world(int(rank), int(world_size))
    # 1 == True: only a bool or one of the named modes, never a number.
    if not (isinstance(shuffle, (bool, str)) and shuffle in SHUFFLE_MODES):
        raise ConfigError(
            f"shuffle must be True, False, 'shard' or 'global', got {shuffle!r}."
        )
    if not integer(shuffle_block) or shuffle_block < 0:
        raise ConfigError(
            f"shuffle_block must be an integer >= 0 (samples), got {shuffle_block!r}."
        )
    if shuffle_block and shuffle == "global":
        raise ConfigError(
            "shuffle_block shuffles inside a rank's stable shard; it cannot "
            "be combined with shuffle='global'. Use shuffle=True."
        )
    if not integer(seed) or not 0 <= seed < 2**63:
        raise ConfigError(
            f"seed must be an integer in [0, 2**63), the same on every rank; "
            f"got {seed!r}."
        )
    if not isinstance(drop_last, bool):
        raise ConfigError(f"drop_last must be True or False, got {drop_last!r}.")


class ShardSampler(DistributedSampler[int]):
    """Yields this rank's sample indices for the current epoch.

    Args:
        chunk_sizes: samples per chunk, in manifest order; a rank's shard is
            made of whole chunks (a few split at the edges for balance).
        rank: this rank. world_size: ranks in the job. ``None``: read at
            first use from the process group, else the launcher's variables
            (:meth:`~shardcache.world.World.detect`).
        shuffle: ``True``/``"shard"`` reshuffles inside a stable per-rank
            shard; ``"global"`` is DistributedSampler's global permutation;
            ``False`` keeps shard order.
        seed: shared by all ranks. drop_last: drop instead of pad.
        shuffle_block: with the shard shuffle, shuffle chunk blocks of about
            this many samples instead of the whole shard (0: the whole shard);
            see :func:`~shardcache.sharding.block_shuffle`. Defaults to ``0``.
        listing: a listing the stores still list (``chunk_sizes`` are its
            first chunks; :meth:`extend` adds the rest): its first epoch is
            read segment by segment (:mod:`shardcache.segments`). Defaults
            to a whole listing.
    """

    def __init__(
        self,
        chunk_sizes: Sequence[int] | np.ndarray,
        rank: int | None,
        world_size: int | None,
        *,
        shuffle: bool | str = True,
        seed: int = 0,
        drop_last: bool = False,
        shuffle_block: int = 0,
        listing: GrowingListing | None = None,
    ):
        check_order(rank, world_size, shuffle, shuffle_block, seed, drop_last)
        self.sizes = np.asarray(chunk_sizes, dtype=np.int64)
        self.n = int(np.sum(self.sizes))
        self._world = LazyWorld(rank, world_size)
        self._derived: World | None = None  # the world the shard was cut for
        self._used = False  # an index was dealt: the world can no longer move
        self._on_epoch: Callable[[int, bool], None] | None = None
        self._on_world: Callable[[World], None] | None = None
        self._audit = DeliveryAudit()
        self.mode = "global" if shuffle == "global" else "shard"
        self.shuffle = shuffle is not False
        self.seed, self.drop_last = int(seed), drop_last
        self.block = int(shuffle_block)
        self._layout = ChunkLayout.from_sizes(self.sizes)
        self.epoch = 0
        self._skip = 0
        self._yielded = 0
        # An epoch resumed elastically: its epoch, the merged old state and the
        # nodes (to save and recompute it), this rank's order, all lengths.
        self._resumed: dict[str, Any] | None = None
        self._basis: dict[str, Any] | None = None  # see resume.world_shards
        self._order_cache: tuple[int, np.ndarray] | None = None
        self.listing = listing or GrowingListing()
        self._audit_paused = False  # a pass begun while the listing grew
        self._known: tuple[Any, np.ndarray] | None = None  # known_order's last
        # Asks the dataset for more of a listing still growing (``True``:
        # wait for it); bound like the hooks, never pickled.
        self._grow: Callable[[bool], None] | None = None

    # -- a listing still growing ------------------------------------------------------
    def extend(
        self, chunk_sizes: Sequence[int] | np.ndarray, ends: Any, complete: bool
    ) -> None:
        """The listing grew to ``chunk_sizes`` (its earlier chunks unchanged)."""
        self.sizes = np.asarray(chunk_sizes, dtype=np.int64)
        self.n = int(np.sum(self.sizes))
        self._layout = ChunkLayout.from_sizes(self.sizes)
        self.listing.grew(ends, complete)
        self._order_cache = None
        if complete and self._derived is not None:
            self._cut(self._derived)

    def wait_whole(self) -> None:
        """Return once the listing is whole (at once for almost every one).

        Raises:
            ConfigError: the listing is still growing and this copy of the
                sampler cannot follow it (a pickled copy).
        """
        while not self.listing.complete:
            if self._grow is None:
                raise ConfigError(
                    "this copy of the sampler was made while its listing was "
                    "still being listed and cannot wait for the rest; use the "
                    "dataset's own sampler (ds.sampler)."
                )
            self._grow(True)

    def follow(self, grow: Callable[[bool], None] | None) -> None:
        """Ask ``grow(wait)`` for more of a listing still growing (the dataset's hook)."""
        self._grow = grow

    def use_segments(self, ends: Sequence[int] | None) -> None:
        """The first epoch's segments a saved state read (``None``: none)."""
        self.listing.use_ends(ends)
        self._order_cache = None

    def _segmented(self, epoch: int) -> bool:
        """``epoch`` is the first of a listing read while it was listed."""
        return (
            epoch == 0
            and self.mode == "shard"
            and self.listing.is_segmented
            and not (self._resumed is not None and self._resumed["epoch"] == 0)
        )

    def _segment_orders(self) -> list[np.ndarray]:
        return self.listing.orders(
            self._layout,
            self.world_size,
            self.rank,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            block_samples=self.block,
        )

    def known_order(self) -> np.ndarray:
        """The current epoch's order as far as it is known: all of it, except
        in the first epoch of a listing still growing (its segments so far).
        For look-ahead and checks, never to count an epoch."""
        self._resolve()
        if not self._segmented(self.epoch) or self.listing.complete:
            return self.order()
        orders = self._segment_orders()
        key = (self.epoch, len(orders), self.world_size, self.rank)
        known = self._known  # read once: order() may drop it meanwhile
        if known is None or known[0] != key:  # once per segment
            joined = np.concatenate(orders) if orders else np.zeros(0, np.int64)
            joined.flags.writeable = False
            known = self._known = (key, joined)
        return known[1]

    # -- the world, read at first use -------------------------------------------------
    def bind(
        self,
        on_epoch: Callable[[int, bool], None] | None,
        on_world: Callable[[World], None] | None = None,
    ) -> None:
        """Call ``on_epoch(epoch, resuming)`` from every :meth:`set_epoch` and
        ``on_world(world)`` when the rank is known (the dataset's hooks).
        They are not pickled: the dataset binds its copy again."""
        self._on_epoch, self._on_world = on_epoch, on_world

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(
            _on_epoch=None, _on_world=None, _order_cache=None, _grow=None, _known=None
        )
        return state

    def _resolve(self) -> World:
        if self._derived is None:
            world = self._world.get()
            validate_world(world.rank, world.world_size)
            self._derive(world)
        assert self._derived is not None
        return self._derived

    def _derive(self, world: World) -> None:
        self._derived = world
        self._order_cache = None
        self._cut(world)
        if self._on_world is not None:
            self._on_world(world)

    def _cut(self, world: World) -> None:
        """The stable shard and the epoch's length, from the whole listing
        (a listing still growing is cut once whole: :meth:`extend`)."""
        if not self.listing.complete:
            return
        if self.mode == "shard":
            self._set_shard()
        else:
            w = world.world_size
            self._shard = Runs.span(self.n)
            self._num_samples = self.n // w if self.drop_last else -(-self.n // w)

    def _check_world(self) -> None:
        """At an epoch's start: follow a process group started since the world
        was read, or fail if samples were already dealt for another world."""
        if self._derived is not None and self._world.check(used=self._used):
            self._derive(self._world.get())

    @property
    def rank(self) -> int:
        return self._resolve().rank

    @property
    def world_size(self) -> int:
        return self._resolve().world_size

    @property
    def num_replicas(self) -> int:
        """``world_size``, under DistributedSampler's name."""
        return self.world_size

    @property
    def shard(self) -> np.ndarray:
        """This rank's stable shard (ascending sample indices, read-only),
        made from its runs at each call: the sampler keeps only the runs."""
        self._resolve()
        self.wait_whole()
        shard = self._shard.array()
        shard.flags.writeable = False
        return shard

    @property
    def layout(self) -> ChunkLayout:
        """Which chunk each sample index is in."""
        return self._layout

    @property
    def num_samples(self) -> int:
        """Samples per rank this epoch (the longest rank's, unless drop_last)."""
        self._resolve()
        self.wait_whole()
        if self._segmented(self.epoch):
            return self.listing.length(self._layout, self.world_size, self.drop_last)
        return self._num_samples

    @property
    def total_size(self) -> int:
        return self.num_samples * self.world_size

    def _set_shard(self) -> None:
        if not self.listing.complete:
            return  # cut once the listing is whole (extend)
        shards = world_shards(self.sizes, self.world_size, self.seed, self._basis)
        self._shard = Runs.of(shards[self.rank])
        sizes = [len(s) for s in shards]
        del shards  # every rank's indices: 4 bytes a sample, not kept
        self._num_samples = min(sizes) if self.drop_last else max(sizes)
        self._order_cache = None

    def use_basis(self, basis: Mapping[str, Any] | None) -> None:
        """Derive the shard from the world this job resumed (None: rendezvous
        over ranks), as a saved state says."""
        if self.mode == "shard" and basis != self._basis:
            self._basis = dict(basis) if basis is not None else None
            if self._derived is not None:
                self._set_shard()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` here and in the dataset (``ds.set_epoch`` is the same).

        Raises:
            ConfigError: ``epoch`` is not a whole number >= 0, or a process
                group started since the rank was read and disagrees with it
                (see :class:`~shardcache.world.LazyWorld`).
        """
        epoch = epoch_number(epoch)
        # A resume pending for this very epoch keeps its position.
        resuming = epoch == self.epoch and self._skip > 0
        if epoch != self.epoch:
            if epoch < self.epoch and (self._skip or self._resumed_here()):
                self._warn_dropped_resume(epoch)
            self._skip = 0
            self._yielded = 0
        self.epoch = epoch
        self._check_world()
        self._audit.reset()
        self._audit_paused = False
        if self._on_epoch is not None:
            self._on_epoch(epoch, resuming)

    def _resumed_here(self) -> bool:
        """An elastic resume's plan for the current epoch is pending."""
        return self._resumed is not None and self._resumed["epoch"] == self.epoch

    def _warn_dropped_resume(self, epoch: int) -> None:
        """A loop that restarts at epoch 0 after a resume drops it: the resumed
        epoch is then read whole when the loop reaches it again (a README trial
        delivered 32 samples twice, nothing said). Only a move back warns: the
        next epoch after a state saved at an epoch's end (its last batch
        dropped or not) is what every loop does."""
        log.warning(
            "shardcache: set_epoch(%d) after a resume loaded for epoch %d drops "
            "it: epoch %d will be read from its start, the samples delivered "
            "before the state was saved again. Start the loop at the resumed "
            "epoch: for epoch in range(ds.sampler.epoch, epochs).",
            epoch,
            self.epoch,
            self.epoch,
        )

    def audit(self, indices: np.ndarray) -> None:
        """Check a batch the dataset was asked for (see :mod:`shardcache.audit`).

        Raises:
            ShardedTwiceError: a trainer split this rank's loader over the ranks again.
        """
        if not self.listing.complete:
            # Not checked while the listing grows; nor, then, the rest of this
            # pass (its first check would meet a pass already under way).
            self._audit_paused = True
            return
        if self._audit.is_done or self._audit_paused:
            return
        info = get_worker_info()
        self._audit.check(
            self.order(),
            indices,
            self.world_size,
            info.num_workers if info is not None else 1,
            # A worker's copy of the sampler is not the one iterated.
            yielded=self._yielded if info is None else None,
            shard=self._shard if self.mode == "shard" else None,
        )

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The full order of ``epoch`` (default: the current one), read-only.

        Computed once per epoch: the prefetcher asks for it on every batch.
        """
        self._resolve()
        self.wait_whole()
        e = self.epoch if epoch is None else epoch
        cached = self._order_cache
        if cached is not None and cached[0] == e:
            return cached[1]
        if self._segmented(e):
            order = np.concatenate(self._segment_orders())
        else:
            order = self._compute_order(e)
            if self.epoch > 0:  # the first epoch's segments are not needed any more
                self.listing.forget()
                self._known = None
        order.flags.writeable = False
        self._order_cache = (e, order)
        return order

    def _compute_order(self, e: int) -> np.ndarray:
        if self._resumed is not None and self._resumed["epoch"] == e:
            return self._resumed["order"]
        if self.mode == "global":
            return global_order(
                self.n,
                self.world_size,
                self.rank,
                self.seed,
                e,
                self.shuffle,
                self.drop_last,
            )
        return epoch_order(
            self.shard,
            self.num_samples,
            self.seed,
            e,
            self.shuffle,
            block_samples=self.block,
            layout=self._layout,
        )

    # -- resume ---------------------------------------------------------------------
    def resume(self, epoch: int, consumed: int) -> None:
        """Continue ``epoch`` after its first ``consumed`` samples (once)."""
        self.epoch, self._skip = int(epoch), int(consumed)

    def resume_elastic(
        self, merged: Mapping[str, Any], nodes: Sequence[str] | None
    ) -> ResumePlan:
        """Finish the epoch of ``merged`` (every old rank's state, merged, at any
        world size): this rank yields its share of the samples not yet consumed.

        Raises:
            ConfigError: the state's seed or mode differs from this sampler's.
        """
        for key, mine in (("seed", self.seed), ("mode", self.mode)):
            if merged.get(key) != mine:
                raise ConfigError(
                    f"state has {key}={merged.get(key)!r} but this sampler has "
                    f"{mine!r}; resume with the same settings."
                )
        plan = plan_resume(self.sizes, merged, self.world_size, nodes)
        epoch = int(merged["epoch"])
        if nodes is not None and self.mode == "shard":
            # Later epochs keep chunks where the old world cached them too.
            self.use_basis(make_basis(merged, nodes))
        # Only this rank's order is kept: the sampler is pickled into every
        # DataLoader worker.
        self._resumed = {
            "epoch": epoch,
            "merged": dict(merged),
            "nodes": list(nodes) if nodes is not None else None,
            "order": plan.orders[self.rank],
            "lengths": [len(o) for o in plan.orders],
            "moved": plan.moved_fraction,
        }
        self._order_cache = None
        self.epoch, self._skip = epoch, 0
        return plan

    @property
    def moved_on_resume(self) -> float:
        """Fraction of the resumed epoch's samples dealt to a rank on another
        node than the one that read them (0.0 without an elastic resume)."""
        return self._resumed["moved"] if self._resumed is not None else 0.0

    @property
    def pending_skip(self) -> int:
        """The samples the next iteration skips (a resume not yet consumed)."""
        return self._skip

    def take_skip(self) -> int:
        """The samples a resume skips at the start of this epoch (once)."""
        skip, self._skip = self._skip, 0
        return skip

    def lengths(self) -> list[int]:
        """Every rank's sample count this epoch (equal except after an elastic
        resume, where they differ by at most one)."""
        if self._resumed is not None and self._resumed["epoch"] == self.epoch:
            return list(self._resumed["lengths"])
        return [self.num_samples] * self.world_size

    def __iter__(self) -> Iterator[int]:
        self._resolve()
        self._check_world()
        return self._iterate()

    def _begin_pass(self) -> int:
        """Start an iteration: take the resume's skip (once); returns it."""
        self._resolve()
        self._check_world()
        start = self.take_skip()
        self._yielded = start
        self._used = True
        self._audit.reset(start)
        self._audit_paused = False
        return start

    def _iterate(self) -> Iterator[int]:
        # A generator: nothing (the skip included) is taken until the first
        # index is asked for, so an iterator made and dropped by a loader's
        # restore does not consume the resume. ~40 ns per index.
        start = self._begin_pass()
        if self._segmented(self.epoch) and not self.listing.complete:
            yield from self._iterate_segments(start)
            return
        for i in self.order()[start:].tolist():
            self._yielded += 1
            yield i

    def _iterate_segments(self, start: int) -> Iterator[int]:
        """The first epoch of a listing still growing: each segment as soon
        as it is listed, waiting only when none is left to read."""
        at, number = 0, 0
        while True:
            orders = self._segment_orders()
            if number < len(orders):
                order = orders[number]
                number += 1
                skip = min(max(start - at, 0), len(order))
                at += len(order)
                if number == len(orders) and self._grow is not None:
                    self._grow(False)  # a longer prefix, if one came: no wait
                for i in order[skip:].tolist():
                    self._yielded += 1
                    yield i
            elif self.listing.complete:
                return
            else:
                self.wait_more()

    def wait_more(self) -> None:
        """Wait for the listing to grow (a longer prefix or its end)."""
        if self._grow is None:
            self.wait_whole()  # raises the copy's error
            return
        self._grow(True)

    def handed_out(self) -> int:
        """Indices this process's iteration of the current epoch handed out,
        the resume's skip included (0 before the first)."""
        return self._yielded

    def __len__(self) -> int:
        return self.lengths()[self.rank]

    def batches(self, batch_size: int, drop_last: bool = False) -> ShardBatchSampler:
        """Batches with the same step count on every rank, for
        ``DataLoader(ds, batch_sampler=ds.sampler.batches(B))`` (see
        :func:`batch_bounds`; plain ``batch_size=B`` can leave one rank a step
        more after an elastic resume)."""
        return ShardBatchSampler(self, batch_size, drop_last)

    def state(self) -> dict[str, Any]:
        if self._grow is not None:  # a copy (a DataLoader worker's) says what it knows
            self.wait_whole()
        resumed = self._resumed
        if resumed is not None and resumed["epoch"] != self.epoch:
            resumed = None
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "mode": self.mode,
            "shuffle": self.shuffle,
            "block": self.block,
            "drop_last": self.drop_last,
            "resumed_from": resumed["merged"] if resumed else None,
            "plan_nodes": resumed["nodes"] if resumed else None,
            "basis": self._basis,
            # The first epoch of a listing read while it was listed: its
            # order is a function of these prefix ends, kept for the resume.
            "segments": self.listing.ends.tolist()
            if self._segmented(self.epoch)
            else None,
        }

    # -- torchdata Stateful protocol ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Epoch and indices yielded by the current iterator (StatefulDataLoader)."""
        return {**self.state(), "yielded": self._yielded}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next iterator continues after the ``yielded`` indices of ``state``.

        Raises:
            ConfigError: the state was saved by another rank, world or seed.
        """
        for key in ("seed", "rank", "world_size", "mode"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"sampler state has {key}={state.get(key)!r} but this sampler has "
                    f"{getattr(self, key)!r}; restore with the same settings."
                )
        if int(state.get("block", 0)) != self.block:
            raise ConfigError(
                f"sampler state has shuffle_block={state.get('block', 0)!r} but this "
                f"sampler has {self.block!r}; restore with the same settings."
            )
        self.wait_whole()  # a state is of the whole listing
        self.use_basis(state.get("basis"))
        self.use_segments(state.get("segments"))
        if state.get("resumed_from") is not None:
            self.resume_elastic(state["resumed_from"], state.get("plan_nodes"))
        self.resume(int(state["epoch"]), int(state["yielded"]))
        self._yielded = int(state["yielded"])


def first_steps(
    chunk_sizes: Sequence[int] | np.ndarray,
    world_size: int,
    steps: int,
    batch_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool | str = True,
    drop_last: bool = False,
) -> list[np.ndarray]:
    """Per rank, the chunks its first ``steps`` batches read, in the order first needed.

    >>> [c.tolist() for c in first_steps([4, 4, 4, 4], 2, 1, 2, shuffle=False)]
    [[1], [0]]
    """
    from shardcache.resume import world_orders, world_state

    sizes = np.asarray(chunk_sizes, dtype=np.int64)
    world = world_state(
        world_size,
        epoch=epoch,
        seed=seed,
        mode="global" if shuffle == "global" else "shard",
        shuffle=shuffle is not False,
        drop_last=drop_last,
    )
    starts = np.concatenate(([0], np.cumsum(sizes)))
    out = []
    for order in world_orders(sizes, world):
        head = order[: steps * batch_size]
        chunks = np.searchsorted(starts, head, side="right") - 1
        _, first = np.unique(chunks, return_index=True)
        out.append(chunks[np.sort(first)])
    return out

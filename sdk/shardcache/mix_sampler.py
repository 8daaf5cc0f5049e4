"""Which mixture samples this rank reads: its deal of the epoch's global
sequence, resumable at any world size.

A mixture sample's id is its component's offset plus its index there (as
``ConcatDataset`` numbers them). The sampler is a
:class:`~torch.utils.data.DistributedSampler` (trainers that re-shard other
samplers leave it alone) and stateful in torchdata's protocol. Its state is
the epoch, the weights it runs on, the :class:`~shardcache.mix_progress.Progress`
it started from and how many samples this rank consumed: O(ranks) once
merged, never a list of samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from shardcache.batches import ShardBatchSampler
from shardcache.errors import ConfigError
from shardcache.mix_order import (
    MixOrder,
    check_mixture,
    mixture_order,
    normalise_weights,
)
from shardcache.mix_progress import Progress, deal, deal_lengths
from shardcache.resume.state import by_rank
from shardcache.sharding import epoch_number, validate_world
from shardcache.world import LazyWorld

__all__ = [
    "MIX_STATE_VERSION",
    "MixtureSampler",
    "merge_mix_states",
]

MIX_STATE_VERSION = 1  # bumped when the meaning of a saved mixture state changes
# What every rank of one mixture must agree on (and a resumed one with them).
_SETTINGS = ("seed", "shuffle", "on_exhausted", "epoch_samples", "sizes")
_PER_WORLD = ("world_size", "block", "rank", "consumed")

Weights = Sequence[float] | Callable[[int], Sequence[float]]


class MixtureSampler(DistributedSampler[int]):
    """Yields this rank's mixture ids for the current epoch.

    Args:
        sizes: samples per component. names: per component, for messages.
        weights: one per component, or ``epoch -> weights`` (a curriculum).
        seed, shuffle, on_exhausted, epoch_samples: see
            :func:`~shardcache.mix_order.mixture_order`.
        block: consecutive positions a rank reads per round (its batch size).
        rank, world_size: ``None``: read at first use (as ShardSampler).

    Raises:
        ConfigError: the settings or epoch 0's weights are invalid.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        names: Sequence[str],
        weights: Weights,
        *,
        seed: int = 0,
        shuffle: bool = True,
        on_exhausted: str = "cycle",
        epoch_samples: int | None = None,
        block: int = 1,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        if rank is not None and world_size is not None:
            validate_world(rank, world_size)
        self.sizes = [int(n) for n in sizes]
        self.names = list(names)
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes))).astype(np.int64)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.on_exhausted, self.epoch_samples = on_exhausted, epoch_samples
        self.block = int(block)
        self._schedule = weights
        self._world = LazyWorld(rank, world_size)
        self._used = False  # an id was dealt: the world can no longer move
        self._on_epoch: Callable[[int, bool], None] | None = None
        self.epoch = 0
        self.weights = self.weights_for(0)
        self.progress = Progress()
        self._skip = 0
        self._yielded = 0
        self._cache: dict[str, Any] = {}

    def bind(self, on_epoch: Callable[[int, bool], None] | None) -> None:
        """Call ``on_epoch(epoch, resuming)`` from every :meth:`set_epoch`."""
        self._on_epoch = on_epoch

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_on_epoch=None, _cache={})
        return state

    def weights_for(self, epoch: int) -> np.ndarray:
        """The normalised weights of ``epoch`` under the schedule."""
        raw = self._schedule(epoch) if callable(self._schedule) else self._schedule
        return check_mixture(
            self.sizes, raw, self.on_exhausted, self.epoch_samples, self.names
        )

    # -- the world, read at first use -------------------------------------------------
    @property
    def rank(self) -> int:
        return self._world.get().rank

    @property
    def world_size(self) -> int:
        world = self._world.get()
        validate_world(world.rank, world.world_size)
        return world.world_size

    @property
    def num_replicas(self) -> int:
        return self.world_size

    @property
    def num_samples(self) -> int:
        """The longest rank's samples this epoch."""
        return max(self.lengths())

    @property
    def total_size(self) -> int:
        return len(self.global_order())

    def _check_world(self) -> None:
        if self._world.is_resolved and self._world.check(used=self._used):
            self._cache = {}

    # -- the order ----------------------------------------------------------------------
    def global_order(self) -> MixOrder:
        """The epoch's global sequence (every rank's, computed once per epoch)."""
        key = (self.epoch, tuple(self.weights.tolist()))
        if self._cache.get("global_key") != key:
            self._cache = {
                "global_key": key,
                "global": mixture_order(
                    self.sizes,
                    self.weights,
                    self.seed,
                    self.epoch,
                    shuffle=self.shuffle,
                    on_exhausted=self.on_exhausted,
                    epoch_samples=self.epoch_samples,
                    names=self.names,
                ),
            }
        return self._cache["global"]

    def _rest(self) -> np.ndarray:
        if "rest" not in self._cache:
            self._cache["rest"] = self.progress.rest(len(self.global_order()))
        return self._cache["rest"]

    def order(self) -> np.ndarray:
        """This rank's ids of the epoch (from the progress it started at)."""
        g = self.global_order()  # first: a new epoch or weights clear the cache
        if "order" not in self._cache:
            mine = deal(self._rest(), self.world_size, self.rank, self.block)
            ids = self.offsets[g.components[mine]] + g.indices[mine]
            ids.flags.writeable = False
            self._cache["order"] = ids
        return self._cache["order"]

    def lengths(self) -> list[int]:
        """Every rank's sample count this epoch (one apart at most)."""
        return deal_lengths(len(self._rest()), self.world_size, self.block)

    def component_of(self, ids: np.ndarray) -> np.ndarray:
        """The component of each id."""
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (its weights from the schedule); the same epoch
        again keeps a resume pending for it."""
        epoch = epoch_number(epoch)
        if epoch != self.epoch:
            self.epoch, self.weights = epoch, self.weights_for(epoch)
            self.progress, self._skip, self._yielded = Progress(), 0, 0
            self._cache = {}
        self._check_world()
        if self._on_epoch is not None:
            self._on_epoch(epoch, self._skip > 0)

    # -- iteration ------------------------------------------------------------------------
    @property
    def pending_skip(self) -> int:
        return self._skip

    def take_skip(self) -> int:
        """The samples a resume skips at the start of this epoch (once)."""
        skip, self._skip = self._skip, 0
        self._used = True
        return skip

    def __len__(self) -> int:
        return self.lengths()[self.rank]

    def handed_out(self) -> int:
        """Draws this process's iteration of the current epoch handed out,
        the resume's skip included (0 before the first)."""
        return self._yielded

    def __iter__(self) -> Iterator[int]:
        self._check_world()
        return self._iterate()

    def _begin_pass(self) -> int:
        """Start an iteration: take the resume's skip (once); returns it. What
        ``ShardBatchSampler`` calls, as on a ``ShardSampler``."""
        self._check_world()
        start = self.take_skip()
        self._yielded = start
        return start

    def _iterate(self) -> Iterator[int]:
        # A generator, so a loader's restore that makes and drops an
        # iterator does not consume the resume.
        start = self._begin_pass()
        for i in self.order()[start:].tolist():
            self._yielded += 1
            yield i

    def batches(
        self, batch_size: int | None = None, drop_last: bool = False
    ) -> ShardBatchSampler:
        """Batches with the same step count on every rank (``batch_size``
        defaults to the block), for ``DataLoader(batch_sampler=...)``."""
        return ShardBatchSampler(self, batch_size or self.block, drop_last)

    # -- state ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "version": MIX_STATE_VERSION,
            "kind": "mixture",
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "on_exhausted": self.on_exhausted,
            "epoch_samples": self.epoch_samples,
            "sizes": list(self.sizes),
            "names": list(self.names),
            "weights": self.weights.tolist(),
            "start": self.progress.start,
            "skipped": list(self.progress.skipped),
            "world_size": self.world_size,
            "block": self.block,
            "rank": self.rank,
        }

    def apply(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> int:
        """Continue the epoch ``state`` was saved in; returns the samples this
        rank already consumed of its (new) share.

        ``state`` is this rank's own state (same world and block), every
        rank's states (a list) or their merge: then any world size.

        Raises:
            ConfigError: not a mixture's state, other settings, or one rank's
                state for another world size or block.
        """
        if not isinstance(state, Mapping):
            state = merge_mix_states(state)
        if state.get("kind") != "mixture":
            raise ConfigError(
                "this state_dict is not a MixedDataset's (no kind='mixture'); load "
                "each dataset's own state into it."
            )
        mine = self.state()
        for key in _SETTINGS:
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"mixture state has {key}={state.get(key)!r} but this mixture "
                    f"has {mine[key]!r}; resume with the same components and settings."
                )
        merged = "consumed" not in state or state.get("merged")
        if not merged and (state["world_size"], state["block"]) != (
            mine["world_size"],
            mine["block"],
        ):
            raise ConfigError(
                f"one rank's state of a world of {state['world_size']} (batch size "
                f"{state['block']}) cannot resume a world of {mine['world_size']} "
                f"(batch size {mine['block']}): pass every rank's state (a list, or "
                "gather_state_dict()) to resume at another world size."
            )
        self.epoch = int(state["epoch"])
        # The saved epoch goes on with the weights it ran on, whatever the
        # schedule says now; later epochs follow the schedule.
        self.weights = normalise_weights(state["weights"], self.names)
        self.progress = Progress(int(state["start"]), tuple(state["skipped"]))
        self._cache = {}
        self._skip = 0 if merged else int(state["consumed"])
        self._yielded = self._skip
        return self._skip

    def state_dict(self) -> dict[str, Any]:
        """For torchdata's StatefulDataLoader: the ids yielded so far count."""
        return {**self.state(), "consumed": self._yielded}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.apply(state)


def merge_mix_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's mixture state -> one that resumes at any world size.

    Raises:
        ConfigError: states of different steps or mixtures, a rank missing
            or given twice.
    """
    states = list(states)
    if not states:
        raise ConfigError("merge needs the state of every rank, got none.")
    first = states[0]
    if "consumed" not in first or first.get("merged"):
        if all(s == first for s in states):
            return dict(first)  # already merged (gather gives each rank a copy)
        raise ConfigError("pass per-rank states or one merged state, not several.")
    world = int(first["world_size"])
    agree = [k for k in first if k not in ("rank", "consumed")]
    consumed = [int(s["consumed"]) for s in by_rank(states, agree)]
    length = len(
        mixture_order(
            first["sizes"],
            first["weights"],
            int(first["seed"]),
            int(first["epoch"]),
            shuffle=bool(first["shuffle"]),
            on_exhausted=first["on_exhausted"],
            epoch_samples=first["epoch_samples"],
            names=first.get("names"),
        )
    )
    progress = Progress(int(first["start"]), tuple(first["skipped"])).advance(
        length, world, int(first["block"]), consumed
    )
    merged = {k: v for k, v in first.items() if k not in _PER_WORLD}
    merged.update(start=progress.start, skipped=list(progress.skipped), merged=True)
    return merged

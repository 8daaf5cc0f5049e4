"""A DistributedSampler replacement whose shard is stable across epochs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from shardcache.errors import ConfigError
from shardcache.sharding import assign_chunks, epoch_order, global_order, validate_world

__all__ = ["SHUFFLE_MODES", "ShardSampler"]

SHUFFLE_MODES = (True, False, "shard", "global")


class ShardSampler(Sampler[int]):
    """Yields this rank's sample indices for the current epoch.

    Args:
        chunk_sizes: samples per chunk, in manifest order; a rank's shard is
            made of whole chunks (a few split at the edges for balance).
        rank: this rank. world_size: ranks in the job.
        shuffle: ``True``/``"shard"`` reshuffles inside a stable per-rank
            shard; ``"global"`` is DistributedSampler's global permutation;
            ``False`` keeps shard order.
        seed: shared by all ranks. drop_last: drop instead of pad.
    """

    def __init__(
        self,
        chunk_sizes: Sequence[int] | np.ndarray,
        rank: int,
        world_size: int,
        *,
        shuffle: bool | str = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        validate_world(rank, world_size)
        if shuffle not in SHUFFLE_MODES:
            raise ConfigError(
                f"shuffle must be one of {SHUFFLE_MODES}, got {shuffle!r}."
            )
        self.n = int(np.sum(chunk_sizes))
        self.rank, self.world_size = rank, world_size
        self.mode = "global" if shuffle == "global" else "shard"
        self.shuffle = shuffle is not False
        self.seed, self.drop_last = int(seed), drop_last
        self.epoch = 0
        self._skip = 0
        if self.mode == "shard":
            shards = assign_chunks(np.asarray(chunk_sizes), world_size, seed)
            self.shard = shards[rank]
            sizes = [len(s) for s in shards]
            self.num_samples = min(sizes) if drop_last else max(sizes)
        else:
            self.shard = np.arange(self.n)
            self.num_samples = (
                self.n // world_size if drop_last else -(-self.n // world_size)
            )

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0
        self.epoch = int(epoch)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The full order of ``epoch`` (default: the current one), read-only.

        Computed once per epoch: the prefetcher asks for it on every batch.
        """
        e = self.epoch if epoch is None else epoch
        cached = getattr(self, "_order_cache", None)
        if cached is not None and cached[0] == e:
            return cached[1]
        order = self._compute_order(e)
        order.flags.writeable = False
        self._order_cache = (e, order)
        return order

    def _compute_order(self, e: int) -> np.ndarray:
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
        return epoch_order(self.shard, self.num_samples, self.seed, e, self.shuffle)

    def resume(self, epoch: int, consumed: int) -> None:
        """Continue ``epoch`` after its first ``consumed`` samples (once)."""
        self.epoch, self._skip = int(epoch), int(consumed)

    def take_skip(self) -> int:
        """The samples a resume skips at the start of this epoch (once)."""
        skip, self._skip = self._skip, 0
        return skip

    def __iter__(self) -> Iterator[int]:
        order, self._skip = self.order()[self._skip :], 0
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.num_samples

    def state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "mode": self.mode,
        }

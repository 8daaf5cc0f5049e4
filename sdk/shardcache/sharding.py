"""Which samples each rank reads: pure functions of (keys, world_size, rank, seed).

Assignment is rendezvous (highest-random-weight) hashing with bounded loads:
every key ranks the W ranks by ``hash(key, rank, seed)`` and goes to the best
one that still has room (capacity ``floor(n / W)`` or one more). Rendezvous hashing moves
only about 1/W of the keys when the world size changes, so most of a rank's
shard stays cached on the node it ran on; the load bound keeps shards within
one sample of each other so lengths can be equalised by padding or dropping
at most one sample per rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from shardcache.errors import ConfigError

__all__ = ["assign_shards", "epoch_order", "global_order", "validate_world"]

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def validate_world(rank: int, world_size: int) -> None:
    """Raise ConfigError unless ``0 <= rank < world_size``."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}.")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(
            f"rank must be an integer in [0, world_size={world_size}), got {rank!r}. "
            "Check RANK and WORLD_SIZE or the rank/world_size arguments."
        )


def _key_hashes(keys: Sequence[str], seed: int) -> np.ndarray:
    salt = seed.to_bytes(8, "little", signed=True)
    return np.fromiter(
        (
            int.from_bytes(
                hashlib.blake2b(
                    k.encode(), digest_size=8, salt=salt[:8].ljust(16, b"\0")
                ).digest(),
                "little",
            )
            for k in keys
        ),
        dtype=np.uint64,
        count=len(keys),
    )


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser: a cheap, well-distributed 64-bit mix.
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def assign_shards(
    keys: Sequence[str], world_size: int, seed: int = 0
) -> list[np.ndarray]:
    """Split key indices into ``world_size`` disjoint, covering shards.

    Each shard is sorted ascending; sizes differ by at most one.

    >>> shards = assign_shards([f"k{i}" for i in range(10)], 3)
    >>> sorted(int(i) for s in shards for i in s) == list(range(10))
    True
    >>> sorted(len(s) for s in shards)
    [3, 3, 4]
    """
    validate_world(0, world_size)
    n = len(keys)
    if world_size == 1:
        return [np.arange(n, dtype=np.int64)]
    key_h = _key_hashes(keys, seed)
    rank_salt = _mix(
        np.arange(1, world_size + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    )
    scores = _mix(key_h[:, None] ^ rank_salt[None, :])
    preference = np.argsort(-scores.astype(np.float64), axis=1, kind="stable")
    # Exact balance: the first n % W ranks take one extra key.
    capacity = np.full(world_size, n // world_size, dtype=np.int64)
    capacity[: n % world_size] += 1
    load = np.zeros(world_size, dtype=np.int64)
    owner = np.empty(n, dtype=np.int64)
    # Visit keys in hash order (not list order) so the keys that overflow a full
    # rank are a random sample, not the tail of the listing.
    for i in np.argsort(key_h, kind="stable"):
        for r in preference[i]:
            if load[r] < capacity[r]:
                owner[i] = r
                load[r] += 1
                break
    return [np.flatnonzero(owner == r) for r in range(world_size)]


def epoch_order(
    shard: np.ndarray, num_samples: int, seed: int, epoch: int, shuffle: bool
) -> np.ndarray:
    """This rank's sample order for one epoch, exactly ``num_samples`` long.

    The order is reshuffled from ``(seed, epoch)``; a shard shorter than
    ``num_samples`` is padded with its own samples (so padding stays local).
    """
    order = shard.copy()
    if shuffle:
        np.random.default_rng([seed, epoch]).shuffle(order)
    if len(order) >= num_samples:
        return order[:num_samples]
    reps = -(-num_samples // max(len(order), 1))
    return np.tile(order, reps)[:num_samples]


def global_order(
    n: int,
    world_size: int,
    rank: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
) -> np.ndarray:
    """DistributedSampler's assignment: one global permutation, strided by rank."""
    order = (
        np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    )
    if drop_last:
        total = n // world_size * world_size
        order = order[:total]
    else:
        total = -(-n // world_size) * world_size
        if total > n:
            order = np.concatenate(
                [order, np.tile(order, -(-(total - n) // n))[: total - n]]
            )
    return order[rank:total:world_size]

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

import contextlib
import hashlib
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardcache.chunks import ChunkLayout
from shardcache.errors import ConfigError

__all__ = [
    "assign_chunks",
    "block_shuffle",
    "assign_shards",
    "epoch_number",
    "epoch_order",
    "global_order",
    "small_chunks",
    "validate_world",
]

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


def epoch_number(epoch: object) -> int:
    """``set_epoch``'s argument as an int: a non-negative whole number (numpy's
    too), never a string or a bool that ``int()`` would take silently.

    >>> epoch_number(3)
    3
    >>> epoch_number("1")
    Traceback (most recent call last):
    ...
    shardcache.errors.ConfigError: set_epoch(epoch) takes an integer >= 0 (the same on every rank), got '1'.
    """
    # Integers of any kind (numpy's, a one-element torch tensor: __index__)
    # and a whole float (some trainers count epochs in floats) pass.
    value: int | None = None
    if not isinstance(epoch, bool | str):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            value = operator.index(epoch)  # type: ignore[arg-type]
        if value is None and isinstance(epoch, numbers.Real):
            value = int(epoch) if float(epoch).is_integer() else None
    if value is None or value < 0:
        raise ConfigError(
            "set_epoch(epoch) takes an integer >= 0 (the same on every rank), "
            f"got {epoch!r}."
        )
    return value


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


def _rendezvous(
    key_h: np.ndarray, world_size: int, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each key's ranks in preference order, and each rank's capacity in
    samples (exact balance: the first ``n % W`` ranks take one more)."""
    rank_salt = _mix(
        np.arange(1, world_size + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    )
    scores = _mix(key_h[:, None] ^ rank_salt[None, :])
    preference = np.argsort(-scores.astype(np.float64), axis=1, kind="stable")
    capacity = np.full(world_size, n // world_size, dtype=np.int64)
    capacity[: n % world_size] += 1
    return preference, capacity


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
    preference, capacity = _rendezvous(key_h, world_size, n)
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


def small_chunks(sizes: np.ndarray) -> np.ndarray:
    """Which chunks are under a quarter of the largest (the pieces a
    listing's first chunk is cut into, read and dealt first).

    >>> small_chunks(np.array([16, 16, 256, 100])).tolist()
    [True, True, False, False]
    """
    sizes = np.asarray(sizes)
    return sizes * 4 < sizes.max(initial=0)


def assign_chunks(
    chunk_sizes: np.ndarray, world_size: int, seed: int = 0
) -> list[np.ndarray]:
    """Split the samples of whole chunks into ``world_size`` disjoint, covering
    shards whose sizes differ by at most one sample (as DistributedSampler's).

    Each chunk goes whole to the best-scoring rank (rendezvous hashing on the
    chunk id) that still has room; a chunk that fits no rank whole is split
    between the ranks with room left, so a few chunks (at most one per rank)
    are shared by two ranks. The leading run of small chunks
    (:func:`small_chunks`: a listing's first chunk cut in pieces) is dealt
    first and evenly, each to the best-scoring rank among those holding the
    fewest so far: a rank reads its small chunks first in a cold epoch
    (``segments``), so every rank that can hold one starts on a small
    build. Returns each rank's sample indices, ascending.

    >>> shards = assign_chunks(np.array([4, 4, 4, 3]), 2)
    >>> sorted(len(s) for s in shards), sorted(int(i) for s in shards for i in s) == list(range(15))
    ([7, 8], True)
    """
    validate_world(0, world_size)
    sizes = np.asarray(chunk_sizes, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    n = int(starts[-1])
    if world_size == 1:
        return [np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)]
    salt = _mix(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) + np.uint64(0x9E3779B97F4A7C15))
    chunk_h = _mix(np.arange(1, len(sizes) + 1, dtype=np.uint64) ^ salt)
    preference, capacity = _rendezvous(chunk_h, world_size, n)
    load = np.zeros(world_size, dtype=np.int64)
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    leftover = []
    # The leading run of small chunks: the listing's first chunk in pieces.
    # Only these leave rendezvous dealing, whose choice moves few chunks when
    # the world changes; a small chunk elsewhere (a remainder, a file of
    # few bytes) keeps it.
    small = np.zeros(len(sizes), dtype=bool)
    lead = small_chunks(sizes)
    small[: len(sizes) if lead.all() else int(np.argmin(lead))] = True
    held = np.zeros(world_size, dtype=np.int64)  # small chunks per rank
    by_hash = np.argsort(chunk_h, kind="stable")
    # Per chunk, not per sample: a Python loop over chunks is cheap.
    for c in [*by_hash[small[by_hash]].tolist(), *by_hash[~small[by_hash]].tolist()]:
        size = int(sizes[c])
        ranks = preference[c]
        if small[c]:  # the fewest small chunks first, then the rendezvous score
            ranks = ranks[np.argsort(held[ranks], kind="stable")]
        for r in ranks.tolist():
            if load[r] + size <= capacity[r]:
                pieces[r].append((int(starts[c]), int(starts[c + 1])))
                load[r] += size
                held[r] += small[c]
                break
        else:
            leftover.append(c)
    for c in leftover:
        lo, hi = int(starts[c]), int(starts[c + 1])
        for r in preference[c].tolist():
            take = min(hi - lo, int(capacity[r] - load[r]))
            if take > 0:
                pieces[r].append((lo, lo + take))
                load[r] += take
                lo += take
            if lo == hi:
                break
    # 4 bytes per sample while indices fit: the shard and each epoch's order
    # are a rank's only per-sample memory.
    dtype = np.int32 if n < 2**31 else np.int64
    return [
        np.sort(np.concatenate([np.arange(a, b, dtype=dtype) for a, b in p]))
        if p
        else np.zeros(0, dtype=dtype)
        for p in pieces
    ]


def epoch_order(
    shard: np.ndarray,
    num_samples: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    *,
    block_samples: int = 0,
    layout: ChunkLayout | None = None,
) -> np.ndarray:
    """This rank's sample order for one epoch, exactly ``num_samples`` long.

    The order is reshuffled from ``(seed, epoch)``; a shard shorter than
    ``num_samples`` is padded with its own samples (so padding stays local).
    With ``block_samples`` (and the chunk ``layout``) the shuffle is by chunk
    blocks (:func:`block_shuffle`).

    >>> epoch_order(np.arange(6), 6, 0, 0, False).tolist()
    [0, 1, 2, 3, 4, 5]
    """
    order = shard.copy()
    if shuffle and block_samples:
        if layout is None:
            raise ValueError("block_samples needs the chunk layout")
        order = block_shuffle(
            order, layout.chunk_of(order), block_samples, [seed, epoch]
        )
    elif shuffle:
        np.random.default_rng([seed, epoch]).shuffle(order)
    if len(order) >= num_samples:
        return order[:num_samples]
    reps = -(-num_samples // max(len(order), 1))
    return np.tile(order, reps)[:num_samples]


def block_shuffle(
    samples: np.ndarray, chunk_ids: np.ndarray, block_samples: int, seed: Any
) -> np.ndarray:
    """The chunks of ``samples`` in a random order, then the samples shuffled
    within consecutive blocks of ``block_samples`` (Mosaic's shuffle blocks).

    A full shuffle of a shard touches every chunk of it in every batch: when
    the node's cache holds less than the shards of its ranks, each batch then
    rebuilds chunks evicted a moment ago. Here a rank works through about
    ``block_samples`` worth of chunks at a time, each chunk's samples spread
    within its block, so a cache a few blocks large reads each chunk once per
    epoch. Vectorised: two sorts, no Python per sample.

    >>> order = block_shuffle(np.arange(8), np.arange(8) // 2, 4, 0)
    >>> sorted(order.tolist()) == list(range(8))
    True
    >>> [len(set((order[i:i + 4] // 2).tolist())) for i in (0, 4)]  # 2 chunks a block
    [2, 2]
    """
    rng = np.random.default_rng(seed)
    chunks, dense = np.unique(chunk_ids, return_inverse=True)
    chunk_rank = np.empty(len(chunks), dtype=np.int64)
    chunk_rank[rng.permutation(len(chunks))] = np.arange(len(chunks))
    grouped = samples[np.argsort(chunk_rank[dense], kind="stable")]
    block = np.arange(len(grouped)) // max(int(block_samples), 1)
    return grouped[np.lexsort((rng.random(len(grouped)), block))]


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

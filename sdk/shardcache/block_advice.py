"""Which ``shuffle_block`` fits, told to a rank whose full shuffle read outside memory.

With the default full shuffle every batch touches nearly every chunk of the
rank's shard. When the node's memory holds only part of its ranks' shards,
the rest is mapped from the disk tier again and again within the epoch
(`bench/larger_than_memory.py` measured such a warm epoch at 0.46x of the
same epoch shuffled in blocks of two chunks, which matches a plain
DataLoader over page-cached files), or, with no disk tier, rebuilt from the
source several times an epoch (9 samples/s there).

The rank does not switch by itself. The order must stay a function of
``(seed, epoch, world, shuffle_block)``: a saved state replays it exactly,
and every rank of a world must agree on it for an elastic resume
(``resume/state.py`` checks ``block`` like the seed). What a rank saw of
its node's memory is neither, so it says which block fits, once, and
``stats()["suggested_shuffle_block"]`` keeps the figure.
"""

from __future__ import annotations

import logging

import numpy as np

__all__ = ["MIN_DISK_SHARE", "suggest_block", "warn_once"]

log = logging.getLogger(__name__)

# A few disk reads are not a shard too large for memory: a store restarted
# with its disk tier serves its files until the chunks are asked for again.
MIN_DISK_SHARE = 0.10


def suggest_block(local: int, missed: int, chunk_samples: np.ndarray) -> int:
    """Samples per shuffle block for a rank that read ``local`` samples from
    memory and ``missed`` elsewhere (disk-tier files, or the source again
    for chunks evicted since they were built) in one warm epoch; ``0`` when
    the epoch did not need blocks.

    The share of the epoch that memory held, ``local / (local + missed)``,
    is what the node can keep of this rank's shard; a block of half of it
    leaves room for the next block while the current one is read. At least
    one chunk: a block smaller than a chunk reads that chunk in several
    windows.

    Args:
        local, missed: samples served from memory and from elsewhere.
        chunk_samples: samples per chunk of this rank's shard.

    >>> suggest_block(340, 660, np.full(12, 85))
    170
    >>> suggest_block(1000, 0, np.full(12, 85))
    0
    """
    total = local + missed
    if total <= 0 or missed / total < MIN_DISK_SHARE or len(chunk_samples) == 0:
        return 0
    per_chunk = float(np.mean(chunk_samples))
    chunks = max(1, round(local / total * len(chunk_samples) / 2))
    return max(1, int(chunks * per_chunk))


def warn_once(dataset: str, block: int, served: dict[str, int]) -> None:
    """Log the advice (the session calls this at most once); ``served``:
    the warm epoch's samples by origin."""
    total = max(sum(served.values()), 1)
    where = f"{served['disk']} of {total} samples from the disk tier"
    if served["source"]:
        # No disk tier (or a full one): each evicted chunk was read from the
        # source again, which costs more than the order.
        where = (
            f"{served['source']} of {total} samples from the source again "
            "(chunks evicted since they were built; SHARDCACHE_DISK_DIR, the "
            "chart's disk tier, keeps them on the node's disk)"
            + (f" and {served['disk']} from the disk tier" if served["disk"] else "")
        )
    log.warning(
        "shardcache: dataset %s: the last warm epoch read %s: this node's memory "
        "holds about %.0f%% of its ranks' shards, and a full shuffle asks for "
        "every chunk again in each batch. Pass shuffle_block=%d to "
        "DistributedCachedDataset to read each chunk once per epoch (from the "
        "disk tier measured 2x faster, bench/larger_than_memory.py); resume "
        "from a state saved without it needs the same setting.",
        dataset,
        where,
        100.0 * served["local"] / total,
        block,
    )

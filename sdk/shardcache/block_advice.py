"""Which ``shuffle_block`` fits, told to a rank whose full shuffle rebuilt chunks.

With the default full shuffle every batch touches nearly every chunk of the
rank's shard. With a disk tier that costs nothing much: a rank keeps each
chunk file it maps for the epoch (``reader.py``), so a warm epoch of data
3x the memory budget reads at page-cache speed (`bench/larger_than_memory.py`).
Without one, a chunk evicted from memory is rebuilt from the source each
time a batch asks for it again, several times an epoch (9 samples/s there);
blocks of chunks bring that to about once an epoch.

The rank does not switch by itself. The order must stay a function of
``(seed, epoch, world, shuffle_block)``: a saved state replays it exactly,
and every rank of a world must agree on it for an elastic resume
(``resume/state.py`` checks ``block`` like the seed). What a rank saw of
its node's memory is neither, so it says what fits, once, and
``stats()["suggested_shuffle_block"]`` keeps the figure.
"""

from __future__ import annotations

import logging

import numpy as np

__all__ = ["MIN_REBUILT_SHARE", "suggest_block", "warn_once"]

log = logging.getLogger(__name__)

# A few rebuilds are not a shard too large for memory: a store restarted
# without a disk tier builds what it held again once.
MIN_REBUILT_SHARE = 0.10


def suggest_block(local: int, missed: int, chunk_samples: np.ndarray) -> int:
    """Samples per shuffle block for a rank that read ``local`` samples from
    memory and ``missed`` from the source again (chunks evicted since they
    were built) in one warm epoch; ``0`` when the epoch did not need blocks.

    The share of the epoch that memory held, ``local / (local + missed)``,
    is what the node can keep of this rank's shard; a block of half of it
    leaves room for the next block while the current one is read. At least
    one chunk: a block smaller than a chunk reads that chunk in several
    windows.

    Args:
        local, missed: samples served from memory and rebuilt.
        chunk_samples: samples per chunk of this rank's shard.

    >>> suggest_block(340, 660, np.full(12, 85))
    170
    >>> suggest_block(1000, 0, np.full(12, 85))
    0
    """
    total = local + missed
    if total <= 0 or missed / total < MIN_REBUILT_SHARE or len(chunk_samples) == 0:
        return 0
    per_chunk = float(np.mean(chunk_samples))
    chunks = max(1, round(local / total * len(chunk_samples) / 2))
    return max(1, int(chunks * per_chunk))


def warn_once(dataset: str, block: int, served: dict[str, int]) -> None:
    """Log the advice (the session calls this at most once); ``served``:
    the warm epoch's samples by origin."""
    total = max(sum(served.values()), 1)
    log.warning(
        "shardcache: dataset %s: the last warm epoch read %d of %d samples from "
        "the source again: this node's memory holds about %.0f%% of its ranks' "
        "shards, and a chunk evicted since it was built is rebuilt each time a "
        "batch of the full shuffle asks for it. SHARDCACHE_DISK_DIR (the "
        "chart's disk tier) keeps evicted chunks on the node's disk, read at "
        "page-cache speed; without one, pass shuffle_block=%d to "
        "DistributedCachedDataset to build each chunk about once per epoch "
        "(a resume from a state saved without it needs the same setting).",
        dataset,
        served["source"],
        total,
        100.0 * served["local"] / total,
        block,
    )

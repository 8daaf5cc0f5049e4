"""Warm a rank's first steps: hold the chunks its next batches read before training.

A job that starts cold waits on the source for its first batches; warming
exactly the chunks of each rank's first K steps, on the rank's own node,
makes those steps warm, and the rest of the epoch streams in behind the
loop through the reader's prefetch. With chunks, "the samples of the first
K steps" means every chunk those samples live in: with a shuffle inside a
shard of many chunks the first steps touch many chunks, so K steps may
warm much more than K batches of data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

from shardcache.reader import PREFETCH_GROUP

if TYPE_CHECKING:
    from shardcache.reader import ChunkReader

__all__ = ["chunks_in_need_order", "warm_chunks"]


def chunks_in_need_order(
    chunk_ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct chunks in the order first needed, and how many samples each serves.

    >>> [a.tolist() for a in chunks_in_need_order(np.array([3, 1, 3, 0, 1]))]
    [[3, 1, 0], [2, 2, 1]]
    """
    uniq, first, counts = np.unique(chunk_ids, return_index=True, return_counts=True)
    need = np.argsort(first, kind="stable")
    return uniq[need], counts[need]


def warm_chunks(
    reader: ChunkReader, indices: np.ndarray, *, progress: bool = True
) -> dict[str, int]:
    """Resolve and hold the chunks of ``indices`` (a rank's next samples) on this
    node, ``PREFETCH_DEPTH`` store calls in flight, with a progress bar.

    The chunks are asked of this process's node store, so they are built,
    cached and owned there; afterwards they count as local hits.
    """
    chunks, counts = chunks_in_need_order(reader.layout.chunk_of(indices))
    reader.prefetch(indices)  # background resolution, in need order
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        disable=not progress,
        transient=False,
    ) as bar:
        task = bar.add_task(f"warming {reader.name}", total=int(len(indices)))
        for i in range(0, len(chunks), PREFETCH_GROUP):
            group = chunks[i : i + PREFETCH_GROUP]
            reader.chunks_for(group)  # waits on the prefetch, or resolves
            bar.advance(task, int(counts[i : i + PREFETCH_GROUP].sum()))
    # Held chunks count as local from here: the fetch happened before the
    # first step, not inside it.
    reader.new_epoch()
    return {"chunks": int(len(chunks)), "samples": int(len(indices))}

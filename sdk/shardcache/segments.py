"""The first epoch of a listing read while it was still listed, segment by segment.

A listing that runs long publishes growing prefixes of whole chunks
(``Manifest.prefix_ends``: the length of each). The first epoch cannot
shuffle over objects not listed yet, so it is read in *segments*: segment
``s`` is the objects between the ends of prefixes ``s - 1`` and ``s`` (the
last one: from the last prefix to the end of the listing). Each segment's
chunks are split among the ranks as a whole dataset's are
(:func:`~shardcache.sharding.assign_chunks`) and shuffled within the
segment, and every rank gets the same count from each (``ceil(n / W)``,
padded from its own samples, or ``n // W`` with ``drop_last``). So every
rank has the same number of samples at each segment's end without knowing
the total, and the order is a pure function of the listing's chunks and
its prefix ends: a rank that saw fewer prefixes, a DataLoader worker, or a
resumed job computes the same one.

What the first epoch gives up: the shuffle spans a segment, not the whole
dataset (the first segment's keys come first), the first segment is read
chunk by chunk (each chunk's rows shuffled, the chunks in a random order,
the listing's small first pieces first: its first batch then waits for one
small build, not for all of them),
and each segment pads (or, with ``drop_last``, drops) up to ``W - 1``
samples. Later epochs read the finished listing as any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from shardcache.chunks import ChunkLayout
from shardcache.sharding import assign_chunks, epoch_order, small_chunks

__all__ = [
    "WHOLE_LISTING",
    "GrowingListing",
    "chunkwise_order",
    "segment_bounds",
    "segment_order",
    "segmented_length",
]

_GOLDEN = 0x9E3779B1  # spreads the segment number over the seed

# Leads the prefix ends of a fresh listing published whole for a job waiting
# on it (``[WHOLE_LISTING, n]``): one segment, the whole listing, read chunk
# by chunk and dealt as the later epochs' stable shards. No streamed
# listing's ends begin with it (a prefix holds a whole chunk), so no rank
# can take one for the other, whatever prefix it started on.
WHOLE_LISTING = 0


def segment_bounds(
    starts: np.ndarray, ends: Sequence[int], complete: bool
) -> list[tuple[int, int]]:
    """``(first, end)`` sample index of each segment known: one per prefix
    end, and the rest of the listing once it is ``complete``.

    ``starts``: the chunk starts of the listing known (its last entry the
    number of objects). Prefix ends past it are not known yet.

    >>> segment_bounds(np.array([0, 2, 4, 6, 8]), [4], False)
    [(0, 4)]
    >>> segment_bounds(np.array([0, 2, 4, 6, 8]), [4], True)
    [(0, 4), (4, 8)]
    """
    n = int(starts[-1])
    out, lo = [], 0
    for end in ends:
        end = int(end)
        if end > n:
            break
        if end > lo:
            out.append((lo, end))
            lo = end
    if complete and n > lo:
        out.append((lo, n))
    return out


def segment_order(
    layout: ChunkLayout,
    bounds: tuple[int, int],
    number: int,
    world_size: int,
    rank: int,
    *,
    seed: int,
    shuffle: bool,
    drop_last: bool,
    block_samples: int = 0,
    whole: bool = False,
) -> np.ndarray:
    """This rank's samples of segment ``number`` (``bounds``), in order.

    ``whole``: the segment is the whole listing (a fresh listing read
    chunk by chunk, not one read while it was listed): its chunks are dealt
    as the stable shards of later epochs are, so each chunk is built on the
    node that reads it in every epoch.

    >>> layout = ChunkLayout(np.array([0, 2, 4, 6]))
    >>> a = segment_order(layout, (0, 6), 0, 2, 0, seed=0, shuffle=False, drop_last=False)
    >>> b = segment_order(layout, (0, 6), 0, 2, 1, seed=0, shuffle=False, drop_last=False)
    >>> len(a), len(b), sorted(a.tolist() + b.tolist())
    (3, 3, [0, 1, 2, 3, 4, 5])
    """
    lo, hi = bounds
    starts = layout.starts
    first, last = np.searchsorted(starts, [lo, hi])
    sizes = np.diff(starts[first : last + 1])
    seg_seed = (int(seed) + _GOLDEN * (number + 1)) & 0xFFFFFFFF
    deal_seed = int(seed) if whole else seg_seed
    mine = assign_chunks(sizes, world_size, deal_seed)[rank].astype(np.int64) + lo
    n = hi - lo
    count = n // world_size if drop_last else -(-n // world_size)
    if not len(mine) and count:
        mine = np.array([lo + rank % n], dtype=np.int64)  # a segment under W samples
    if number == 0 and shuffle and not block_samples:
        # The first segment goes chunk by chunk: a shuffle over all of it
        # would make the job's first batch wait for every chunk of it.
        # epoch_order without a shuffle only cuts or pads it to ``count``.
        mine = chunkwise_order(mine, layout, [seg_seed, 0])
        return epoch_order(mine, count, seg_seed, 0, False)
    return epoch_order(
        mine,
        count,
        seg_seed,
        0,
        shuffle,
        block_samples=block_samples,
        layout=layout if block_samples else None,
    )


def chunkwise_order(samples: np.ndarray, layout: ChunkLayout, seed: Any) -> np.ndarray:
    """``samples`` chunk by chunk, each chunk's rows shuffled and the chunks
    in a random order, except that chunks under a quarter of the largest
    come first (a listing's first chunk of many small objects is cut into
    pieces, ``RAMP_PIECES`` in the services' listing: reading one of them
    first, the job's first batch waits for a small build, not a whole
    chunk's).

    >>> layout = ChunkLayout(np.array([0, 1, 2, 10, 18]))
    >>> order = chunkwise_order(np.arange(18), layout, 0)
    >>> sorted(order[:2].tolist()), sorted(order.tolist()) == list(range(18))
    ([0, 1], True)
    """
    rng = np.random.default_rng(seed)
    chunks, dense = np.unique(layout.chunk_of(samples), return_inverse=True)
    sizes = np.diff(layout.starts)[chunks]
    small = small_chunks(sizes)
    position = np.empty(len(chunks), dtype=np.int64)
    position[np.lexsort((rng.random(len(chunks)), ~small))] = np.arange(len(chunks))
    return samples[np.lexsort((rng.random(len(samples)), position[dense]))]


def segmented_length(
    bounds: Sequence[tuple[int, int]], world_size: int, drop_last: bool
) -> int:
    """Samples per rank in the segments ``bounds`` (the same on every rank).

    >>> segmented_length([(0, 5), (5, 8)], 2, False), segmented_length([(0, 5), (5, 8)], 2, True)
    (5, 3)
    """
    if drop_last:
        return sum((hi - lo) // world_size for lo, hi in bounds)
    return sum(-(-(hi - lo) // world_size) for lo, hi in bounds)


class GrowingListing:
    """What a sampler knows of a listing the stores are still listing: its
    prefix ends, whether it is whole, and the first epoch's orders per
    segment for one rank (computed once each: earlier segments never change
    as the listing grows).

    Args:
        ends: the listing's prefix ends (``Manifest.prefix_ends``).
        complete: the listing is whole. Defaults to ``True``.
    """

    def __init__(self, ends: Sequence[int] = (), complete: bool = True):
        self.ends = np.asarray(ends, dtype=np.int64)
        self.complete = complete
        self._orders: list[np.ndarray] = []
        self._for: tuple[Any, ...] | None = None  # what the orders were cut for

    @property
    def is_segmented(self) -> bool:
        """The listing was read while it was listed: its first epoch goes by segments."""
        return len(self.ends) > 0

    def grew(self, ends: Sequence[int], complete: bool) -> None:
        self.ends = np.asarray(ends, dtype=np.int64)
        self.complete = complete

    def use_ends(self, ends: Sequence[int] | None) -> None:
        """Segments saved with a state (a resume of the first epoch reads its order)."""
        self.ends = np.asarray(ends or (), dtype=np.int64)
        self._orders, self._for = [], None

    def orders(
        self, layout: ChunkLayout, world_size: int, rank: int, **order: Any
    ) -> list[np.ndarray]:
        """This rank's order of each segment known, in segment order."""
        key = (world_size, rank, tuple(sorted(order.items())))
        # Built on a list of its own, published whole: forget() from another
        # thread (the look-ahead may still ask) never leaves a list whose
        # indices are not segment numbers.
        orders = list(self._orders) if key == self._for else []
        bounds = segment_bounds(layout.starts, self.ends, self.complete)
        whole = len(self.ends) > 0 and int(self.ends[0]) == WHOLE_LISTING
        for number in range(len(orders), len(bounds)):
            orders.append(
                segment_order(
                    layout,
                    bounds[number],
                    number,
                    world_size,
                    rank,
                    whole=whole,
                    **order,
                )
            )
        self._orders, self._for = orders, key
        return orders

    def forget(self) -> None:
        """Drop the orders kept (a rank past its first epoch: 8 B per sample
        it would hold for the job's life); :meth:`orders` computes them
        again if asked."""
        self._orders, self._for = [], None

    def length(self, layout: ChunkLayout, world_size: int, drop_last: bool) -> int:
        """Samples per rank in the first epoch (the listing whole)."""
        bounds = segment_bounds(layout.starts, self.ends, True)
        return segmented_length(bounds, world_size, drop_last)

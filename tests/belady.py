"""Belady's MIN simulated on a known request sequence, written independently
of the ``clairvoyant`` policy, for tests to check it against."""

from __future__ import annotations

import bisect

import numpy as np

from shardcache.sampler import ShardSampler


def node_calls(sizes, world, ranks, seed, epochs, batch, block=0):
    """The store calls of the node's ranks, written independently of the
    policy: each rank holds nothing, so every batch asks for its chunks (in
    order of first sample); ranks in lockstep, lower rank first."""
    starts = np.concatenate(([0], np.cumsum(sizes)))
    orders = {
        r: [
            ShardSampler(sizes, r, world, seed=seed, shuffle_block=block)
            .order(e)
            .tolist()
            for e in range(epochs)
        ]
        for r in ranks
    }
    calls = []
    for e in range(epochs):
        steps = len(orders[ranks[0]][e])
        for b in range(0, steps, batch):
            for r in ranks:
                samples = orders[r][e][b : b + batch]
                chunks = np.searchsorted(starts, samples, side="right") - 1
                calls.append(list(dict.fromkeys(chunks.tolist())))
    return calls


def belady_hits(seq, capacity, count):
    """Belady's MIN with bypass over ``seq``; hits among the first ``count``."""
    where: dict[int, list[int]] = {}
    for i, c in enumerate(seq):
        where.setdefault(c, []).append(i)

    def next_after(c, i):
        js = where[c]
        k = bisect.bisect_right(js, i)
        return js[k] if k < len(js) else float("inf")

    cache, hits = set(), 0
    for i in range(count):
        c = seq[i]
        if c in cache:
            hits += 1
        elif len(cache) < capacity:
            cache.add(c)
        else:
            far = max(cache, key=lambda k: next_after(k, i))
            if next_after(far, i) > next_after(c, i):
                cache.remove(far)
                cache.add(c)
    return hits

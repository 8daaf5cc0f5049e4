"""Elastic resume: finish an epoch at another world size, nothing skipped or repeated.

What a rank saves is O(1): the epoch, the seed and sharding mode, the world
size, its rank, **how many samples it consumed** and the node it ran on. Every
rank's order is a pure function of (chunk layout, world size, seed, epoch), so
merging the states of all old ranks (O(ranks)) is enough to recompute the
exact set of samples the epoch already delivered; no index list is stored.

The samples left are dealt over the new ranks, balanced to within one sample
(or exactly equal with ``drop_last``), and node-aware: a chunk's remaining
samples stay on a new rank of the node that read it (where its node store
cached it) until that node's ranks are full; only the overflow moves, to the
best-scoring rank by rendezvous hashing. That makes the moved fraction the
minimum the new shape allows, ``sum over nodes of max(0, held - capacity)``.

Cost, once per resume: a few vectorised passes over the samples (a bool and
an int32 per sample, freed after) and Python loops per chunk, never per sample.

The package: ``state`` (what a rank saves and how the ranks' saves merge),
``plan`` (every rank's order in a world, and the rest of an epoch dealt over a
new one), ``deal`` (the node-aware placement both deals use) and ``apply``
(pointing a sampler at the rest of a saved epoch).

>>> import numpy as np
>>> sizes = np.array([10] * 10)
>>> old = [{**world_state(4, seed=1), "rank": r, "consumed": 7,
...         "node": f"n{r // 2}"} for r in range(4)]
>>> merged = merge_states(old)
>>> plan = plan_resume(sizes, merged, 2, ["n0", "n1"])
>>> plan.remaining, sum(len(o) for o in plan.orders), plan.moved
(72, 72, 0)
"""

from shardcache.resume.apply import apply_state
from shardcache.resume.plan import (
    ResumePlan,
    make_basis,
    plan_resume,
    world_orders,
    world_shards,
)
from shardcache.resume.state import (
    STATE_VERSION,
    current_node,
    gather_nodes,
    gather_outcomes,
    gather_states,
    merge_states,
    world_state,
)

__all__ = [
    "STATE_VERSION",
    "ResumePlan",
    "apply_state",
    "current_node",
    "gather_nodes",
    "gather_outcomes",
    "gather_states",
    "make_basis",
    "merge_states",
    "plan_resume",
    "world_orders",
    "world_shards",
    "world_state",
]

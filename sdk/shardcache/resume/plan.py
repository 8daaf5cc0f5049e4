"""Every rank's order in a world, and the rest of an epoch dealt over a new world.

Every rank's order is a pure function of (chunk layout, world size, seed,
epoch), so a merged state is enough to recompute which samples an epoch
already delivered (:func:`plan_resume`); a world resumed from another keeps
deriving its shards from it (:func:`world_shards` with a basis).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.chunks import ChunkLayout
from shardcache.errors import ConfigError
from shardcache.resume.deal import Deal, give_extra, group_pieces
from shardcache.segments import GrowingListing
from shardcache.sharding import (
    assign_chunks,
    block_shuffle,
    epoch_order,
    global_order,
)

__all__ = ["ResumePlan", "make_basis", "plan_resume", "world_orders", "world_shards"]

_RESUME_SALT = 0x5E5  # separates a resumed epoch's shuffle from a normal one's


def world_orders(
    sizes: Sequence[int] | np.ndarray, world: Mapping[str, Any]
) -> list[np.ndarray]:
    """Every rank's order of ``world['epoch']`` in that world (what ShardSampler yields)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    w, e = int(world["world_size"]), int(world["epoch"])
    seed, shuffle, drop_last = int(world["seed"]), world["shuffle"], world["drop_last"]
    if world.get("resumed_from") is not None:
        return plan_resume(sizes, world["resumed_from"], w, world["plan_nodes"]).orders
    if world["mode"] == "global":
        n = int(sizes.sum())
        return [global_order(n, w, r, seed, e, shuffle, drop_last) for r in range(w)]
    layout, block = ChunkLayout.from_sizes(sizes), int(world.get("block", 0))
    if world.get("segments") and e == 0:  # a listing read while it was listed
        listing = GrowingListing(world["segments"])
        order = {"seed": seed, "shuffle": shuffle, "drop_last": drop_last}
        return [
            np.concatenate(listing.orders(layout, w, r, block_samples=block, **order))
            for r in range(w)
        ]
    shards = world_shards(sizes, w, seed, world.get("basis"))
    lens = [len(s) for s in shards]
    num = min(lens) if drop_last else max(lens)
    return [
        epoch_order(s, num, seed, e, shuffle, block_samples=block, layout=layout)
        for s in shards
    ]


def make_basis(merged: Mapping[str, Any], nodes: Sequence[str]) -> dict[str, Any]:
    """What a world resumed from ``merged`` on ``nodes`` derives its shards from."""
    return {
        "world_size": int(merged["world_size"]),
        "basis": merged.get("basis"),
        "old_nodes": list(merged["nodes"]),
        "nodes": list(nodes),
    }


def world_shards(
    sizes: np.ndarray, world_size: int, seed: int, basis: Mapping[str, Any] | None
) -> list[np.ndarray]:
    """Every rank's stable shard (ascending sample indices).

    Without a basis: rendezvous hashing over ranks (:func:`assign_chunks`).
    A world that resumed another one on known nodes (``basis``) keeps each
    chunk on the node that held it under the old world's shards, as the
    resumed epoch does, so its later epochs do not move data either: only
    what the node capacities force moves, once.
    """
    if basis is None:
        return assign_chunks(sizes, world_size, seed)
    old = world_shards(sizes, int(basis["world_size"]), seed, basis["basis"])
    n = int(sizes.sum())
    holder = np.empty(n, dtype=np.int32)
    for r, shard in enumerate(old):
        holder[shard] = r
    everything = np.arange(n, dtype=old[0].dtype if old else np.int64)
    pieces, homes = group_pieces(sizes, everything, holder, list(basis["old_nodes"]))
    nodes = list(basis["nodes"])
    held: dict[str, int] = {}
    for p, h in zip(pieces, homes, strict=True):
        held[h] = held.get(h, 0) + len(p)
    cap = np.full(world_size, n // world_size, dtype=np.int64)
    give_extra(cap, n % world_size, nodes, held)
    deal = Deal(cap, nodes, seed)
    deal.place(pieces, homes)
    dtype = np.int32 if n < 2**31 else np.int64
    return [
        np.sort(np.concatenate(t)).astype(dtype) if t else np.zeros(0, dtype=dtype)
        for t in deal.taken
    ]


@dataclass
class ResumePlan:
    """The rest of an epoch dealt over a new world.

    Attributes:
        orders: each new rank's samples, in the order it yields them.
        remaining: samples not yet consumed (what the orders hold, less
            ``dropped``). moved: samples given to a rank on another node
            than the one that read them. min_moved: the least any balanced
            deal could move (``sum over nodes of max(0, held - capacity)``).
        dropped: samples left out to equalise lengths (``drop_last`` only,
            fewer than the new world size).
    """

    orders: list[np.ndarray]
    remaining: int
    moved: int
    min_moved: int
    dropped: int

    @property
    def moved_fraction(self) -> float:
        return self.moved / self.remaining if self.remaining else 0.0


def _remaining(
    sizes: np.ndarray, old: Mapping[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    """Samples the old epoch still owed (ascending) and the old rank that held each."""
    orders = world_orders(sizes, old)
    n = int(sizes.sum())
    # 5 bytes per sample, once per resume (vectorised; per-chunk loops only).
    seen = np.zeros(n, dtype=bool)
    holder = np.full(n, -1, dtype=np.int32)
    for r, order in enumerate(orders):
        c = int(old["consumed"][r])
        if not 0 <= c <= len(order):
            raise ConfigError(
                f"rank {r} consumed {c} samples but its epoch has {len(order)}; "
                "the state does not belong to this dataset or world."
            )
        seen[order[:c]] = True
        # Padding repeats a rank's own samples, so a sample's holder is unique.
        holder[order] = r
    left = np.flatnonzero((holder >= 0) & ~seen)
    return left, holder[left]


def plan_resume(
    sizes: Sequence[int] | np.ndarray,
    old: Mapping[str, Any],
    world_size: int,
    nodes: Sequence[str] | None,
) -> ResumePlan:
    """Deal what ``old`` (a merged state) did not consume over ``world_size`` ranks.

    Lengths differ by at most one sample (the first ``remaining % world_size``
    ranks take one more); with ``drop_last`` all are ``remaining //
    world_size`` and the few left over are dropped. ``nodes`` names each new
    rank's node (``None``: no locality preference).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    layout = ChunkLayout.from_sizes(sizes)
    seed, epoch = int(old["seed"]), int(old["epoch"])
    left, holder = _remaining(sizes, old)
    total = len(left)
    if total == 0:  # saved at the epoch's end: nothing to deal
        return ResumePlan(
            [np.zeros(0, np.int64) for _ in range(world_size)], 0, 0, 0, 0
        )
    cap = np.full(world_size, total // world_size, dtype=np.int64)
    rng_key = [seed, epoch, _RESUME_SALT, world_size]
    if old["mode"] == "global":
        if not old["drop_last"]:
            cap[: total % world_size] += 1
        perm = np.random.default_rng(rng_key).permutation(left)
        ends = np.concatenate(([0], np.cumsum(cap)))
        return ResumePlan(
            [perm[ends[r] : ends[r + 1]] for r in range(world_size)],
            total,
            0,
            0,
            total - int(cap.sum()),
        )
    old_nodes = list(old.get("nodes") or [f"rank{r}" for r in range(len(holder))])
    new_nodes = list(nodes) if nodes is not None else [None] * world_size
    if len(new_nodes) != world_size:
        raise ConfigError(
            f"nodes names {len(new_nodes)} ranks but world_size is {world_size}."
        )
    pieces, homes = group_pieces(sizes, left, holder, old_nodes)
    held: dict[str, int] = {}
    for p, h in zip(pieces, homes, strict=True):
        held[h] = held.get(h, 0) + len(p)
    if not old["drop_last"]:
        give_extra(cap, total % world_size, new_nodes, held)
    deal = Deal(cap, new_nodes, seed)
    moved = deal.place(pieces, homes)
    room: dict[Any, int] = {}
    for r, node in enumerate(new_nodes):
        room[node] = room.get(node, 0) + int(cap[r])
    min_moved = sum(max(0, k - room.get(h, 0)) for h, k in held.items())
    orders = []
    for r in range(world_size):
        mine = (
            np.concatenate(deal.taken[r])
            if deal.taken[r]
            else np.zeros(0, dtype=np.int64)
        )
        mine = np.sort(mine)
        if old["shuffle"] and old.get("block"):  # the same chunk blocks as before
            mine = block_shuffle(
                mine, layout.chunk_of(mine), int(old["block"]), [*rng_key, r]
            )
        elif old["shuffle"]:
            np.random.default_rng([*rng_key, r]).shuffle(mine)
        orders.append(mine)
    return ResumePlan(orders, total, moved, min_moved, deal.dropped)

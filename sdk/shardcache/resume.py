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

>>> import numpy as np
>>> sizes = np.array([10] * 10)
>>> old = [{**world_state(4, seed=1), "rank": r, "consumed": 7,
...         "node": f"n{r // 2}"} for r in range(4)]
>>> merged = merge_states(old)
>>> plan = plan_resume(sizes, merged, 2, ["n0", "n1"])
>>> plan.remaining, sum(len(o) for o in plan.orders), plan.moved
(72, 72, 0)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.chunks import ChunkLayout
from shardcache.errors import ConfigError
from shardcache.sharding import (
    assign_chunks,
    block_shuffle,
    epoch_order,
    global_order,
)

__all__ = [
    "STATE_VERSION",
    "ResumePlan",
    "apply_state",
    "current_node",
    "gather_nodes",
    "gather_states",
    "make_basis",
    "merge_states",
    "plan_resume",
    "world_orders",
    "world_shards",
    "world_state",
]

STATE_VERSION = 1  # bumped when the meaning of a saved state changes
# Keys every rank of one world must agree on; merge_states checks them.
WORLD_KEYS = (
    "manifest",
    "epoch",
    "seed",
    "mode",
    "shuffle",
    "block",
    "drop_last",
    "world_size",
    "resumed_from",
    "plan_nodes",
    "basis",
)
_RESUME_SALT = 0x5E5  # separates a resumed epoch's shuffle from a normal one's


def world_state(
    world_size: int,
    *,
    epoch: int = 0,
    seed: int = 0,
    mode: str = "shard",
    shuffle: bool = True,
    drop_last: bool = False,
) -> dict[str, Any]:
    """The world part of a state (for tools and tests that build one by hand)."""
    return {
        "version": STATE_VERSION,
        "epoch": int(epoch),
        "seed": int(seed),
        "mode": mode,
        "shuffle": bool(shuffle),
        "block": 0,
        "drop_last": bool(drop_last),
        "world_size": int(world_size),
        "resumed_from": None,
        "plan_nodes": None,
        "basis": None,
    }


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state per old rank -> the job's state: consumed counts and nodes per rank.

    Raises:
        ConfigError: states of different epochs/seeds/worlds, a rank missing
            or given twice.
    """
    states = list(states)
    if not states:
        raise ConfigError("merge_states needs the state of every rank, got none.")
    first = states[0]
    if isinstance(first.get("consumed"), list):
        # Already merged (gather_state_dict gives every rank the same copy).
        if all(s == first for s in states):
            return dict(first)
        raise ConfigError("pass per-rank states or one merged state, not several.")
    world = int(first["world_size"])
    consumed: list[int | None] = [None] * world
    nodes = [""] * world
    for s in states:
        for key in WORLD_KEYS:
            if s.get(key) != first.get(key):
                raise ConfigError(
                    f"states disagree on {key}: {first.get(key)!r} vs {s.get(key)!r}; "
                    "merge the states saved at the same step of one job."
                )
        r = int(s["rank"])
        if not 0 <= r < world or consumed[r] is not None:
            raise ConfigError(
                f"rank {r} is out of range or given twice among {len(states)} states "
                f"of a world of {world}."
            )
        consumed[r] = int(s["consumed"])
        nodes[r] = str(s.get("node") or "")
    missing = [r for r, c in enumerate(consumed) if c is None]
    if missing:
        raise ConfigError(
            f"states of ranks {missing} are missing (world_size={world}); every "
            "rank's state is needed to know which samples were consumed."
        )
    return {
        "version": first.get("version", STATE_VERSION),
        **{k: first.get(k) for k in WORLD_KEYS},
        "consumed": consumed,
        "nodes": nodes,
    }


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def gather_states(state: Mapping[str, Any]) -> dict[str, Any]:
    """Every rank's state, merged, on every rank (one ``all_gather_object`` of
    small dicts); without a process group, ``state`` must be the only rank's.

    Raises:
        ConfigError: no process group and ``world_size`` > 1.
    """
    dist = _dist()
    if dist is None:
        if int(state["world_size"]) != 1:
            raise ConfigError(
                "gather_states needs torch.distributed initialised when "
                f"world_size={state['world_size']}; or save each rank's state_dict() "
                "and pass the list to merge_states."
            )
        return merge_states([state])
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, dict(state))
    return merge_states(out)


def gather_nodes(node: str, world_size: int) -> list[str] | None:
    """The node of every rank (``all_gather_object``), or ``None`` when unknown."""
    dist = _dist()
    if world_size == 1:
        return [node]
    if dist is None or dist.get_world_size() != world_size:
        return None
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, node)
    return [str(n) for n in out]


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
    shards = world_shards(sizes, w, seed, world.get("basis"))
    lens = [len(s) for s in shards]
    num = min(lens) if drop_last else max(lens)
    layout, block = ChunkLayout.from_sizes(sizes), int(world.get("block", 0))
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
    pieces, homes = _pieces(sizes, everything, holder, list(basis["old_nodes"]))
    nodes = list(basis["nodes"])
    held: dict[str, int] = {}
    for p, h in zip(pieces, homes, strict=True):
        held[h] = held.get(h, 0) + len(p)
    cap = np.full(world_size, n // world_size, dtype=np.int64)
    _give_extra(cap, n % world_size, nodes, held)
    deal = _Deal(cap, nodes, seed)
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


def _salt(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


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
    pieces, homes = _pieces(sizes, left, holder, old_nodes)
    held: dict[str, int] = {}
    for p, h in zip(pieces, homes, strict=True):
        held[h] = held.get(h, 0) + len(p)
    if not old["drop_last"]:
        _give_extra(cap, total % world_size, new_nodes, held)
    deal = _Deal(cap, new_nodes, seed)
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


def _give_extra(
    cap: np.ndarray, extra: int, nodes: list[Any], held: dict[str, int]
) -> None:
    """Give the ``extra`` one-sample-more slots to ranks of the nodes that hold
    more than their ranks can take, so they need not move (then to the first
    ranks)."""
    over = {n: held.get(n, 0) for n in dict.fromkeys(nodes)}
    for r, n in enumerate(nodes):
        over[n] -= int(cap[r])
    given = np.zeros(len(cap), dtype=bool)
    for _ in range(extra):
        best = max(
            (r for r in range(len(cap)) if not given[r]),
            key=lambda r: (over[nodes[r]] > 0, over[nodes[r]], -r),
        )
        given[best] = True
        cap[best] += 1
        over[nodes[best]] -= 1


def _pieces(
    sizes: np.ndarray, left: np.ndarray, holder: np.ndarray, old_nodes: list[str]
) -> tuple[list[np.ndarray], list[str]]:
    """The remaining samples grouped by (chunk, node that read it), in chunk order."""
    starts = np.concatenate(([0], np.cumsum(sizes)))
    chunk = np.searchsorted(starts, left, side="right") - 1
    node_ids = {n: i for i, n in enumerate(dict.fromkeys(old_nodes))}
    node_of_rank = np.array([node_ids[n] for n in old_nodes], dtype=np.int64)
    key = chunk * len(node_ids) + node_of_rank[holder]
    order = np.argsort(key, kind="stable")
    key, left = key[order], left[order]
    cuts = np.flatnonzero(np.diff(key)) + 1
    names = list(node_ids)
    homes = [names[int(k) % len(node_ids)] for k in key[np.concatenate(([0], cuts))]]
    return (np.split(left, cuts) if len(left) else []), (homes if len(left) else [])


class _Deal:
    """Bounded-load rendezvous placement of pieces on ranks, home node first."""

    def __init__(self, cap: np.ndarray, nodes: list[Any], seed: int):
        self.cap, self.nodes, self.seed = cap, nodes, seed
        self.load = np.zeros(len(cap), dtype=np.int64)
        self.taken: list[list[np.ndarray]] = [[] for _ in cap]
        self.rank_salt = _salt(np.arange(1, len(cap) + 1))
        self.seed_salt = _salt(np.array([seed & 0xFFFFFFFF]))[0]
        self.dropped = 0

    def _prefs(self, piece: np.ndarray, among: list[int]) -> list[int]:
        # Keyed by the piece's first sample: the same piece prefers the same
        # ranks whichever node it comes from.
        h = _salt(np.array([int(piece[0]) + 1]))[0] ^ self.seed_salt
        scores = _salt(np.bitwise_xor(self.rank_salt[among], h))
        return [among[i] for i in np.argsort(-scores.astype(np.float64), kind="stable")]

    def _whole(self, pieces: list[np.ndarray], among: list[int]) -> list[np.ndarray]:
        rest = []
        for p in pieces:
            for r in self._prefs(p, among):
                if self.load[r] + len(p) <= self.cap[r]:
                    self.taken[r].append(p)
                    self.load[r] += len(p)
                    break
            else:
                rest.append(p)
        return rest

    def _split(self, pieces: list[np.ndarray], among: list[int]) -> list[np.ndarray]:
        rest = []
        for p in pieces:
            for r in self._prefs(p, among):
                take = int(min(len(p), self.cap[r] - self.load[r]))
                if take > 0:
                    self.taken[r].append(p[:take])
                    self.load[r] += take
                    p = p[take:]
                if len(p) == 0:
                    break
            if len(p):
                rest.append(p)
        return rest

    def place(self, pieces: list[np.ndarray], homes: list[str]) -> int:
        """Place every piece; returns the samples placed off their home node."""
        by_home: dict[str, list[np.ndarray]] = {}
        for p, h in zip(pieces, homes, strict=True):
            by_home.setdefault(h, []).append(p)
        pool: list[tuple[np.ndarray, str]] = []
        # Per node: whole chunks to its ranks first, then split the rest
        # between them; only what exceeds the node's capacity leaves it.
        for home, group in by_home.items():
            local = [r for r, n in enumerate(self.nodes) if n == home]
            rest = self._split(self._whole(group, local), local) if local else group
            pool += [(p, home) for p in rest]
        everyone = list(range(len(self.cap)))
        before = self.load.copy()
        rest = self._split(self._whole([p for p, _ in pool], everyone), everyone)
        self.dropped = int(sum(len(p) for p in rest))
        return int((self.load - before).sum())


def current_node() -> str:
    """This process's Ray node id ("" when Ray is not initialised here)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def apply_state(
    sampler: Any,
    state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    digest: str,
    nodes: Sequence[str] | None = None,
    explain: Callable[[str], str] | None = None,
) -> int:
    """Point ``sampler`` (a ShardSampler) at the rest of the saved epoch; returns
    the samples this rank already consumed of its (new) order.

    ``state`` is one rank's state (same world and rank), a list of every
    rank's, or a merged one. A merged state of the same world on the same
    nodes (or unknown nodes) continues each rank's own order; otherwise the
    rest is re-dealt (:func:`plan_resume`) over ``nodes``, gathered over the
    process group when not given. ``explain(saved_digest)`` says what
    changed between the saved listing and this one (the error names it).

    Raises:
        ConfigError: another seed, mode or listing; one rank's state for
            another world; a world change with no way to know the nodes.
    """
    merged = None
    if not isinstance(state, Mapping) or isinstance(state.get("consumed"), list):
        merged = merge_states([state] if isinstance(state, Mapping) else state)
        state = merged
    mine = sampler.state()
    keys = ("seed", "mode") if merged else ("seed", "rank", "world_size", "mode")
    for key in keys:
        if state.get(key) != mine[key]:
            hint = (
                " To resume at another world size pass every rank's state."
                if key in ("rank", "world_size")
                else ""
            )
            raise ConfigError(
                f"state_dict has {key}={state.get(key)!r} but this dataset has "
                f"{mine[key]!r}; resume with the same settings.{hint}"
            )
    if int(state.get("block") or 0) != int(mine.get("block") or 0):
        raise ConfigError(
            f"state_dict has shuffle_block={state.get('block') or 0!r} but this "
            f"dataset has {mine.get('block') or 0!r}; resume with the same settings."
        )
    saved = state.get("manifest")
    if saved != digest:
        what = explain(str(saved)) if explain is not None else "the objects changed"
        raise ConfigError(
            f"state_dict was saved on another listing of the source ({what}); "
            "its positions would not match today's shards. Start the epoch over "
            "(skip load_state_dict), or restore those objects and resume."
        )
    epoch = int(state["epoch"])
    if merged is not None:
        world = sampler.world_size
        if nodes is None:
            nodes = gather_nodes(current_node(), world)
        if merged["world_size"] != world or (
            nodes is not None and list(nodes) != merged["nodes"]
        ):
            if nodes is None:
                raise ConfigError(
                    f"resuming {merged['world_size']} ranks' state at "
                    f"world_size={world} needs every new rank's node: "
                    "initialise torch.distributed or pass nodes=[...]."
                )
            sampler.resume_elastic(merged, nodes)
            sampler.resume(epoch, 0)
            return 0
        consumed = int(merged["consumed"][sampler.rank])
    else:
        consumed = int(state["consumed"])
    sampler.use_basis(state.get("basis"))
    if state.get("resumed_from") is not None:
        # Saved inside an epoch that was itself resumed elastically.
        sampler.resume_elastic(state["resumed_from"], state["plan_nodes"])
    sampler.resume(epoch, consumed)
    return consumed

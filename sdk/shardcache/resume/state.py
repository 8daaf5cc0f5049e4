"""What a rank saves of its place in an epoch, and the job's state merged from every rank's.

A rank's state is O(1): the epoch, the seed and sharding mode, the world size,
its rank, how many samples it consumed and the node it ran on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardcache.errors import ConfigError

__all__ = [
    "STATE_VERSION",
    "WORLD_KEYS",
    "by_rank",
    "current_node",
    "gather_nodes",
    "gather_states",
    "merge_states",
    "world_state",
]

STATE_VERSION = 1  # bumped when the meaning of a saved state changes
# Keys every rank of one world must agree on; merge_states checks them.
WORLD_KEYS = (
    "manifest",
    "layout",
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


def by_rank(
    states: Sequence[Mapping[str, Any]], agree: Iterable[str]
) -> list[Mapping[str, Any]]:
    """Every rank's own state once, in rank order, all agreeing on ``agree``
    (what makes them saves of one step of one job).

    Raises:
        ConfigError: states disagree on a key of ``agree``, or a rank is out
            of range, given twice or missing.

    >>> [s["rank"] for s in by_rank([{"world_size": 2, "rank": 1},
    ...                              {"world_size": 2, "rank": 0}], ["world_size"])]
    [0, 1]
    """
    first = states[0]
    world = int(first["world_size"])
    ordered: list[Mapping[str, Any] | None] = [None] * world
    for s in states:
        for key in agree:
            if s.get(key) != first.get(key):
                raise ConfigError(
                    f"states disagree on {key}: {first.get(key)!r} vs {s.get(key)!r}; "
                    "merge the states saved at the same step of one job."
                )
        r = int(s["rank"])
        if not 0 <= r < world or ordered[r] is not None:
            raise ConfigError(
                f"rank {r} is out of range or given twice among {len(states)} states "
                f"of a world of {world}."
            )
        ordered[r] = s
    missing = [r for r, s in enumerate(ordered) if s is None]
    if missing:
        raise ConfigError(
            f"states of ranks {missing} are missing (world_size={world}); every "
            "rank's state is needed to know which samples were consumed."
        )
    return [s for s in ordered if s is not None]


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
    ordered = by_rank(states, WORLD_KEYS)
    consumed = [int(s["consumed"]) for s in ordered]
    nodes = [str(s.get("node") or "") for s in ordered]
    # Ranks may snapshot a generation a batch apart; the newest is the record.
    generations = [int(s["generation"]) for s in states if s.get("generation")]
    return {
        "version": first.get("version", STATE_VERSION),
        **{k: first.get(k) for k in WORLD_KEYS},
        "generation": max(generations) if generations else None,
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


def current_node() -> str:
    """This process's Ray node id ("" when Ray is not initialised here)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

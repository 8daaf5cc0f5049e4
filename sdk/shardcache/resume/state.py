"""What a rank saves of its place in an epoch, and the job's state merged from every rank's.

A rank's state is O(1): the epoch, the seed and sharding mode, the world size,
its rank, how many samples it consumed, the epoch's largest batch read and the
node it ran on.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Integral
from typing import Any

from shardcache.errors import ConfigError, ShardCacheError, error_type

__all__ = [
    "STATE_VERSION",
    "WORLD_KEYS",
    "by_rank",
    "check_consumed",
    "check_state",
    "current_node",
    "gather_nodes",
    "gather_outcomes",
    "gather_states",
    "merge_states",
    "saved_batch",
    "world_state",
]

STATE_VERSION = 2  # bumped when the meaning of a saved state changes
# 2: shards deal a layout's small chunks (the first chunk's pieces) evenly
# first (sharding.assign_chunks), so a state of version 1 names positions
# in orders this release no longer computes.
# Keys every rank of one world must agree on; merge_states checks them.
WORLD_KEYS = (
    "dataset",
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
    "segments",
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


_INT_KEYS = ("epoch", "seed", "world_size")


def check_state(state: Any, dataset: str) -> None:
    """``state`` is what :meth:`state_dict` (or a merge of them) saved, for
    ``dataset``: checked before any of it is used, so a damaged or foreign
    state is named instead of resuming at a wrong place.

    Raises:
        ConfigError: not a state (or a list of them), a field missing or of
            the wrong type, a negative count, another state version, or the
            state of another dataset.

    >>> check_state({"version": 2, "epoch": 0, "seed": 0, "world_size": 1,
    ...              "mode": "shard", "consumed": -5}, "d")
    Traceback (most recent call last):
    ...
    shardcache.errors.ConfigError: state_dict has consumed=-5; a count of consumed samples is an integer >= 0. Pass the dict that state_dict() or gather_state_dict() returned, unchanged.
    """
    fix = "Pass the dict that state_dict() or gather_state_dict() returned, unchanged."
    if isinstance(state, Mapping):
        states = [state]
    elif isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
        states = list(state)
        if not states or not all(isinstance(s, Mapping) for s in states):
            raise ConfigError(
                f"load_state_dict got a list of {[type(s).__name__ for s in states]}; "
                f"it takes every rank's state_dict() (dicts), in any order. {fix}"
            )
    else:
        raise ConfigError(
            f"load_state_dict got a {type(state).__name__}, not a state_dict. {fix}"
        )
    for s in states:
        missing = [k for k in ("version", *_INT_KEYS, "mode", "consumed") if k not in s]
        if missing:
            raise ConfigError(
                f"state_dict lacks {', '.join(missing)}: it is not a state saved by "
                f"this dataset's state_dict(). {fix}"
            )
        if s["version"] != STATE_VERSION:
            raise ConfigError(
                f"state_dict has version={s['version']!r}; this shardcache reads "
                f"version {STATE_VERSION}. Resume with the release that saved it."
            )
        saved = s.get("dataset")
        if saved is not None and saved != dataset:
            raise ConfigError(
                f"state_dict was saved by dataset {saved!r}, not by this one "
                f"({dataset!r}); load the state this dataset saved."
            )
        for key in _INT_KEYS:
            if not _count(s[key]):
                raise ConfigError(
                    f"state_dict has {key}={s[key]!r}; it is an integer >= 0. {fix}"
                )
        consumed = s["consumed"]
        counts = consumed if isinstance(consumed, list) else [consumed]
        if not counts or not all(_count(c) for c in counts):
            raise ConfigError(
                f"state_dict has consumed={consumed!r}; a count of consumed samples "
                f"is an integer >= 0. {fix}"
            )


def _count(value: Any) -> bool:
    """An integer >= 0 (numpy's too), never a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= 0


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
        "batch": saved_batch(states),
    }


def saved_batch(state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> int:
    """The saved epoch's largest batch read (``"batch"``; the largest of
    every rank's), 0 where a state has none (saved before it was kept, or
    its reads were DataLoader workers').

    >>> saved_batch([{"batch": 4}, {"batch": 8}, {}]), saved_batch({"batch": "x"})
    (8, 0)
    """
    states = [state] if isinstance(state, Mapping) else list(state)
    return max((int(b) for s in states if _count(b := s.get("batch")) and b), default=0)


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def gather_states(produce: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's ``produce()`` (its state), merged, on every rank (one
    ``all_gather_object`` of small dicts); without a process group, the state
    must be the only rank's.

    Raises:
        ConfigError: no process group and ``world_size`` > 1.
        ShardCacheError: ``produce`` raised on any rank: raised on every
            rank (see :func:`gather_outcomes`).
    """
    states = gather_outcomes(lambda: dict(produce()))
    if _dist() is None and int(states[0]["world_size"]) != 1:
        raise ConfigError(
            "gather_states needs torch.distributed initialised when "
            f"world_size={states[0]['world_size']}; or save each rank's "
            "state_dict() and pass the list to merge_states."
        )
    return merge_states(states)


def gather_outcomes(produce: Callable[[], Any]) -> list[Any]:
    """``produce()`` on this rank, and every rank's result on every rank.

    A rank whose ``produce`` raises still joins the collective, with its
    error: every rank then raises (the failing one its own exception, the
    others the project's error of that name, or ``ShardCacheError`` for a
    builtin, naming that rank), where before the others waited
    in ``all_gather_object`` for a rank that never came, until the process
    group's timeout (30 minutes by default). Without a process group it is
    ``[produce()]``.
    """
    dist = _dist()
    if dist is None:
        return [produce()]
    failed: BaseException | None = None
    try:
        mine: tuple[str, Any] = ("ok", produce())
    except BaseException as exc:  # even Ctrl-C: never leave the others waiting
        failed = exc
        mine = ("error", (type(exc).__name__, str(exc)))
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    if failed is not None:
        raise failed
    for rank, (kind, value) in enumerate(out):
        if kind == "error":
            name, message = value
            raise error_type(name, ShardCacheError)(
                f"rank {rank} could not give its state, so no rank's is saved: "
                f"{name}: {message}"
            )
    return [value for _, value in out]


def check_consumed(consumed: Any, length: int | None, rank: int) -> None:
    """``state_dict(consumed=N)``'s count, checked when it is saved rather
    than when the checkpoint is loaded (maybe days later): an integer >= 0,
    and at most the rank's share of the epoch, ``length`` (``None``: no bound
    known here).

    Raises:
        ConfigError: naming the count and what it may be.

    >>> import torch; check_consumed(torch.tensor(10), 10, 0)
    >>> check_consumed(-1, 10, 0)
    Traceback (most recent call last):
    ...
    shardcache.errors.ConfigError: state_dict(consumed=-1): the count of samples this rank took this epoch, counted from the epoch's start, is an integer from 0 to rank 0's share of the epoch, 10 (len(ds.sampler)); a short last batch counts its own size.
    """
    try:  # an int, numpy's, or a 0-d integer tensor; never a float or bool
        count = None if isinstance(consumed, bool) else operator.index(consumed)
    except TypeError:
        count = None
    if count is not None and count >= 0 and (length is None or count <= length):
        return
    raise ConfigError(
        f"state_dict(consumed={consumed!r}): the count of samples this rank took "
        "this epoch, counted from the epoch's start, is an integer "
        + (
            ">= 0."
            if length is None
            else f"from 0 to rank {rank}'s share of the epoch, {length} "
            "(len(ds.sampler)); a short last batch counts its own size."
        )
    )


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

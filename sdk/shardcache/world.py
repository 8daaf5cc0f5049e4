"""Who am I in the job: rank, world size, local rank, DataLoader worker.

Launchers put the rank in different places: torchrun and Ray Train set
``RANK``; Lightning's own launcher (``python train.py`` with ``devices=N``)
sets ``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE`` but not ``RANK``, and
only in the processes it starts, while the first process learns its place
when ``Trainer.fit`` runs. So a dataset built before the process group
exists reads the world lazily (:class:`LazyWorld`), at its first batch or
epoch, and the process group, once there, always wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardcache.errors import ConfigError

__all__ = ["SOURCES", "LazyWorld", "World"]

# Where a World came from, most to least certain: "args" (rank=/world_size=
# given), "process_group", "env" (a launcher's variables), "none" (nothing
# said anything: one process, or a launcher that has not started yet).
SOURCES = ("args", "process_group", "env", "none")


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(
            f"{name} must be an integer, got {env[name]!r}; fix the launcher's "
            f"environment or pass rank= and world_size= to the dataset."
        ) from None


def _rank_from_env(env: Mapping[str, str], world_size: int) -> int | None:
    """The global rank the launcher's variables give, or None if they give none.

    Raises:
        ConfigError: the variables name a world but not where this process is in it.
    """
    if "RANK" in env:
        return _int(env, "RANK")
    if "LOCAL_RANK" in env:
        local = _int(env, "LOCAL_RANK")
        node_var = "NODE_RANK" if "NODE_RANK" in env else "GROUP_RANK"
        node = _int(env, node_var) if node_var in env else 0
        if node == 0:
            return local
        if "LOCAL_WORLD_SIZE" in env:
            return node * _int(env, "LOCAL_WORLD_SIZE") + local
        raise ConfigError(
            f"{node_var}={node} and LOCAL_RANK={local} but neither RANK nor "
            "LOCAL_WORLD_SIZE is set, so this process's global rank is unknown. "
            "Build the dataset after the process group starts (e.g. in "
            "LightningModule.train_dataloader), set RANK, or pass rank=."
        )
    if world_size > 1:
        raise ConfigError(
            f"WORLD_SIZE={world_size} but neither RANK nor LOCAL_RANK is set, so "
            "this process's rank is unknown and two ranks could read one shard. "
            "Build the dataset after the process group starts, set RANK, or pass "
            "rank= and world_size=."
        )
    return None


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    worker_id: int = 0
    num_workers: int = 1
    source: str = "none"  # one of SOURCES

    @classmethod
    def provisional(cls, rank: int | None, world_size: int | None) -> tuple[int, int]:
        """The rank and world as far as known now, without raising: a sampler
        resolves (and validates) them at first use.

        >>> World.provisional(3, 4)
        (3, 4)
        """
        try:
            world = cls.detect()
        except ConfigError:
            world = cls()
        return (
            world.rank if rank is None else rank,
            world.world_size if world_size is None else world_size,
        )

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> World:
        """Read the process group if initialised, else the launcher's variables
        (``RANK``, or ``LOCAL_RANK`` with ``NODE_RANK``/``GROUP_RANK``, and
        ``WORLD_SIZE``), else 0/1.

        Needs no process group; the DataLoader worker comes from
        ``torch.utils.data.get_worker_info()``.

        Raises:
            ConfigError: ``WORLD_SIZE`` > 1 with no way to know this rank.

        >>> w = World.detect({"LOCAL_RANK": "1", "WORLD_SIZE": "2"})
        >>> w.rank, w.world_size, w.source
        (1, 2, 'env')
        """
        import torch.distributed as dist
        from torch.utils.data import get_worker_info

        env = os.environ if env is None else env
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
            source = "process_group"
        else:
            world_size = _int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else 1
            found = _rank_from_env(env, world_size)
            rank, source = (0, "none") if found is None else (found, "env")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        info = get_worker_info()
        worker_id, num_workers = (
            (info.id, info.num_workers) if info is not None else (0, 1)
        )
        return cls(rank, world_size, local_rank, worker_id, num_workers, source)


class LazyWorld:
    """The rank and world of a dataset, resolved at first use.

    Explicit arguments are final at once. Otherwise nothing is read until
    :meth:`get` is first called (a sampler's first iteration, length or
    epoch), and the answer is checked against the process group at every
    epoch start (:meth:`check`): a dataset built before ``Trainer.fit``
    started the group learns its place then, never silently the wrong one.

    Args:
        rank, world_size: given by the user (``None``: detect).
    """

    def __init__(self, rank: int | None = None, world_size: int | None = None):
        self._given = (rank, world_size)
        self._world: World | None = None
        if rank is not None and world_size is not None:
            self._world = World(rank, world_size, source="args")

    @property
    def is_resolved(self) -> bool:
        return self._world is not None

    def get(self) -> World:
        """The world, detected now if it was not yet.

        Raises:
            ConfigError: the launcher's variables name no rank for a world > 1.
        """
        if self._world is None:
            self._world = self._detect()
        return self._world

    def _detect(self) -> World:
        rank, world_size = self._given
        if rank is None and world_size is None:
            return World.detect()
        # One of the two given: the launcher says the other.
        env = dict(os.environ)
        if rank is not None:
            env["RANK"] = str(rank)
        found = World.detect(env)
        return World(
            found.rank if rank is None else rank,
            found.world_size if world_size is None else world_size,
            source="args",
        )

    def check(self, used: bool) -> bool:
        """Compare a world read from the environment with the process group,
        if one started since. Returns True when it moved and was not
        ``used`` yet (the caller re-derives what depends on it).

        Raises:
            ConfigError: the world was ``used`` and the process group disagrees.
        """
        import torch.distributed as dist

        world = self._world
        if world is None or world.source in ("args", "process_group"):
            return False
        if not (dist.is_available() and dist.is_initialized()):
            return False
        now = (dist.get_rank(), dist.get_world_size())
        moved = now != (world.rank, world.world_size)
        if moved and used:
            raise ConfigError(
                f"this dataset took rank {world.rank} of {world.world_size} (from "
                f"{'the environment' if world.source == 'env' else 'no launcher'}) "
                f"but the process group says rank {now[0]} of {now[1]}. Build the "
                "dataset after the process group starts (in "
                "LightningModule.train_dataloader or setup, or after "
                "init_process_group), or pass rank= and world_size=."
            )
        self._world = World(*now, world.local_rank, source="process_group")
        return moved

"""Who am I in the job: rank, world size, local rank, DataLoader worker."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["World"]


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    worker_id: int = 0
    num_workers: int = 1

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> World:
        """Read the process group if initialised, else RANK/WORLD_SIZE, else 0/1.

        Needs no process group; the DataLoader worker comes from
        ``torch.utils.data.get_worker_info()``.
        """
        import torch.distributed as dist
        from torch.utils.data import get_worker_info

        env = os.environ if env is None else env
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank = int(env.get("RANK", 0))
            world_size = int(env.get("WORLD_SIZE", 1))
        local_rank = int(env.get("LOCAL_RANK", 0))
        info = get_worker_info()
        worker_id, num_workers = (
            (info.id, info.num_workers) if info is not None else (0, 1)
        )
        return cls(rank, world_size, local_rank, worker_id, num_workers)

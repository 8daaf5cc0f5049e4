"""Which run of a training job this process belongs to: one id, the same on every rank.

A job id scopes three things: the listing a job revalidates when it starts
(one listing answers all its ranks), the per-job rows of the dashboard, and
the refresh rounds inside the job. So two runs of the same script must get
two ids, and the ranks of one run the same id, with no argument from the
user. In order of precedence:

1. ``job=`` or ``SHARDCACHE_JOB``: the user's own name for the run.
2. Ray Train: the run's id (``TrainRunContext.run_id``), shared by its workers.
3. torchrun: the first rank to ask writes a fresh id into the launcher's
   own store (``TORCHELASTIC_USE_AGENT_STORE``; the TCPStore at
   ``MASTER_ADDR:MASTER_PORT``, new for every launch), every rank reads it,
   prefixed by ``TORCHELASTIC_RUN_ID`` unless that is ``none`` (static
   multi-node launches set ``none`` for every run alike; a ``--rdzv-id`` is
   often a constant too, so it never identifies a launch alone). A worker
   group restarted by the agent keeps the id (same launch, same job).
4. A run id without the agent's store: ``TORCHELASTIC_RUN_ID``.
5. An initialized process group: the same through its store.
6. One process (world size 1): a fresh id.
7. Several ranks and none of the above (a launcher that starts the process
   group later, as Lightning's does): a fresh id per process, which each
   rank uses to revalidate the listing on its own. At the first batch or
   epoch, once the process group runs, the ranks agree through it
   (:func:`agree_in_process_group`) and report as one job; a rank that
   still cannot agree warns, naming ``job=``.

>>> resolve_job("nightly-42").id, resolve_job("nightly-42").source
('nightly-42', 'job=')
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from shardcache.keys import validate_name

__all__ = ["JobId", "agree_in_process_group", "resolve_job", "warn_unshared"]

log = logging.getLogger("shardcache")

STORE_KEY = "shardcache/job_id"  # the key rank 0 (or whoever is first) writes
STORE_TIMEOUT_S = 30.0  # connecting to the launcher's store
TORCHRUN_DEFAULT_RUN_ID = "none"  # what static torchrun launches all share


@dataclass(frozen=True)
class JobId:
    """A job id and where it came from (shown by ``ds.stats()``)."""

    id: str
    source: str

    @property
    def one_launch(self) -> bool:
        """The id names one launch, never a later one: made for this launch
        (torchrun's store, Ray Train's run, the process group, a fresh id),
        not a name the user or a launcher may give every run alike.

        >>> JobId("a1b2", "torchrun").one_launch, JobId("nightly", "job=").one_launch
        (True, False)
        """
        return self.source in ("torchrun", "ray-train", "process-group", "process")


def _fresh() -> str:
    return uuid.uuid4().hex[:16]


def resolve_job(explicit: str | None, env: Mapping[str, str] | None = None) -> JobId:
    """This process's job id (see the module docstring for the order).

    Raises:
        ConfigError: ``job=`` / ``SHARDCACHE_JOB`` is not a key-safe name.
    """
    env = os.environ if env is None else env
    if explicit is not None:
        return JobId(validate_name("job", explicit), "job=")
    if env.get("SHARDCACHE_JOB"):
        return JobId(validate_name("SHARDCACHE_JOB", env["SHARDCACHE_JOB"]), "env")
    ray_run = _ray_train_run_id()
    if ray_run:
        return JobId(ray_run, "ray-train")
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    named = bool(run_id) and run_id != TORCHRUN_DEFAULT_RUN_ID
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_PORT"):
        from torch.distributed import TCPStore

        store = TCPStore(
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
        )
        # A run id is often a constant (--rdzv-id=train pasted into every
        # launch): the launch's own store tells two launches apart.
        launch = _agree(store)
        return JobId(
            f"{_safe(run_id)[:40]}-{launch[:8]}" if named else launch, "torchrun"
        )
    if named:
        return JobId(_safe(run_id), "torchrun run id")
    return agree_in_process_group() or JobId(_fresh(), "process")


def agree_in_process_group() -> JobId | None:
    """The id the ranks of the initialized process group agree on (the first
    to ask writes it into the group's store), else ``None``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        return JobId(_agree(store), "process-group")
    return None


def warn_unshared(world_size: int) -> None:
    """Several ranks, each with its own job id (see 7. above)."""
    log.warning(
        "shardcache: %s ranks but no way to agree on a job id (no process group "
        "at the first batch, no torchrun store): each rank is its own job on the "
        "dashboard and lists the source itself. Pass job= (or SHARDCACHE_JOB) "
        "with one id per run.",
        world_size,
    )


def _agree(store: object) -> str:
    """The id the first caller wrote into ``store`` (``compare_set`` is atomic)."""
    won = store.compare_set(STORE_KEY, "", _fresh())  # type: ignore[attr-defined]
    return _safe(won.decode() if isinstance(won, bytes) else str(won))


def _ray_train_run_id() -> str:
    """The Ray Train run's id inside a Ray Train worker, else ``""``."""
    if "ray.train" not in sys.modules:  # never import Ray Train to find out
        return ""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return _safe(get_train_context().train_run_context.run_id)
    except (ImportError, RuntimeError, AttributeError):
        return ""


def _safe(raw: str) -> str:
    """A key-safe form of a launcher's id (uuids and hex pass unchanged)."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in raw)[:64]

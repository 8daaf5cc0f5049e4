"""SessionSlot: which RankSession this process reads through, and where it is in the epoch.

A dataset object travels: DataLoader workers get it pickled (spawn) or
inherited (fork), and it may be built before the launcher or process group
has said where the process is. The slot owns the rule that keeps one
session per process: a spawned worker opens its own when it is unpickled, a
forked one when it first reads (keeping the listing it inherited mapped),
and the constructing process opens a fresh one when the world it learns at
first use names another rank than the provisional one, as long as it has
not read a batch yet. The sampler calls back into the slot (never into the
dataset) for both. Where the process is in the epoch (an epoch's start, a
saved state, a resume) is the slot's too, since each of those must reach
the session that is current.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from torch.utils.data import get_worker_info

from shardcache import heap
from shardcache.batches import read_elsewhere
from shardcache.epoch_board import EpochBoard
from shardcache.errors import ConfigError
from shardcache.generations import Generations, layout_digest
from shardcache.job import JobId, agree_in_process_group, warn_unshared
from shardcache.manifest import Manifest
from shardcache.resume import apply_state, current_node
from shardcache.resume.apply import check_on_change, crossed_listing
from shardcache.resume.state import check_consumed, saved_batch
from shardcache.sampler import ShardSampler
from shardcache.session import RankSession
from shardcache.spec import DatasetSpec
from shardcache.transport.read_path import open_for_this_process
from shardcache.world import World

__all__ = ["SessionSlot"]


class SessionSlot:
    """This process's :class:`RankSession`, renewed when the process or the world changes.

    Args:
        spec, job, sampler, generations: the dataset's parts a session reads.
        world: the provisional ``(rank, world_size)``; the sampler's first
            use brings the final one (:meth:`use_world`).
        client, manifest: the constructing process's client and mapped listing.
    """

    def __init__(
        self,
        spec: DatasetSpec,
        job: JobId,
        sampler: ShardSampler,
        generations: Generations,
        world: tuple[int, int],
        client: Any,
        manifest: Manifest,
    ):
        self.spec, self.job, self.generations = spec, job, generations
        self.sampler = sampler
        self.rank, self.world_size = world
        self.epoch_started: int | None = None
        # The reading this process's DataLoader workers read for (posted at
        # each epoch start; epoch_board.py).
        self.board = EpochBoard()
        self.board.prepare()  # a worker forked before the first post reads it
        sampler.bind(self.start_epoch, self.use_world)
        self.session = self._open(client, manifest)

    def _open(self, client: Any, manifest: Manifest | None) -> RankSession:
        parts = (self.spec, self.job, self.rank, self.sampler, self.generations)
        return RankSession(*parts, client, manifest, self.board)

    def __getstate__(self) -> dict[str, Any]:
        # Workers get the small description: never the mapped manifest,
        # chunks or threads. Each worker maps them again by digest.
        state = self.__dict__.copy()
        state.pop("session")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.sampler.bind(self.start_epoch, self.use_world)
        self.session = self._open(open_for_this_process(self.spec.config), None)

    def here(self) -> RankSession:
        """This process's session, with the rank known: a forked DataLoader
        worker starts its own (keeping the listing it inherited mapped)."""
        self.sampler.rank  # noqa: B018 (resolves the world: use_world may renew)
        if not self.session.is_current:
            client = open_for_this_process(self.spec.config, forked=True)
            self.session.abandon()  # the rank's, which the rank reports
            self.session = self._open(client, self.session.manifest)
        return self.session

    def use_world(self, world: World) -> None:
        """The sampler read the world (at first use): rank-keyed reporting
        follows it, and so does the job id where the ranks could not agree
        on one when the dataset was built. Only ever before this process's
        first batch."""
        job = self._agreed_job(world.world_size)
        if job == self.job and (world.rank, world.world_size) == (
            self.rank,
            self.world_size,
        ):
            return
        self.job = job
        self.rank, self.world_size = world.rank, world.world_size
        old = self.session
        if old.is_current and old.waits.batches == 0:
            old.close_reader()
            old.abandon()
            self.session = self._open(old.client, old.manifest)

    def _agreed_job(self, world_size: int) -> JobId:
        """A per-process id (no way to agree when built: Lightning's launcher
        starts the process group later) replaced by the one the process group
        agrees on, in the rank's own process; a DataLoader worker keeps its
        rank's (it was started after the rank's first use: trainers ask
        ``len()`` before iterating)."""
        if self.job.source != "process" or world_size < 2:
            return self.job
        if get_worker_info() is not None:
            return self.job
        agreed = agree_in_process_group()
        if agreed is None:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a launcher's ranks
                warn_unshared(world_size)
            return self.job
        return agreed

    def start_epoch(self, epoch: int, resuming: bool) -> None:
        """The sampler started ``epoch`` (``ds.set_epoch`` or
        ``ds.sampler.set_epoch``): the order, the reports and the generation
        snapshot happen here, once per epoch, outside the first batch's wait."""
        if epoch == self.epoch_started and self.session.waits.batches == 0:
            return  # both set_epoch calls of one epoch, or a repeat: once
        self.epoch_started = epoch
        self.sampler.known_order()  # computed now, not inside the first batch's wait
        # Once per epoch, on the rank: the previous order and this one's
        # temporaries were freed, and glibc would keep their pages (9 MB at
        # 1 M samples). Not in sampler.order(), which the store's eviction
        # planner calls too.
        heap.trim()
        session = self.session  # the world is known now (a fresh one, maybe)
        session.start_epoch(resuming)  # reports last epoch's numbers first
        self.generations.renew()
        if self.spec.consistency == "epoch" and session.is_current:
            # The snapshot is one Redis read; taking it here keeps it out of
            # the first batch's wait (DataLoader workers take their own).
            session.generation()

    def state(self, consumed: int | None) -> dict[str, Any]:
        """``DistributedCachedDataset.state_dict``: the position and what was read.

        Raises:
            ConfigError: ``consumed`` not given, and this process's sampler
                handed out more of the epoch than this process read (by a
                batch or more): DataLoader workers read it, and only the
                loop knows how many of their batches it took.
        """
        position = self.sampler.state()
        if consumed is None:
            self._check_reads_are_here()
        else:
            # Inside an epoch resumed at another world size, the resume's
            # plan bounds the count when it is loaded.
            elastic = position["resumed_from"] is not None
            check_consumed(
                consumed, None if elastic else len(self.sampler), self.sampler.rank
            )
        return {
            **position,
            "dataset": self.spec.name,
            "consumed": self.session.consumed if consumed is None else int(consumed),
            "batch": self._saved_batch(),
            "manifest": self.generations.digest,
            "generation": self.generations.generation,
            "layout": layout_digest(self.sampler.sizes),
            "node": current_node(),
        }

    def _saved_batch(self) -> int:
        """This epoch's largest read, here or in the run this one resumed."""
        epoch, resumed = self.session.resumed_batch
        if epoch != self.sampler.epoch:
            resumed = 0
        return max(self.session.epoch_batch, resumed)

    def _batch(self) -> int:
        """This epoch's largest read in this process; once the epoch's
        iteration has ended, the run it resumed counts too. A process resumed
        at a drop_last epoch's end (at one rank's or another world's state)
        reads nothing and is handed the dropped tail, less than that batch.
        Mid-epoch only this process's reads count: its DataLoader may read
        with workers and another batch size than the saved run."""
        if self.sampler.handed_out() < len(self.sampler):
            return self.session.epoch_batch
        return self._saved_batch()

    def _check_reads_are_here(self) -> None:
        read_here = self.session.consumed
        handed_out = read_elsewhere(self.sampler, read_here, self._batch())
        if handed_out is not None:
            raise ConfigError(
                f"state_dict(): this process's sampler handed out {handed_out} "
                f"samples of epoch {self.sampler.epoch} and this process read "
                f"{read_here} of them: DataLoader workers read the rest, ahead "
                "of your loop, so the count of samples your loop consumed is "
                "not known here. Pass it: ds.state_dict(consumed=N), N the "
                "samples this rank took this epoch counted from the epoch's "
                "start (in a resumed run, the resumed count plus those taken "
                "since), or use torchdata's StatefulDataLoader (exact, no "
                "count needed), or ds.loader(batch_size)."
            )

    def resume(
        self,
        state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        nodes: Sequence[str] | None,
        on_change: str,
    ) -> dict[str, Any] | None:
        """``DistributedCachedDataset.load_state_dict``: point the sampler and
        the session at the rest of the saved epoch; returns what a resume
        across a source change crossed (``None`` when it crossed none)."""
        check_on_change(on_change)
        self.sampler.wait_whole()  # a state is of the whole listing
        # The world first: resolving it may renew the session (a dataset
        # built before the process group), and the count must reach the
        # session that reads next, not the one it replaced.
        self.sampler.rank  # noqa: B018
        session = self.session
        explain = partial(
            self.generations.explain, session.client, current=session.manifest
        )
        digest = self.generations.digest
        consumed = apply_state(
            self.sampler,
            state,
            digest,
            nodes,
            explain=explain,
            on_change=on_change,
            layout=layout_digest(self.sampler.sizes),
            dataset=self.spec.name,
        )
        session.consumed = session.cursor = consumed
        session.resumed_batch = (self.sampler.epoch, saved_batch(state))
        return crossed_listing(state, digest, explain, self.spec.name)

    def warm(self, steps: int, batch_size: int, *, progress: bool) -> dict[str, int]:
        """``DistributedCachedDataset.warm``: the next ``steps`` batches' chunks."""
        start = self.session.cursor or self.sampler.pending_skip
        order = self.sampler.order()
        return self.here().warm(order, start, steps, batch_size, progress=progress)

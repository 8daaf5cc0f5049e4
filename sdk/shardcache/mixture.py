"""MixedDataset: several datasets read as one, by weight, resumable exactly
at any world size.

Pretraining reads several sources with weights (say 70% web, 20% code, 10%
books) and its jobs are preempted and rescaled. Here the epoch is one
global sequence, a pure function of (component sizes, weights, seed, epoch)
(:mod:`shardcache.mix_order`); ranks deal it in runs of ``batch_size``
(:mod:`shardcache.mix_progress`), so every rank has the same step count and
each rank batch is one window of the sequence, holding each component's
weight within :func:`~shardcache.mix_order.window_tolerance` samples. A
state is where that sequence stands, so a job saved at 4 ranks resumes at
2, 3 or 6 (with or without DataLoader workers) and delivers every remaining
draw once.

What it uses of each component (a :class:`~shardcache.DistributedCachedDataset`
or anything with the same members): ``len()``, ``collated(indices,
pin_memory)``, ``set_epoch(epoch)``, ``state_dict()["manifest"]`` (the
listing a state was saved on) and ``stats()``; ``name`` when present.
The components' own samplers are not used: their stable per-rank shards
give way to the mixture's deal, so a rank reads from every chunk of every
component over an epoch (through its node's store and peers).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from shardcache.batches import read_elsewhere
from shardcache.errors import CollateError, ConfigError
from shardcache.loader import BatchLoader
from shardcache.mix_order import ON_EXHAUSTED
from shardcache.mix_sampler import MixtureSampler, Weights, merge_mix_states
from shardcache.resume import gather_outcomes
from shardcache.resume.state import check_consumed

__all__ = ["ON_EXHAUSTED", "MixedDataset"]


def _component_names(datasets: Sequence[Any], names: Sequence[str] | None) -> list[str]:
    found = (
        [str(n) for n in names]
        if names is not None
        else [str(getattr(d, "name", f"component{i}")) for i, d in enumerate(datasets)]
    )
    if len(found) != len(datasets) or len(set(found)) != len(found):
        raise ConfigError(
            f"components need distinct names, one each, got {found!r}; pass "
            "names=[...] to MixedDataset."
        )
    return found


class MixedDataset(Dataset[Any]):
    """Several datasets as one weighted mixture (``len`` is their total).

    Args:
        datasets: the components (sources and formats may differ; their
            samples must collate together).
        weights: one per component, normalised (``[7, 2, 1]`` is 70/20/10);
            0 leaves a component out. Or ``epoch -> weights``, a curriculum:
            each epoch's weights are recorded in its state.
        batch_size: samples per rank batch; each rank batch is then one
            window of the sequence. ``loader()`` uses it. Defaults to ``1``
            (the global batch across ranks holds the weights; one rank's
            batch need not).
        names: per component, for stats and messages. Defaults to each
            component's ``name``.
        seed, shuffle: each component is walked in a seeded permutation per
            pass (``shuffle=False``: in index order). Default to ``0``, ``True``.
        on_exhausted: ``"cycle"`` (the epoch lasts until every component
            has read each of its samples once; the others start new passes
            meanwhile) or ``"end_epoch"`` (it ends before the first repeat).
            Defaults to ``"cycle"``.
        epoch_samples: a fixed epoch length instead (``"end_epoch"``: at most
            this). Defaults to ``None``.
        rank, world_size: default from torch.distributed, else RANK/WORLD_SIZE.

    Raises:
        ConfigError: no components, a component with no samples (named),
            negative, NaN or all-zero weights, names that repeat.

    >>> # mix = MixedDataset([web, code, books], weights=[0.7, 0.2, 0.1], batch_size=32)
    >>> # for epoch in range(3):
    >>> #     mix.set_epoch(epoch)
    >>> #     for x in mix.loader(): ...
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Weights,
        *,
        batch_size: int | None = None,
        names: Sequence[str] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        on_exhausted: str = "cycle",
        epoch_samples: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        self.datasets = list(datasets)
        if not self.datasets:
            raise ConfigError("MixedDataset needs at least one dataset, got none.")
        if batch_size is not None and (
            not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ConfigError(
                f"batch_size must be an integer >= 1 or None, got {batch_size!r}."
            )
        self.names = _component_names(self.datasets, names)
        self.batch_size = batch_size
        self._sampler = MixtureSampler(
            [len(d) for d in self.datasets],
            self.names,
            weights,
            seed=seed,
            shuffle=shuffle,
            on_exhausted=on_exhausted,
            epoch_samples=epoch_samples,
            block=batch_size or 1,
            rank=rank,
            world_size=world_size,
        )
        self._sampler.bind(self._start_epoch)
        self._epoch_started: int | None = None
        self._consumed = 0
        self._epoch_batch = 0  # this epoch's largest read in this process
        self._delivered = np.zeros(len(self.datasets), dtype=np.int64)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A DataLoader worker's copy: the sampler dropped its hook in transit.
        self.__dict__.update(state)
        self._sampler.bind(self._start_epoch)

    # -- Dataset protocol -----------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._sampler.offsets[-1])

    @property
    def sampler(self) -> MixtureSampler:
        """Use as ``DataLoader(mix, sampler=mix.sampler)`` or, with equal step
        counts on every rank, ``batch_sampler=mix.sampler.batches()``."""
        return self._sampler

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` here and in every component (``mix.sampler.set_epoch``
        does the same)."""
        self._sampler.set_epoch(epoch)  # calls _start_epoch back

    def _start_epoch(self, epoch: int, resuming: bool) -> None:
        if epoch != self._epoch_started:
            self._epoch_started = epoch
            for d in self.datasets:
                d.set_epoch(epoch)
        if not resuming:
            self._consumed = 0
            self._delivered[:] = 0
        self._epoch_batch = 0

    def component_of(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The component (its position in ``datasets``) of each mixture id:
        e.g. a loss per source."""
        return self._sampler.component_of(np.asarray(ids, dtype=np.int64))

    def collated(self, ids: Sequence[int], pin_memory: bool = False) -> Any:
        """One collated batch of mixture ``ids``, in their order: each
        component gathers its samples in one call, then one copy places
        them.

        Raises:
            CollateError: the components' samples differ in shape or type.
        """
        ids = np.asarray(ids, dtype=np.int64)
        comp = self.component_of(ids)
        local = ids - self._sampler.offsets[comp]
        present = np.unique(comp).tolist()
        parts = []
        for k in present:
            sel = np.flatnonzero(comp == k)
            parts.append((k, sel, self.datasets[k].collated(local[sel], pin_memory)))
        self._consumed += len(ids)
        self._epoch_batch = max(self._epoch_batch, len(ids))
        self._delivered += np.bincount(comp, minlength=len(self.datasets))
        if len(parts) == 1:
            return parts[0][2]
        return self._place(parts, len(ids), pin_memory)

    def _place(
        self, parts: list[tuple[int, np.ndarray, Any]], n: int, pin: bool
    ) -> Any:
        first = parts[0][2]
        if isinstance(first, torch.Tensor):
            shapes = {self.names[k]: (tuple(b.shape[1:]), b.dtype) for k, _, b in parts}
            if len(set(shapes.values())) > 1:
                raise CollateError(
                    f"the components' samples differ in shape or dtype ({shapes}), "
                    "so a mixed batch cannot be one tensor; make their preprocess "
                    "or transform give one shape."
                )
            out = torch.empty((n, *first.shape[1:]), dtype=first.dtype, pin_memory=pin)
            for _, sel, b in parts:
                out[torch.from_numpy(sel)] = b
            return out
        if isinstance(first, dict):
            return {
                key: self._place([(k, s, b[key]) for k, s, b in parts], n, pin)
                for key in first
            }
        if isinstance(first, tuple | list):
            return type(first)(
                self._place([(k, s, b[i]) for k, s, b in parts], n, pin)
                for i in range(len(first))
            )
        raise CollateError(
            f"component batches of type {type(first).__name__} cannot be mixed; "
            "components must give tensors, or dicts or tuples of them."
        )

    def __getitems__(self, ids: Sequence[int]) -> list[Any]:
        """A DataLoader's batch as samples (views of one collated batch)."""
        batch = self.collated(ids)
        return [_row(batch, i) for i in range(len(ids))]

    def __getitem__(self, idx: int) -> Any:
        return self.__getitems__([idx])[0]

    def epoch_indices(self) -> Iterator[np.ndarray]:
        """The rest of this epoch's ids (after a resume), for ``loader()``."""
        order = self._sampler.order()
        yield order[self._sampler.take_skip() :]

    def loader(
        self,
        batch_size: int | None = None,
        *,
        drop_last: bool = False,
        pin_memory: bool = False,
        device: str | torch.device | None = None,
    ) -> BatchLoader:
        """This rank's batches of the current epoch, collated (default: the
        mixture's ``batch_size``), every rank the same step count."""
        return BatchLoader(
            self,  # type: ignore[arg-type]  # the batch source protocol it reads
            batch_size or self._sampler.block,
            drop_last=drop_last,
            pin_memory=pin_memory,
            device=device,
        )

    # -- state ---------------------------------------------------------------------------
    def _listings(self) -> list[Any]:
        return [d.state_dict().get("manifest") for d in self.datasets]

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is: the epoch, its weights, the progress it started
        from and the samples it consumed (``consumed`` overrides the count,
        e.g. ``batches * batch_size`` with DataLoader workers), plus every
        component's listing.

        Raises:
            ConfigError: no ``consumed`` where DataLoader workers read this
                epoch's draws (the count here would replay what they read), or
                a ``consumed`` that is not an integer >= 0.
        """
        if consumed is None:
            self._check_reads_are_here()
        else:
            # Only its type and sign: after a resume at another world size
            # the sampler's order starts where the saved progress ended.
            check_consumed(consumed, None, self._sampler.rank)
        return {
            **self._sampler.state(),
            "consumed": self._consumed if consumed is None else int(consumed),
            "listings": self._listings(),
        }

    def _check_reads_are_here(self) -> None:
        handed_out = read_elsewhere(self._sampler, self._consumed, self._epoch_batch)
        if handed_out is not None:
            raise ConfigError(
                f"state_dict(): this process's sampler handed out {handed_out} "
                f"draws of epoch {self._sampler.epoch} and this process read "
                f"{self._consumed} of them: DataLoader workers read the rest, "
                "ahead of your loop, so the draws your loop consumed are not "
                "known here. Pass them: mix.state_dict(consumed=N) or "
                "mix.gather_state_dict(consumed=N), N this rank's draws taken "
                "this epoch counted from the epoch's start, or read with "
                "mix.loader()."
            )

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Every rank's :meth:`state_dict` -> one state that resumes at any world size."""
        return merge_mix_states(states)

    def gather_state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Every rank's state, merged, on every rank (one ``all_gather_object``):
        save it from rank 0, load it at any world size."""
        return merge_mix_states(gather_outcomes(lambda: self.state_dict(consumed)))

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Resume: the next iteration yields exactly the draws not yet delivered.

        ``state`` is this rank's own state (same world and batch size), every
        rank's (a list) or their merge (:meth:`gather_state_dict`): then at
        any world size and with any number of DataLoader workers.

        Raises:
            ConfigError: another mixture's state, other settings, or a
                component listed anew since (named).
        """
        if not isinstance(state, dict):
            state = merge_mix_states(state)
        saved = state.get("listings")
        if saved is not None:
            for name, then, now in zip(
                self.names, saved, self._listings(), strict=True
            ):
                if then != now:
                    raise ConfigError(
                        f"component {name!r} was listed anew since this state was "
                        "saved (its objects changed), so the saved positions would "
                        "read other samples. Start the epoch over (skip "
                        "load_state_dict), or restore those objects and resume."
                    )
        self._consumed = self._sampler.apply(state)
        self._delivered[:] = 0
        self._start_epoch(self._sampler.epoch, resuming=True)

    def stats(self) -> dict[str, Any]:
        """The epoch's weights and what this process delivered of each
        component, with each component's own stats (its cache hits, waits,
        the cluster's totals)."""
        return {
            "epoch": self._sampler.epoch,
            "weights": dict(
                zip(self.names, self._sampler.weights.tolist(), strict=True)
            ),
            "delivered": dict(zip(self.names, self._delivered.tolist(), strict=True)),
            "components": {
                n: d.stats() for n, d in zip(self.names, self.datasets, strict=True)
            },
        }


def _row(batch: Any, i: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[i]
    if isinstance(batch, dict):
        return {k: _row(v, i) for k, v in batch.items()}
    return type(batch)(_row(v, i) for v in batch)

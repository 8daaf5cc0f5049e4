"""Collated batches of one rank's epoch, optionally pinned and copied to a GPU ahead.

``BatchLoader`` is what ``DistributedCachedDataset.loader()`` returns: it
reads through the :class:`BatchSource` protocol (so this module never
imports the dataset; the dataset imports it) and walks the sampler's order in batches (every rank the same number of
steps, even when an elastic resume left lengths one apart: see
:func:`~shardcache.sampler.batch_bounds`) and gathers each batch straight into
one tensor per field (no per-sample tensors, no second copy by a collate
function). With ``device`` set, the next batch is copied host-to-device on
a side CUDA stream while the current step runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shardcache.errors import ConfigError
from shardcache.sampler import batch_bounds

if TYPE_CHECKING:
    import numpy as np

    from shardcache.sampler import ShardSampler

__all__ = ["BatchLoader", "BatchSource"]


class BatchSource(Protocol):
    """What a loader reads batches from: the cut between iterating an epoch in
    batches (this module) and reading samples from the cache (the dataset).

    ``DistributedCachedDataset`` is the one implementation; a test or a bench
    may pass any object with these members.
    """

    @property
    def sampler(self) -> ShardSampler:
        """This rank's order: ``order()``, ``lengths()`` and ``len``."""
        ...

    def epoch_indices(self) -> Iterator[np.ndarray]:
        """The rest of this epoch's order (a resume skips what was consumed)."""
        ...

    def collated(self, indices: Sequence[int], pin_memory: bool = False) -> Any:
        """One batch of ``indices`` gathered into one tensor per field."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is, counting every sample handed out."""
        ...

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resume after the consumed samples."""
        ...


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return tuple(_to_device(v, device) for v in batch)


def _used_on(batch: Any, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator the batch is read on ``stream``: it was
    allocated on the copy stream, and without this the allocator may hand
    its memory to the next copy as soon as the caller drops it, while the
    step's kernels queued on ``stream`` still read it."""
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
        return
    for value in batch.values() if isinstance(batch, dict) else batch:
        _used_on(value, stream)


class BatchLoader:
    """Iterates this rank's batches for the dataset's current epoch.

    Args:
        dataset: what to read (a :class:`BatchSource`: the dataset; its
            sampler gives the order, resume included).
        batch_size: samples per batch.
        drop_last: drop a last, smaller batch. Defaults to ``False``.
        pin_memory: gather into page-locked memory (needs CUDA). Defaults to ``False``.
        device: a CUDA device to copy each batch to, one batch ahead on a
            side stream (implies ``pin_memory``). Defaults to ``None``.

    Raises:
        ConfigError: ``batch_size`` < 1, or pinning / a CUDA device asked for
            on a machine without CUDA.
    """

    def __init__(
        self,
        dataset: BatchSource,
        batch_size: int,
        *,
        drop_last: bool = False,
        pin_memory: bool = False,
        device: str | torch.device | None = None,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(
                f"batch_size must be an integer >= 1, got {batch_size!r}."
            )
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type != "cuda":
            raise ConfigError(
                f"device must be a CUDA device (e.g. 'cuda:0'), got {str(self.device)!r}; "
                "batches are already on the CPU without it."
            )
        if (pin_memory or self.device is not None) and not torch.cuda.is_available():
            raise ConfigError(
                "pin_memory=True and device= need CUDA, and this machine has none "
                "(torch.cuda.is_available() is False). Leave them unset on a CPU host."
            )
        self.dataset = dataset
        self.batch_size, self.drop_last = batch_size, drop_last
        self.pin_memory = pin_memory or self.device is not None
        self._in_flight = 0  # samples gathered ahead of the batch last yielded

    def __len__(self) -> int:
        sampler = self.dataset.sampler
        return len(
            batch_bounds(
                len(sampler), min(sampler.lengths()), self.batch_size, self.drop_last
            )
        )

    def _host_batches(self) -> Iterator[Any]:
        sampler = self.dataset.sampler
        for order in self.dataset.epoch_indices():
            # Ranks resume in lockstep, so every rank skipped the same count.
            skipped = len(sampler.order()) - len(order)
            shortest = max(min(sampler.lengths()) - skipped, 0)
            for lo, hi in batch_bounds(
                len(order), shortest, self.batch_size, self.drop_last
            ):
                yield hi - lo, self.dataset.collated(order[lo:hi], self.pin_memory)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's state: the samples of the batches this loader yielded
        (a batch copied ahead to the GPU but not yet yielded does not count)."""
        state = self.dataset.state_dict()
        state["consumed"] -= self._in_flight
        return state

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resume: the next iteration continues after the consumed samples (see
        :meth:`DistributedCachedDataset.load_state_dict`; any batch size)."""
        self.dataset.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        self._in_flight = 0
        if self.device is None:
            for _, host in self._host_batches():
                yield host
            return
        # Copy batch k+1 on a side stream while the caller computes on batch k.
        stream = torch.cuda.Stream(device=self.device)
        ahead = None
        for n, host in self._host_batches():
            with torch.cuda.stream(stream):
                copied = _to_device(host, self.device)
            if ahead is not None:
                self._in_flight = n
                yield ahead
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(stream)
            _used_on(copied, main)
            ahead = copied
            self._in_flight = n
        if ahead is not None:
            self._in_flight = 0
            yield ahead

"""Generations: which cache generation and which listing a dataset's batches read (register, invalidate, refresh).

A generation numbers one cache of a dataset: a new preprocess fingerprint or
an ``invalidate()`` starts the next, and a batch never mixes two. The
listing (its digest) is the version of the source the rank reads; a
``refresh()`` moves it to a newer one when only ETags changed. Both numbers
travel to DataLoader workers; whether a process's snapshot of the
generation is due again is its own (``renew``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardcache.changes import describe_changes
from shardcache.errors import (
    ConfigError,
    RemoteFetchError,
    SourceNotFound,
    StaleVersionError,
)
from shardcache.fingerprint import log_new_generation
from shardcache.listing_feed import extends
from shardcache.manifest import Manifest
from shardcache.packed_manifest import PackedManifest

if TYPE_CHECKING:
    from shardcache.index import RedisIndex
    from shardcache.job import JobId
    from shardcache.spec import DatasetSpec

__all__ = ["Generations", "Refreshed", "layout_digest", "open_listing"]


def layout_digest(sizes: np.ndarray) -> str:
    """Where every sample sits: a digest of the chunk sizes, saved with a
    state so a resume on a new listing knows whether positions still mean
    the same samples (a re-listing of the same objects keeps the chunks).

    >>> layout_digest(np.array([3, 2])) == layout_digest([3, 2])
    True
    >>> layout_digest([3, 2]) == layout_digest([2, 3])
    False
    """
    raw = np.ascontiguousarray(np.asarray(sizes, dtype=np.int64)).tobytes()
    return hashlib.sha1(raw).hexdigest()[:16]


def open_listing(
    client: Any, spec: DatasetSpec, job: str, *, early: bool = False
) -> tuple[Manifest, str]:
    """The listing a new dataset starts on (one per job, unless ``revalidate``
    says otherwise), mapped, and its digest. ``early``: a listing that runs
    long may answer with its first whole chunks (``Manifest.is_prefix``;
    :class:`~shardcache.listing_feed.ListingFeed` follows the rest).

    Raises:
        RemoteFetchError, ShardUnavailable: the source could not be listed
            (the message names ``revalidate='never'`` when it would help).
    """
    token = spec.open_token(job)
    try:
        ref, digest = client.manifest(spec.listing(), token, early=early)
    except RemoteFetchError as exc:
        if not token.startswith("open/"):
            raise
        # Same type, so callers' handlers still match; the message adds the
        # opt-out a job with an immutable (or huge) source may want. Only
        # where the source failed: a cluster that cannot start is not helped.
        if isinstance(exc, SourceNotFound):
            # Most often a typo: the opt-out matters only for a source removed
            # on purpose whose cache the cluster still holds.
            hint = (
                f"if {spec.summary!r} was removed on purpose and the cluster still "
                "holds its cache, revalidate='never' reads that cache"
            )
        else:
            hint = (
                f"a new job revalidates the listing of {spec.summary!r}; if the "
                "cluster already holds it, revalidate='never' starts on it"
            )
        raise type(exc)(f"{exc} ({hint})") from exc
    return client.map_manifest(ref), digest


@dataclass(frozen=True)
class Refreshed:
    """What a refresh found: the new listing, the objects (URLs) whose ETag
    changed and the chunks built from them (stale wherever they are held)."""

    manifest: Manifest
    digest: str
    changed: list[str]
    stale_chunks: list[int]


class Generations:
    """Which generation and listing this dataset's batches read.

    Args:
        spec: the settled spec (name, consistency, fingerprint, source).
        digest: the listing the dataset was constructed on.
    """

    def __init__(self, spec: DatasetSpec, digest: str):
        self.spec, self.digest = spec, digest
        self.generation = 0
        self.refreshes = 0  # this dataset's refresh rounds (their listing token)
        self.invalidations = 0  # this process's ds.invalidate() calls
        self._epoch_calls: tuple[int, int] = (-1, 0)  # (epoch, calls made in it)
        self.due = True  # take a snapshot before the next batch

    def renew(self) -> None:
        """Take a new snapshot before the next batch (a new process or epoch,
        or the stores no longer hold the generation of the last one)."""
        self.due = True

    def register(self, index: RedisIndex, manifest: Manifest) -> int:
        """Create the dataset in the index, or start a new generation when the
        fingerprint changed (logged once, by the rank that started it)."""
        spec = self.spec
        generation, previous = index.register_change(
            spec.name,
            spec.source,
            spec.fingerprint,
            len(manifest),
            manifest.total_bytes,
        )
        if previous is not None:
            log_new_generation(
                spec.name,
                previous,
                spec.fingerprint,
                generation,
                manifest,
                {"preprocess": spec.preprocess, "target": spec.target},
            )
        self.generation = generation
        return generation

    def read(self, index: RedisIndex, manifest: Manifest | None) -> int:
        """The generation the next batch reads: the snapshot while it holds
        (``consistency="epoch"``), else the index's (registering the dataset
        again, with ``manifest``, if the index lost it).

        Raises:
            IndexUnavailable: Redis cannot be reached; the caller keeps
                ``self.generation``.
        """
        if self.spec.consistency == "epoch" and not self.due:
            return self.generation
        self.due = False
        generation = index.generation(self.spec.name)
        if generation <= 0:
            assert manifest is not None, "a process maps the listing before it reads"
            return self.register(index, manifest)
        self.generation = generation
        return generation

    def invalidate(self, index: RedisIndex, job: JobId, epoch: int) -> int:
        """Start a new generation now, once for the ranks of ``job`` making
        the same call (the n-th of ``epoch``); the next batch reads it.

        Only an id made for this launch names the call: a name the user
        gives every run alike would hand a later run an earlier run's
        generation instead of a new one. A worker group restarted by
        torchrun keeps the id, so the restart count is in the name too, and
        a call counts only once it succeeded (ranks stay in step).
        """
        done_epoch, done = self._epoch_calls
        n = done + 1 if done_epoch == epoch else 1
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        call = f"{job.id}/{restart}/{epoch}/{n}" if job.one_launch else ""
        self.generation = index.invalidate(
            self.spec.name, call=call, reading=self.generation
        )
        self._epoch_calls = (epoch, n)
        self.invalidations += 1
        self.due = True
        return self.generation

    def refresh(self, client: Any, old: Manifest, job: str) -> Refreshed:
        """Re-list the source (one listing for the ranks of ``job`` refreshing
        together) and move to it.

        Raises:
            ConfigError: objects were added or removed (the shards would move).
        """
        self.refreshes += 1
        token = f"{job}/{self.refreshes}/{self.digest}"
        ref, digest = client.manifest(self.spec.listing(), token)
        return self._move(client.map_manifest(ref), digest, old)

    def follow(self, client: Any, old: Manifest, digest: str) -> Refreshed:
        """Move to the listing ``digest`` the rank's process refreshed to
        (a DataLoader worker, told through the epoch board)."""
        new = client.map_manifest(client.manifest_of(self.spec.name, digest))
        return self._move(new, digest, old)

    def _move(self, new: Any, digest: str, old: Manifest) -> Refreshed:
        if isinstance(new, PackedManifest):
            changed, stale = _packed_changes(old, new, self.spec.summary)
        else:
            changed, stale = _object_changes(old, new, self.spec.summary)
        self.digest = digest
        return Refreshed(new, digest, changed, stale)

    def explain(self, client: Any, saved: str, current: Manifest) -> str:
        """What changed since listing ``saved`` (a resume across jobs after
        objects changed): the objects by name, not a digest."""
        try:
            old = client.map_manifest(client.manifest_of(self.spec.name, saved))
        except StaleVersionError:
            return "the listing it was saved on is no longer held by the cluster"
        return f"{self.spec.summary}: {describe_changes(old, current)}"


def _object_changes(
    old: Manifest, new: Manifest, source: str
) -> tuple[list[str], list[int]]:
    """One object per sample: the same names, some ETags changed; or the
    listing grew (a DataLoader worker follows its rank to a longer prefix)."""
    if old.is_prefix and extends(new, old):
        return [], []
    if not (
        np.array_equal(old.columns["name_offsets"], new.columns["name_offsets"])
        and np.array_equal(old.columns["names"], new.columns["names"])
    ):
        raise ConfigError(
            f"the set of objects under {source!r} changed ({len(old)} -> "
            f"{len(new)}); build a new DistributedCachedDataset so every rank "
            "agrees on the shards."
        )
    changed = np.flatnonzero(old.hashes != new.hashes)
    stale = np.unique(old.layout.chunk_of(changed))
    return [new.url(int(i)) for i in changed], stale.tolist()


def _packed_changes(
    old: Any, new: PackedManifest, source: str
) -> tuple[list[str], list[int]]:
    """Packed files: the samples in the same places, some files changed."""
    if not np.array_equal(old.layout.starts, new.layout.starts):
        raise ConfigError(
            f"the samples under {source!r} changed in number or place "
            f"({len(old)} -> {len(new)}); build a new "
            "DistributedCachedDataset so every rank agrees on the shards."
        )
    stale = np.flatnonzero(
        old.chunk_versions(old.layout) != new.chunk_versions(new.layout)
    )
    return new.changed_files(old), stale.tolist()

"""A listing the stores are still listing, followed by the process that reads it.

A dataset whose listing runs long starts on its first whole chunks (a
prefix the listing published, ``Manifest.is_prefix``) instead of waiting
for the whole (``services/.../list_stream.py``). This room asks the stores
for more: the longest prefix published so far while the listing runs, then
the finished listing for the same token. Whatever it moves to must extend
what was read: the same objects and chunks in front and the same prefix
ends (every rank cuts the first epoch's segments from them); a listing
that failed and was listed again differently is an error, never a silent
change of what the epoch reads.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from shardcache.errors import BackendError, StaleVersionError
from shardcache.manifest import Manifest

__all__ = ["POLL_S", "ListingFeed"]

POLL_S = 0.2  # between two asks while a rank waits for more of the listing
WAIT_S = 3600.0  # the longest wait for one more prefix (a listing's pages are slow)


def extends(new: Manifest, old: Manifest) -> bool:
    """``new`` lists ``old``'s objects first, in the same chunks and prefix ends.

    >>> a = Manifest.from_entries("s3", ["s3://b/1", "s3://b/2"], [1, 1], ["e", "e"])
    >>> extends(a, a.head(1)), extends(a.head(1), a)
    (True, False)
    """
    return not _differs(new, old)


def _differs(new: Manifest, old: Manifest) -> str:
    """What keeps ``new`` from extending ``old`` (``""``: nothing)."""
    n = len(old)
    if len(new) < n:
        return f"it lists {len(new)} objects, fewer than the {n} read"
    if not (
        np.array_equal(
            new.columns["name_offsets"][: n + 1], old.columns["name_offsets"]
        )
        and np.array_equal(new.hashes[:n], old.hashes)
        and np.array_equal(new.sizes[:n], old.sizes)
    ):
        return f"its first {n} objects are not the ones read"
    mine = old.columns.get("chunk_starts")
    theirs = new.columns.get("chunk_starts")
    if mine is not None and theirs is not None:
        if not np.array_equal(np.asarray(theirs)[: len(mine)], mine):
            return "its chunks are cut differently"
    ends, their_ends = old.prefix_ends, new.prefix_ends
    if not np.array_equal(their_ends[: len(ends)], ends):
        return f"its first epoch's segments end at {their_ends.tolist()}, not {ends.tolist()}"
    return ""


class ListingFeed:
    """The listing a dataset reads while the stores finish it.

    Args:
        client: the process's cache client (``leading``, ``manifest``).
        spec: the dataset's spec. token: the listing token it was opened with.
        manifest, digest: the prefix it started on.
    """

    def __init__(
        self, client: Any, spec: Any, token: str, manifest: Manifest, digest: str
    ):
        self.client, self.spec, self.token = client, spec, token
        self.manifest, self.digest = manifest, digest

    @property
    def complete(self) -> bool:
        return not self.manifest.is_prefix

    def poll(self) -> bool:
        """Ask the stores once; ``True`` when the listing grew (or ended).

        Raises:
            StaleVersionError: the listing was made again and no longer
                extends what this dataset read (its first attempt failed).
        """
        if self.complete:
            return False
        # Asked by the prefix in hand: what follows it in its own listing,
        # whatever other listings of the dataset run or ended since.
        got = self.client.leading(self.spec.name, self.digest)
        if got is not None and got[2] == "failed":
            raise StaleVersionError(
                f"the listing of {self.spec.summary!r} this job started reading "
                "before it ended failed (the source answered errors); build the "
                "dataset again to list it again."
            )
        if got is not None:
            ref, digest, _ = got
            if digest == self.digest:
                return False
            manifest = self.client.map_manifest(ref)
            if manifest.is_prefix and len(manifest) <= len(self.manifest):
                return False
        else:  # no store knows the prefix (restarted): the token's listing
            ref, digest = self.client.manifest(self.spec.listing(), self.token)
            manifest = self.client.map_manifest(ref)
        differs = _differs(manifest, self.manifest)
        if differs:
            raise StaleVersionError(
                f"the listing of {self.spec.summary!r} this job started reading "
                f"before it ended was listed again and differs ({differs}): its "
                "first attempt failed, or the objects changed. Build the dataset "
                "again."
            )
        self.manifest, self.digest = manifest, digest
        return True

    def wait(self, timeout_s: float = WAIT_S) -> bool:
        """Return (``True``) once the listing grew (or ended).

        Raises:
            BackendError: it did not grow within ``timeout_s``.
            StaleVersionError: see :meth:`poll`.
        """
        deadline = time.monotonic() + timeout_s
        while not self.complete and not self.poll():
            if time.monotonic() > deadline:
                raise BackendError(
                    f"the listing of {self.spec.summary!r} did not grow for "
                    f"{timeout_s:.0f} s; the store listing it may be stuck."
                )
            time.sleep(POLL_S)
        return True

"""The leading part of a listing, published while the rest is still listed.

A listing of millions of objects takes minutes (10 M keys at S3's 1,000 per
page are 10,000 requests, and each key's parse costs CPU), and nothing could
be read before it ended. Every part of a listing (``objects._Parts``' slots)
is filled in key order, and the parts are joined in key order, so the
complete parts in front plus the first incomplete part's objects so far are
exactly the first ``n`` objects of the finished listing: a *prefix* of it.

This room decides when a prefix is worth publishing and copies it without
emptying the writers the listing still appends to. The first prefix goes
out once the listing has run for ``after_s`` (a listing shorter than that
publishes only its whole, as before), each later one once the prefix has
doubled, so the copies add up to at most about twice the listing (one
``Manifest`` of ~105 B per object each) however long it runs.

Only the thread that appends to the writers may copy them (an
``array.array`` whose buffer is exported cannot grow), so the check runs as
a coroutine on the listing's own event loop (:meth:`LeadingPrefix.watch`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from shardcache.manifest import Manifest, ManifestWriter

__all__ = ["STREAM_AFTER_S", "LeadingPrefix", "OnPrefix"]

log = logging.getLogger(__name__)

STREAM_AFTER_S = 2.0  # a listing shorter than this publishes only its whole
_TICK_S = 0.25  # how often a running listing looks at its prefix

OnPrefix = Callable[[Manifest], None]  # receives each prefix, in growing order


class LeadingPrefix:
    """Publishes growing prefixes of one listing.

    Args:
        protocol: the listing's protocol (``s3``), carried by each prefix.
        on_prefix: called with each prefix (its writers untouched).
        after_s: the listing's age before its first prefix. Defaults to
            :data:`STREAM_AFTER_S`.

    >>> from shardcache.manifest import ManifestWriter
    >>> got = []
    >>> lead = LeadingPrefix("s3", lambda m: got.append(len(m)), after_s=0.0)
    >>> w = ManifestWriter(); w.add("s3://b/a", 1, "e")
    >>> lead.offer([w], [True]); lead.offer([w], [False]); len(w), got
    (1, [1])
    """

    def __init__(
        self,
        protocol: str,
        on_prefix: OnPrefix,
        after_s: float = STREAM_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.protocol, self._on_prefix = protocol, on_prefix
        self._clock = clock
        self._due_at = clock() + after_s
        self.published = 0  # objects in the last prefix handed out

    def offer(self, slots: Sequence[ManifestWriter], done: Sequence[bool]) -> None:
        """Publish the leading prefix of ``slots`` if it is due: the slots up to
        and including the first one not ``done`` (its objects so far)."""
        if self._clock() < self._due_at:
            return
        lead: list[ManifestWriter] = []
        for slot, finished in zip(slots, done, strict=False):
            lead.append(slot)
            if not finished:
                break
        n = sum(len(w) for w in lead)
        if n == 0 or n < 2 * self.published:
            return
        self.published = n
        self._on_prefix(Manifest.concat(self.protocol, lead, clear=False))

    async def watch(self, parts: Any) -> None:
        """Offer ``parts``' prefix every tick until cancelled (on the loop
        that fills them). ``parts``: ``slots`` and ``done`` (slot indices)."""
        while True:
            await asyncio.sleep(_TICK_S)
            slots = parts.slots
            try:
                self.offer(slots, [i in parts.done for i in range(len(slots))])
            except Exception:  # the listing goes on; only its prefixes stop
                log.exception("listing: publishing a prefix failed; none follow")
                return

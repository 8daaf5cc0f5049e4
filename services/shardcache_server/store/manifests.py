"""Which listing each dataset reads, listed once per cluster.

Ownership rule: the store that holds a dataset's manifest claim in Redis
lists the source (again for each refresh token); every other store adopts
that listing from it. This room owns the listings this store holds, the
units' bytes its listings kept (spans), and which node listed each dataset.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from shardcache.errors import BackendError, StaleVersionError
from shardcache.manifest import Manifest
from shardcache.packed_manifest import PackedManifest
from shardcache_server.formats import FORMATS
from shardcache_server.listing import Lister, Listings
from shardcache_server.store.datasets import Dataset
from shardcache_server.store.records import IndexRecords

__all__ = ["Manifests"]


class Manifests:
    """This store's side of the published listings.

    Args:
        node_id: the Ray node this store serves.
        records: the index link (claims, records) and event log.
        peer: returns the store handle of another node, or ``None`` if gone.
        get: maps a reference back to its value (or an awaitable of it).
        lister: lists a spec (see ``listing.Listings``).
        span_budget_bytes: the most bytes of units' spans held at once.
    """

    def __init__(
        self,
        node_id: str,
        records: IndexRecords,
        *,
        peer: Callable[[str], Any],
        get: Callable[[Any], Any],
        lister: Lister,
        span_budget_bytes: int,
    ):
        self.node_id = node_id
        self.me = records.me
        self._records = records
        self._peer = peer
        self.listings = Listings(get, lister, span_budget_bytes)
        # The node whose store listed each dataset: it holds the units'
        # bytes that listing kept (tar), which builds here ask it for.
        self._listed_on: dict[str, str] = {}

    async def published(
        self,
        name: str,
        spec: dict[str, Any],
        token: str,
        *,
        forwarded: bool,
        early: bool = False,
    ) -> list[Any]:
        """``[reference, digest]`` of the dataset's published manifest:
        listed here if this store holds (or wins) the claim, else the holder's.
        ``early``: a prefix of the listing may answer while it still runs
        (``Listings.publish_early``; the manifest says ``is_prefix``)."""
        index = self._records.index
        assert index is not None
        mine = self.listings.published(name, token)
        if mine is not None:
            return [mine[0], mine[1]]
        holder = ""
        if not forwarded:
            try:
                record = await asyncio.to_thread(index.manifest_record, name)
                holder = record.get("owner", "")
                if holder and holder != self.me:
                    found = await self._from(holder, spec, token, early)
                    if found is not None:
                        return found
                holder = await asyncio.to_thread(
                    index.claim_manifest, name, holder, self.me
                )
                if holder != self.me:  # another store won the race: it lists
                    found = await self._from(holder, spec, token, early)
                    if found is not None:
                        return found
                    await asyncio.to_thread(index.claim_manifest, name, holder, self.me)
            except BackendError:
                self._records.dirty = True  # Redis down: list here, at worst twice
                # Two stores listing apart would publish other prefix ends to
                # their ranks (other first-epoch segments): the whole only.
                early = False
        if not early:
            ref, digest, manifest = await self.listings.publish(spec, token)
            await self._publish(name, digest, manifest)
            return [ref, digest]
        ref, digest, manifest, rest = await self.listings.publish_early(spec, token)
        if rest is None:
            await self._publish(name, digest, manifest)
        else:  # recorded once the listing ends, as any listing is
            asyncio.ensure_future(self._publish_when_done(name, rest))
        return [ref, digest]

    async def _publish_when_done(self, name: str, listing: Any) -> None:
        try:
            _, digest, manifest = await listing
        except Exception:  # the listing's error reaches its next caller
            return
        await self._publish(name, digest, manifest)

    async def leading(self, name: str, digest: str) -> list[Any]:
        """``[reference, digest, state]``: what follows prefix ``digest`` of
        ``name`` (``Listings.leading``: the longest prefix of its listing so
        far, or the finished listing, or ``"failed"``), ``[]`` when no store
        knows it. Asked of the store that lists it, by the others in turn."""
        found = self.listings.leading(name, digest)
        if found is not None and found[2] != "listing" or self._lists(name):
            return [] if found is None else list(found)
        holder = self._listed_on.get(name)
        handle = self._peer(holder) if holder and holder != self.node_id else None
        if handle is None:
            return [] if found is None else list(found)
        try:
            got = await handle.leading.remote(name, digest)
        except Exception as exc:  # the holder died: its listing with it
            if type(exc).__module__.split(".")[0] != "ray":
                raise
            return [] if found is None else list(found)
        if got and got[2] != "failed":
            await self.listings.adopt(name, got[1], got[0])
        return list(got)

    def _lists(self, name: str) -> bool:
        """This store made ``name``'s listings (it holds the claim's work)."""
        holder = self._listed_on.get(name)
        return not holder or holder == self.node_id

    def held_ref(self, dataset: str, digest: str) -> list[Any]:
        """``[reference]`` of a manifest this store holds, or ``[]``."""
        found = self.listings.held(dataset, digest)
        return [] if found is None else [found[0]]

    def take_kept(self, dataset: str, version: str) -> list[Any]:
        """``[reference]`` of the bytes this store's listing kept for unit
        ``version`` (no longer held here), or ``[]``."""
        ref = self.listings.spans.take(dataset, version)
        return [] if ref is None else [ref]

    def forget_kept(self, dataset: str) -> None:
        """Drop the units' bytes kept for ``dataset`` (invalidated: read the source)."""
        self.listings.spans.drop(dataset)

    async def _from(
        self, holder: str, spec: dict[str, Any], token: str, early: bool = False
    ) -> list[Any] | None:
        handle = self._peer(holder.split("/", 1)[0])
        if handle is None:
            return None
        try:
            ref, digest = await handle.manifest.remote(
                spec, token, forwarded=True, early=early
            )
        except Exception as exc:  # the holder died: whoever asks next lists
            if type(exc).__module__.split(".")[0] != "ray":
                raise
            return None
        await self.listings.adopt(spec["name"], digest, ref)
        self._listed_on[spec["name"]] = holder.split("/", 1)[0]
        return [ref, digest]

    async def by_digest(
        self, dataset: str, digest: str, spec: dict[str, Any]
    ) -> Manifest:
        """The manifest ``digest`` of ``dataset``: held here, adopted from its
        holder, or listed again.

        Raises:
            StaleVersionError: nobody holds it and the source now lists another.
        """
        found = self.listings.held(dataset, digest)
        if found is not None:
            return found[1]
        index = self._records.index
        assert index is not None
        record = await asyncio.to_thread(index.manifest_record, dataset)
        holder = record.get("owner", "")
        handle = self._peer(holder.split("/", 1)[0]) if holder else None
        if handle is not None and holder != self.me:
            refs = await handle.manifest_of.remote(dataset, digest)
            if refs:
                self._listed_on[dataset] = holder.split("/", 1)[0]
                return await self.listings.adopt(dataset, digest, refs[0])
        # Nobody holds that listing any more (holder restarted): list again;
        # a different result means the caller must re-read it.
        ref, got, manifest = await self.listings.publish({**spec, "name": dataset})
        await self._publish(dataset, got, manifest)
        if got != digest:
            raise StaleVersionError(
                f"the listing of dataset {dataset!r} the rank read ({digest}) is gone "
                f"and the source now lists {got}. Call refresh() on every rank."
            )
        return manifest

    async def _publish(self, name: str, digest: str, manifest: Manifest) -> None:
        """Record the new listing and drop index entries of chunks that changed."""
        index = self._records.index
        assert index is not None
        self._listed_on[name] = self.node_id
        over = self.listings.over_budget.pop(name, None)
        if over is not None:
            self._records.event("spans_over_budget", name, **over)
        layout = manifest.layout
        try:
            await asyncio.to_thread(
                index.publish_manifest,
                name,
                self.me,
                digest=digest,
                objects=len(manifest),
                chunks=len(layout),
                listed_at=time.time(),
            )
            generation = await asyncio.to_thread(index.generation, name)
            if generation > 0:
                current = {
                    key: version
                    for key, version, _ in manifest.chunk_items(range(len(layout)))
                }
                await asyncio.to_thread(
                    index.invalidate_changed, name, generation, current
                )
        except BackendError:
            self._records.dirty = True

    def build_source(self, ds: Dataset) -> Any:
        """The manifest a build reads: the held reference, else the object."""
        held = self.listings.held(ds.name, ds.digest)
        return held[0] if held is not None else ds.manifest.to_object()

    async def kept_for_build(self, ds: Dataset, version: str) -> Any:
        """The unit's bytes the listing kept (a reference), or None: here if
        this store listed, else from the store that did (one call)."""
        manifest = ds.manifest
        if not isinstance(manifest, PackedManifest):
            return None
        fmt = FORMATS.get(manifest.format)
        if fmt is None or not fmt.keeps_spans:
            return None
        node = self._listed_on.get(ds.name, self.node_id)
        if node == self.node_id:
            return self.listings.spans.take(ds.name, version)
        handle = self._peer(node)
        if handle is None:
            return None
        try:
            found = await handle.take_span.remote(ds.name, version)
        except Exception as exc:  # the listing store is gone: read the source
            if type(exc).__module__.split(".")[0] != "ray":
                raise
            return None
        return found[0] if found else None

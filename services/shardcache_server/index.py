"""The index as stores use it: claims, ownership and the writes only stores make.

A rank reads and registers through :class:`shardcache.index.RedisIndex`;
a store also claims chunks, takes over a dead owner's, claims the right to
list a dataset, records entries and flushes counters. Those writes and the
Lua that makes them atomic live here, beside the one class that runs them,
so the SDK a rank imports carries none of them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from shardcache import keys
from shardcache.index import (
    EVENTS_KEPT,
    PATHS_PER_CALL,
    SERIES_BUCKET_S,
    SERIES_TTL_S,
    RedisIndex,
)

__all__ = ["ClusterIndex"]

# KEYS[1] owners hash; ARGV[1] claimant, ARGV[2..] paths. Returns each owner.
_CLAIM = """
local out = {}
for i = 2, #ARGV do
  redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[1])
  out[#out + 1] = redis.call('HGET', KEYS[1], ARGV[i])
end
return out
"""

# KEYS[1] owners hash; ARGV[1] expected owner, ARGV[2] new owner, ARGV[3..] paths.
# Returns the owner of each path afterwards.
_CAS = """
local out = {}
for i = 3, #ARGV do
  local cur = redis.call('HGET', KEYS[1], ARGV[i])
  if cur == ARGV[1] or cur == false then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[2])
    cur = ARGV[2]
  end
  out[#out + 1] = cur
end
return out
"""

# KEYS[1] owners hash, KEYS[2] entries hash; ARGV[1] owner, ARGV[2..] paths
_RELEASE = """
local n = 0
for i = 2, #ARGV do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
"""

# Drop entries whose recorded ETag differs from the listing's, atomically, so
# ranks refreshing at once cannot delete an entry another store just recorded
# for the new version. The owner's claim stays: that store still holds the old
# chunk, whose unchanged rows it copies into the rebuilt one, so the rebuild
# must happen there (a rank on another node forwards to it). Dropping the
# claim let the first asker anywhere rebuild the whole chunk from the source.
# KEYS[1] entries hash; ARGV: path1, etag1, path2, etag2, ...
# Returns the paths dropped.
_DROP_CHANGED = """
local changed = {}
for i = 1, #ARGV, 2 do
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  if raw then
    local ok, entry = pcall(cjson.decode, raw)
    if not ok or type(entry) ~= 'table' or tostring(entry['etag']) ~= ARGV[i + 1] then
      redis.call('HDEL', KEYS[1], ARGV[i])
      changed[#changed + 1] = ARGV[i]
    end
  end
end
return changed
"""


# KEYS[1] manifest hash; ARGV[1] expected owner ('' = none), ARGV[2] claimant.
# Returns the owner afterwards: the claimant when the expected owner still
# held it (or nobody did), else whoever won.
_CLAIM_MANIFEST = """
local cur = redis.call('HGET', KEYS[1], 'owner')
if cur == false or cur == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2])
  return ARGV[2]
end
return cur
"""


class ClusterIndex(RedisIndex):
    """A :class:`~shardcache.index.RedisIndex` with the stores' claims and writes.

    Ownership rule: a chunk's owner (``owners`` hash, ``"<node>/<incarnation>"``)
    is the one store that builds it and records its entry; every other store
    forwards to the owner, or takes over when the owner is dead.

    Args:
        client: a connected ``redis.Redis`` with ``decode_responses=True``.
        url: the URL it came from, used (redacted) in error messages.
        namespace: the deployment namespace. Defaults to ``"default"``.
    """

    def __init__(
        self, client: redis.Redis, url: str, namespace: str = keys.DEFAULT_NAMESPACE
    ):
        super().__init__(client, url, namespace)
        self._claim = client.register_script(_CLAIM)
        self._cas = client.register_script(_CAS)
        self._release = client.register_script(_RELEASE)
        self._drop_changed = client.register_script(_DROP_CHANGED)
        self._claim_manifest = client.register_script(_CLAIM_MANIFEST)

    # -- the published listing -------------------------------------------------
    def manifest_record(self, name: str) -> dict[str, str]:
        """Who holds the dataset's published manifest: owner, digest, refresh, ..."""
        with self.errors():
            return dict(self.client.hgetall(keys.manifest_key(self.ns, name)))

    def claim_manifest(self, name: str, expected: str, me: str) -> str:
        """Become the lister if ``expected`` (or nobody) holds it; returns the holder."""
        with self.errors():
            return str(
                self._claim_manifest(
                    keys=[keys.manifest_key(self.ns, name)], args=[expected, me]
                )
            )

    def publish_manifest(self, name: str, me: str, **fields: Any) -> None:
        """Record the listing ``me`` published (digest, refresh round, counts)."""
        with self.errors():
            self.client.hset(
                keys.manifest_key(self.ns, name),
                mapping={"owner": me, **{k: str(v) for k, v in fields.items()}},
            )

    # -- claims and ownership --------------------------------------------------
    def claim_owners(
        self, name: str, generation: int, paths: list[str], me: str
    ) -> list[str]:
        """Claim every unowned path for ``me``; return each path's owner."""
        with self.errors():
            return list(
                self._claim(
                    keys=[keys.owners_key(self.ns, name, generation)], args=[me, *paths]
                )
            )

    def take_over(
        self, name: str, generation: int, paths: Sequence[str], expected: str, me: str
    ) -> list[str]:
        """Move ownership of ``paths`` from a dead ``expected`` owner (or none) to
        ``me``, in one round trip per chunk; returns each path's owner after."""
        owners: list[str] = []
        with self.errors():
            for i in range(0, len(paths), PATHS_PER_CALL):
                owners += self._cas(
                    keys=[keys.owners_key(self.ns, name, generation)],
                    args=[expected, me, *paths[i : i + PATHS_PER_CALL]],
                )
        return [str(o) for o in owners]

    def release(self, name: str, generation: int, paths: list[str], me: str) -> int:
        """Forget entries and claims ``me`` holds (eviction, failed fetch)."""
        if not paths:
            return 0
        with self.errors():
            return int(
                self._release(
                    keys=[
                        keys.owners_key(self.ns, name, generation),
                        keys.entries_key(self.ns, name, generation),
                    ],
                    args=[me, *paths],
                )
            )

    def release_predecessors(self, node_id: str, me: str) -> int:
        """Forget every entry an earlier store on ``node_id`` held: it died with
        its cache, so the index must stop pointing at it. Compare-and-set per
        path, so an entry a live store re-claimed meanwhile stays. Returns how
        many entries were dropped."""
        dropped = 0
        for name in self.datasets():
            generation = self.generation(name)
            if generation <= 0:
                continue
            by_owner: dict[str, list[str]] = {}
            with self.errors():
                owners = self.client.hscan_iter(
                    keys.owners_key(self.ns, name, generation), count=1000
                )
                for path, owner in owners:
                    if owner.split("/", 1)[0] == node_id and owner != me:
                        by_owner.setdefault(owner, []).append(path)
            for owner, paths in by_owner.items():
                for i in range(0, len(paths), PATHS_PER_CALL):
                    dropped += self.release(
                        name, generation, paths[i : i + PATHS_PER_CALL], owner
                    )
        return dropped

    def owners(self, name: str, generation: int) -> dict[str, str]:
        with self.errors():
            return dict(self.client.hgetall(keys.owners_key(self.ns, name, generation)))

    # -- entries ---------------------------------------------------------------
    def record_entries(
        self, name: str, generation: int, entries: Mapping[str, dict[str, Any]]
    ) -> None:
        if not entries:
            return
        with self.errors():
            self.client.hset(
                keys.entries_key(self.ns, name, generation),
                mapping={p: json.dumps(e) for p, e in entries.items()},
            )

    def invalidate_changed(
        self, name: str, generation: int, current: Mapping[str, str]
    ) -> list[str]:
        """Drop entries whose recorded ETag differs from ``current`` (path -> etag).

        Claims stay with their owners (see ``_DROP_CHANGED``). Returns the
        paths dropped. Stores are told the new ETags, so a store
        evicts only values of the old version, never one it fetched after.
        """
        ekey = keys.entries_key(self.ns, name, generation)
        items = list(current.items())
        changed: list[str] = []
        with self.errors():
            for i in range(0, len(items), PATHS_PER_CALL):
                argv = [x for pair in items[i : i + PATHS_PER_CALL] for x in pair]
                changed += self._drop_changed(keys=[ekey], args=argv)
        if changed:
            pipe = self.client.pipeline(transaction=True)
            pipe.publish(
                keys.invalidation_channel(self.ns),
                json.dumps(
                    {
                        "dataset": name,
                        "generation": generation,
                        "paths": changed,
                        "etags": {p: current[p] for p in changed},
                    }
                ),
            )
            self._event(
                pipe,
                "changed",
                name,
                generation=generation,
                count=len(changed),
                example=changed[0],
            )
            with self.errors():
                pipe.execute()
        return changed

    # -- stats, heartbeats, events ---------------------------------------------
    def flush_stats(
        self,
        per_key: Mapping[tuple[str, int], Mapping[str, int]],
        node_id: str,
        now: float | None = None,
    ) -> None:
        """Add counters, keyed by ``(dataset, generation)``, in one round trip."""
        bucket = int((now or time.time()) // SERIES_BUCKET_S * SERIES_BUCKET_S)
        pipe = self.client.pipeline(transaction=False)
        for (ds, generation), counts in per_key.items():
            targets = (
                keys.stats_key(self.ns, ds),
                keys.stats_node_key(self.ns, ds, node_id),
                keys.stats_generation_key(self.ns, ds, generation),
                keys.stats_series_key(self.ns, ds, bucket),
            )
            for key in targets:
                for name, amount in counts.items():
                    if amount:
                        pipe.hincrby(key, name, amount)
            pipe.expire(keys.stats_series_key(self.ns, ds, bucket), SERIES_TTL_S)
        with self.errors():
            pipe.execute()

    def heartbeat(self, node_id: str, info: Mapping[str, Any]) -> None:
        with self.errors():
            self.client.hset(keys.stores_key(self.ns), node_id, json.dumps(dict(info)))

    def push_event(self, kind: str, dataset: str, **detail: Any) -> None:
        pipe = self.client.pipeline(transaction=False)
        self._event(pipe, kind, dataset, **detail)
        with self.errors():
            pipe.execute()

    def _event(self, pipe: Any, kind: str, dataset: str, **detail: Any) -> None:
        event = {"ts": time.time(), "kind": kind, "dataset": dataset, **detail}
        pipe.lpush(keys.events_key(self.ns), json.dumps(event))
        pipe.ltrim(keys.events_key(self.ns), 0, EVENTS_KEPT - 1)

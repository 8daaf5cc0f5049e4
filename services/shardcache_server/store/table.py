"""What this store holds in memory, by ``(dataset, chunk)``.

Ownership rule: the table alone adds and removes held chunks, keeps the
eviction policy's accounts in step with them, and knows each dataset's
current generation; a chunk of an older generation leaves the table for
``retired.py`` (kept a while for ranks mid-epoch) or is freed.

Augmented variants (``c<n>.v<k>``, ``store/variants.py``) share the budget
with a rule of their own: a variant is held only in free room (it never
evicts anything but an older copy of itself, so the variants that fit stay
and the rest are served in their base form, without churn), and a base
chunk that needs room takes it from the variants, oldest first, before the
policy evicts any base chunk.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.keys import is_variant_key
from shardcache_server.eviction import EvictionPolicy
from shardcache_server.store.retired import RetiredGenerations

__all__ = ["Cached", "HeldTable", "failed_rows"]

Key = tuple[str, str]  # (dataset, chunk key)


@dataclass
class Cached:
    ref: Any
    etag: str  # the chunk's version
    generation: int
    nbytes: int
    hashes: np.ndarray  # member (url, etag) hashes: which rows a rebuild may reuse
    # (rows, error class, message of the first) of rows cached as failed
    # (SETTLED_FAILURES): recorded with the entry, so a later `warm` that
    # finds the chunk cached still names them.
    failed: tuple[int, str, str] | None = None
    # The reading (``job:epoch``) whose request built it from the source, or
    # "": a later hit from that same reading is answered FETCHED, so each of
    # the job's ranks counts its rows of the chunk as source reads once (a
    # chunk split between ranks is one build; see docs/metrics.md).
    built_for: str = ""
    sourced_rows: int | None = None  # rows its build read from the source

    def failure_fields(self) -> dict[str, Any]:
        """What the chunk's index entry says of its failed rows ({} if none)."""
        if self.failed is None:
            return {}
        rows, kind, message = self.failed
        return {"failed": rows, "error": [kind, message]}


class HeldTable:
    """The chunks held in memory, the policy that budgets them, and generations.

    Args:
        policy: decides what stays within the byte budget.
        retired: takes the values of generations that were invalidated.
    """

    def __init__(self, policy: EvictionPolicy, retired: RetiredGenerations):
        self.policy = policy
        self.retired = retired
        self.generation: dict[str, int] = defaultdict(int)
        self._entries: dict[Key, Cached] = {}
        self._variants: OrderedDict[Key, int] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def get(self, dataset: str, chunk: str) -> Cached | None:
        return self._entries.get((dataset, chunk))

    def items(self) -> Iterator[tuple[Key, Cached]]:
        """Every held chunk (a copy: callers may evict while iterating)."""
        return iter(list(self._entries.items()))

    def hit(
        self, dataset: str, chunk: str, version: str, generation: int
    ) -> Cached | None:
        """The held chunk if it is that version of that generation (and tell
        the policy it was used), else ``None``."""
        cached = self._entries.get((dataset, chunk))
        if cached is None or cached.etag != version or cached.generation != generation:
            return None
        self.policy.touch((dataset, chunk))
        return cached

    def admit(self, dataset: str, chunk: str, value: Cached) -> tuple[bool, list[Key]]:
        """Hold ``value`` if the policy finds room; returns ``(admitted, evicted)``.

        Retired generations go first when the budget is short, then variants;
        the chunks the policy evicts for room are gone from the table when
        this returns. A variant is held only in free room (see the module).
        """
        key = (dataset, chunk)
        if is_variant_key(chunk):
            if not self.variant_room(value.nbytes, replacing=key):
                return False, []
            evicted: list[Key] = []
        else:
            overflow = self._overflow(value.nbytes)
            if overflow > 0:
                self.retired.free(overflow)
            evicted = self._free_variants(self._overflow(value.nbytes))
        admitted, victims = self.policy.admit(key, value.nbytes)
        for victim in victims:
            self.evict(victim)
        if admitted:
            self._entries[key] = value
            if is_variant_key(chunk):
                self._variants[key] = value.nbytes
        return admitted, evicted + list(victims)

    def variant_room(self, nbytes: int, replacing: Key | None = None) -> bool:
        """Whether a variant of ``nbytes`` fits the free room now (counting
        the bytes of the copy it would replace)."""
        held = self._variants.get(replacing, 0) if replacing is not None else 0
        return self._overflow(nbytes) - held <= 0

    def _overflow(self, nbytes: int) -> int:
        """Bytes over the budget if ``nbytes`` more were held."""
        policy = self.policy
        return policy.used_bytes + self.retired.nbytes + nbytes - policy.budget_bytes

    def _free_variants(self, overflow: int) -> list[Key]:
        """Evict variants, oldest first, until ``overflow`` bytes are free."""
        evicted: list[Key] = []
        while overflow > 0 and self._variants:
            key, nbytes = next(iter(self._variants.items()))
            self.evict(key)
            evicted.append(key)
            overflow -= nbytes
        return evicted

    def evict(self, key: Key) -> None:
        self.policy.remove(key)
        self._entries.pop(key, None)
        self._variants.pop(key, None)

    def advance(self, dataset: str, generation: int, spec: Any | None) -> None:
        """Move to ``generation``; older values are retired (kept a while) or freed.

        ``spec`` is the dataset as registered for the generation being left
        (``None`` if never registered here): retired chunks are served with it.
        """
        previous = self.generation[dataset]
        if generation <= previous:
            return
        self.generation[dataset] = generation
        if spec is not None:
            self.retired.retire(dataset, previous, spec)
        for k in [
            k
            for k, c in self._entries.items()
            if k[0] == dataset and c.generation < generation
        ]:
            c = self._entries[k]
            if not is_variant_key(k[1]):  # a retired generation is read as its base
                self.retired.keep(dataset, c.generation, k[1], c.ref, c.etag, c.nbytes)
            self.evict(k)

    def rebase(self, dataset: str, generation: int) -> int:
        """Start ``dataset`` over at ``generation``; returns the entries dropped.

        For when the index numbers the dataset lower than this store does (or
        the same under another fingerprint): the index lost its records (a
        Redis restarted empty) and counts generations from 1 again, so what
        this store holds under the old numbers may be other data. Dropped,
        not retired: no rank reads the old numbering any more.
        """
        dropped = [k for k in self._entries if k[0] == dataset]
        for k in dropped:
            self.evict(k)
        self.retired.drop(dataset)
        self.generation[dataset] = generation
        return len(dropped)

    def bytes_by_dataset(self) -> dict[str, int]:
        per_ds: dict[str, int] = defaultdict(int)
        for (ds, _), c in self._entries.items():
            per_ds[ds] += c.nbytes
        return dict(per_ds)


def failed_rows(errors: Mapping[Any, Sequence[str]]) -> tuple[int, str, str] | None:
    """``(rows, error class, message)`` of a chunk's failed rows (the first
    row's error), ``None`` when none failed: a chunk's ``{row: [class,
    message]}`` from its build report or its ``__errors__`` column.

    >>> failed_rows({"3": ["PreprocessError", "x.jpg: not an image"], "1": ["A", "b"]})
    (2, 'A', 'b')
    >>> failed_rows({}) is None
    True
    """
    if not errors:
        return None
    kind, message = errors[min(errors, key=int)]
    return len(errors), str(kind), str(message)

"""Augmented variants, cached: ``K`` views of every sample, built once in the stores.

An epoch-bound CPU augmentation (random resized crop, flip, color jitter)
run on the rank, per sample, every epoch, is often what bounds a training
step once the data itself is cached. With ``variants=K`` and
``augment(sample, rng)``, the stores build ``K`` augmented variants of each
chunk from its cached base form, in the node's build workers, and keep them
beside it; epoch ``e`` of a rank reads variant ``(e + offset) % K``
(``offset = seed % K``), so ``K`` consecutive epochs see ``K`` different
views of every sample and **the rank never calls** ``augment``, not even in
the first epoch (that epoch's variant is built in the store on demand, like
a miss, and the other ``K - 1`` in the background at a lower priority).

Determinism: variant ``v`` of the sample at global index ``i`` is
``augment(base, numpy.random.default_rng([seed, v, i]))`` (:func:`variant_rng`),
so a variant rebuilt after an eviction, on another node, or in another job
with the same ``seed`` is bit-identical, and a resumed run
(``load_state_dict``) reads the same variant for its epoch.

What it costs and saves (the statistical trade-off): the ``K`` views are
fixed, so epoch ``e`` and epoch ``e + K`` train on identical pixels. This is
data echoing (Choi et al., "Faster Neural Network Training with Data
Echoing", 2019) at echo factor ``K``, with the echoes spread ``K`` epochs
apart rather than back to back: its finding is that repeating each expensive
read/augmentation a few times keeps accuracy per epoch close to fresh
augmentation (up to an echo factor of ~4-8 at the data stage) while the
expensive step runs ``K`` times less often; past that, the loss of
augmentation diversity shows as overfitting (fewer distinct views per
sample over a run). Seneca (FAST '26) caches decoded and augmented forms the
same way. Advice: ``K`` between 4 and 8, ``K`` >= the number of epochs for
no repetition at all; keep cheap, batch-wise augmentations (mixup, cutmix,
GPU jitter) on the rank, where they stay fresh every step.

Memory: each variant costs about a base chunk's bytes in the store's budget
(``cache_bytes``); variants are evicted before any base chunk. Where the
budget cannot hold a variant, the rank is served the base form of that
chunk for that epoch instead (never an error, never a long wait), counted
in ``ds.stats()["variants"]["base_fallback"]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import ConfigError
from shardcache.fingerprint import unstable_parts, variants_fingerprint
from shardcache.keys import chunk_key, parse_variant_key
from shardcache.manifest import ChunkItem
from shardcache.picklability import check_picklable

__all__ = [
    "VariantSpec",
    "base_item",
    "variant_of_epoch",
    "variant_rng",
]

log = logging.getLogger("shardcache")

VERSION_SEP = "+aug:"  # a variant chunk's version: "<base version>+aug:<fingerprint>"
_SEED_MASK = 2**63 - 1  # numpy seeds are non-negative: a negative seed wraps


def variant_rng(seed: int, variant: int, index: int) -> np.random.Generator:
    """The generator ``augment`` gets for variant ``variant`` of the sample at
    global index ``index`` (its position in the listing).

    >>> a = variant_rng(0, 1, 5).random(); b = variant_rng(0, 1, 5).random()
    >>> a == b, a != variant_rng(0, 2, 5).random()
    (True, True)
    """
    return np.random.default_rng([int(seed) & _SEED_MASK, int(variant), int(index)])


def variant_of_epoch(epoch: int, seed: int, k: int) -> int:
    """The variant every rank reads in ``epoch``: ``(epoch + seed % k) % k``.

    >>> [variant_of_epoch(e, 0, 4) for e in range(6)], variant_of_epoch(0, 6, 4)
    ([0, 1, 2, 3, 0, 1], 2)
    """
    return (int(epoch) + int(seed) % k) % k


def base_item(item: ChunkItem) -> ChunkItem:
    """The base chunk's item for a variant chunk's item (the same item for a base one).

    >>> base_item(("c3.v1", "99+aug:ab", 10))
    ('c3', '99', 10)
    """
    key, version, size = item
    chunk, _ = parse_variant_key(key)
    return chunk_key(chunk), version.partition(VERSION_SEP)[0], size


def version_fingerprint(version: str) -> str:
    """The variants fingerprint a variant chunk's version carries ("" for a base one)."""
    return version.partition(VERSION_SEP)[2]


@dataclass(frozen=True)
class VariantSpec:
    """How a dataset's variants are built; made by :meth:`validate`.

    Attributes:
        k: variants per sample (``variants=``).
        seed: the dataset's seed; generators and the epoch offset derive from it.
        fingerprint: ``augment``'s and the seed's (``variants_fingerprint``):
            the suffix of every variant chunk's version.
        augment: ``augment(sample, rng) -> sample``, run in the stores' build
            workers.
    """

    k: int
    seed: int
    fingerprint: str
    augment: Callable[[Any, np.random.Generator], Any]

    @classmethod
    def validate(
        cls,
        augment: Callable[[Any, np.random.Generator], Any] | None,
        variants: int,
        seed: int,
    ) -> VariantSpec | None:
        """The dataset's variants, or ``None`` with none asked for.

        Raises:
            ConfigError: ``variants`` is not an integer >= 1, ``augment`` is
                not a picklable callable, or one is given without the other.
        """
        if isinstance(variants, bool) or not isinstance(variants, int) or variants < 1:
            raise ConfigError(
                f"variants must be an integer >= 1 (augmented views cached per "
                f"sample), got {variants!r}."
            )
        if augment is None:
            if variants > 1:
                raise ConfigError(
                    f"variants={variants} needs augment=fn, fn(sample, rng) -> "
                    "sample, to build the variants from; pass one, or leave "
                    "variants=1."
                )
            return None
        if not callable(augment):
            raise ConfigError(
                f"augment must be callable as augment(sample, rng), got "
                f"{type(augment).__name__}."
            )
        if variants < 2:
            raise ConfigError(
                "augment= needs variants=K with K >= 2 (views cached per sample, "
                "4-8 advised); one fixed augmented view belongs in preprocess."
            )
        check_picklable(augment, "augment")
        unstable = unstable_parts(augment, "augment")
        if unstable:
            log.warning(
                "shardcache: %s has no stable description (its repr holds only a "
                "memory address), so a change inside it will not rebuild the "
                "cached variants. When augment changes, change seed= too (a new "
                "seed is a new set of variants).",
                "; ".join(unstable),
            )
        return cls(variants, int(seed), variants_fingerprint(augment, seed), augment)

    def of_epoch(self, epoch: int) -> int:
        """The variant an epoch reads (:func:`variant_of_epoch`)."""
        return variant_of_epoch(epoch, self.seed, self.k)

    def item(self, item: ChunkItem, variant: int) -> ChunkItem:
        """What a rank asks a store for to read variant ``variant`` of a chunk.

        >>> spec = VariantSpec(4, 0, "ab", abs)
        >>> spec.item(("c3", "99", 10), 1)
        ('c3.v1', '99+aug:ab', 10)
        """
        key, version, size = item
        chunk, _ = parse_variant_key(key)
        return (
            chunk_key(chunk, variant),
            f"{version}{VERSION_SEP}{self.fingerprint}",
            size,
        )

    def install(self) -> dict[str, Any]:
        """What the stores are told (``spec["variants"]``; travels through Ray)."""
        return {
            "k": self.k,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "augment": self.augment,
        }

    @classmethod
    def from_install(cls, spec: dict[str, Any] | None) -> VariantSpec | None:
        """The inverse of :meth:`install` (``None`` for a dataset without variants)."""
        if not spec:
            return None
        return cls(
            int(spec["k"]), int(spec["seed"]), str(spec["fingerprint"]), spec["augment"]
        )

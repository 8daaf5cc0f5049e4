"""Build one augmented variant of a chunk from its base form (``variants=K``).

Runs where chunk builds run: on one of the node's build actors, from the
same pool as builds from the source (``builder.run_build`` dispatches on
the request), so augmentation uses the node's cores and never
the store's event loop or a rank. The variant is a chunk like any other
(columns, ``__failed__``, ``__checksum__``) plus ``__variant__``, its number;
what the rank reads and checks is the same code path.

Per sample the cost is the user's ``augment`` itself; the rest is per chunk
(one ``build_chunk``, one checksum).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.checksum import seal
from shardcache.chunks import VARIANT, Chunk
from shardcache.errors import ShardCacheError
from shardcache.variants import variant_rng
from shardcache_server.columns import build_chunk
from shardcache_server.preprocess import run_preprocess

__all__ = ["VariantRequest", "build_variant"]


@dataclass
class VariantRequest:
    """What one variant build needs: the base chunk and how to augment it.

    Attributes:
        dataset: the dataset's name (for messages).
        base: the base chunk's columns, or their ObjectRef under Ray.
        lo: the global index of the chunk's first sample (seeds its rows).
        variant: which variant to build.
        seed: the dataset's seed.
        augment: ``augment(sample, rng) -> sample``.
    """

    dataset: str
    base: Any
    lo: int
    variant: int
    seed: int
    augment: Callable[[Any, np.random.Generator], Any]


def _writable(value: Any) -> Any:
    """A copy ``augment`` may change in place (the base is shared memory)."""
    if isinstance(value, dict):
        return {k: np.array(v) for k, v in value.items()}
    return np.array(value)


def build_variant(
    req: VariantRequest,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Augment every row of the base chunk with its own generator.

    Returns ``(columns, report)`` shaped like ``builder.build_members``'s: a
    row whose base failed stays failed, a row ``augment`` fails on is marked
    with a ``PreprocessError`` and the rest is served.

    Raises:
        PreprocessError: the augmented samples disagree on fields, dtypes or
            number of dimensions.
    """
    started = time.perf_counter()
    base = Chunk(req.base)
    samples: list[Any] = [None] * len(base)
    errors: dict[int, tuple[str, str]] = {}
    names = [f"{req.dataset} sample {req.lo + row}" for row in range(len(base))]
    for row in range(len(base)):
        failed = base.error(row)
        if failed is not None:
            errors[row] = failed
            continue
        rng = variant_rng(req.seed, req.variant, req.lo + row)
        try:
            samples[row] = run_preprocess(
                req.augment, _writable(base.sample(row)), names[row], rng,
                label="augment",
            )  # fmt: skip
        except ShardCacheError as exc:
            errors[row] = (type(exc).__name__, str(exc))
    targets = base.targets
    columns = build_chunk(
        samples,
        errors,
        names=names,
        targets=None if targets is None else np.array(targets),
    )
    columns[VARIANT] = np.array([req.variant], dtype=np.int64)
    columns = seal(columns)
    report = {
        "reads": 0,
        "bytes_read": 0,
        "errors": {str(k): list(v) for k, v in errors.items()},
        "build_ms": int((time.perf_counter() - started) * 1000),
        "nbytes": int(sum(v.nbytes for v in columns.values())),
    }
    return columns, report

"""Chunks: runs of consecutive samples cached, stored and read as one unit.

A chunk is one Ray object: a dict of numpy columns, so a reader maps it
zero-copy and a batch is gathered with a few vectorised copies, never one
Python object per sample.

Column layout of a chunk of ``n`` samples (``f`` is a field: ``"_"`` for
samples that are one array, the dict key for dict samples):

=====================  ===========================================================
column                 content
=====================  ===========================================================
``f``                  ``(n, *shape)`` when every sample of ``f`` has one shape
``f/data``             otherwise: the samples' elements concatenated (1-D)
``f/offsets``          ``(n + 1,)`` int64 element offsets into ``f/data``
``f/shapes``           ``(n, ndim)`` int64 shape of each sample
``__failed__``         ``(n,)`` bool, set where the member could not be built
``__errors__``         uint8 JSON ``{row: [error class, message]}``
``__target__``         ``(n, ...)`` the ``target(url)`` labels, when one is given
``__variant__``        ``(1,)`` int64: which augmented variant this chunk is
                       (``shardcache.variants``); absent in a base chunk
=====================  ===========================================================

A failed member leaves a zero row (stacked) or an empty one (ragged); the
rest of the chunk is served, and reading the failed row raises its error.

This module is the format both sides share: ranks read chunks with
:class:`Chunk`; stores write them with ``build_chunk`` in
``shardcache_server.columns``, which ranks never run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import CollateError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CHUNK_SAMPLES",
    "ERRORS",
    "FAILED",
    "PLAIN_FIELD",
    "SOURCED",
    "TARGET",
    "VARIANT",
    "Chunk",
    "ChunkLayout",
    "plan_chunks",
    "row_errors",
]

DEFAULT_CHUNK_BYTES = (
    16 * 2**20
)  # source bytes per chunk (Mosaic: 64 MB shards; LitData: 64 MB chunks)
DEFAULT_CHUNK_SAMPLES = 4096  # bounds chunks of tiny samples (tokens, 100 B rows)
PLAIN_FIELD = "_"  # the field name of samples that are a single array
FAILED = "__failed__"
ERRORS = "__errors__"
TARGET = "__target__"
# Rows a partial rebuild read from the source (the rest were copied from the
# old chunk); absent when every row was read. Ranks count only these as
# source reads, so a changed object costs one "miss", not its whole chunk.
SOURCED = "__sourced__"
VARIANT = "__variant__"  # an augmented variant's number (variants=K); base: absent

Value = Any  # np.ndarray | dict[str, np.ndarray]


@dataclass(frozen=True)
class ChunkLayout:
    """Where each chunk starts: ``starts[c]`` to ``starts[c + 1]`` (exclusive).

    >>> layout = ChunkLayout(np.array([0, 3, 5]))
    >>> len(layout), layout.sizes().tolist(), layout.chunk_of(np.array([0, 2, 3, 4])).tolist()
    (2, [3, 2], [0, 0, 1, 1])
    """

    starts: np.ndarray

    @classmethod
    def from_sizes(cls, sizes: np.ndarray | Sequence[int]) -> ChunkLayout:
        """The layout of consecutive chunks of ``sizes`` samples.

        >>> ChunkLayout.from_sizes([3, 2]).starts.tolist()
        [0, 3, 5]
        """
        return cls(np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))))

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def num_samples(self) -> int:
        return int(self.starts[-1])

    def sizes(self) -> np.ndarray:
        return np.diff(self.starts)

    def bounds(self, chunk: int) -> tuple[int, int]:
        return int(self.starts[chunk]), int(self.starts[chunk + 1])

    def chunk_of(self, indices: np.ndarray) -> np.ndarray:
        """The chunk of every sample index (vectorised)."""
        # The method, not np.searchsorted: its dispatch wrapper costs a few
        # us, and every batch calls this twice.
        return self.starts.searchsorted(indices, side="right") - 1


def plan_chunks(
    sizes: np.ndarray,
    max_bytes: int = DEFAULT_CHUNK_BYTES,
    max_samples: int = DEFAULT_CHUNK_SAMPLES,
) -> ChunkLayout:
    """Cut consecutive samples into chunks of at most ``max_samples`` samples
    and about ``max_bytes`` source bytes (a chunk closes after the sample
    that crosses a multiple of ``max_bytes``). Deterministic and vectorised:
    every process that plans the same listing gets the same chunks.

    >>> plan_chunks(np.array([4, 4, 4, 4, 4]), max_bytes=8, max_samples=10).starts.tolist()
    [0, 2, 4, 5]
    >>> plan_chunks(np.ones(5, dtype=np.int64), max_bytes=100, max_samples=2).starts.tolist()
    [0, 2, 4, 5]
    """
    n = len(sizes)
    if n == 0:
        return ChunkLayout(np.zeros(1, dtype=np.int64))
    before = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)[:-1]))
    bucket = before // max(int(max_bytes), 1)
    cuts = np.flatnonzero(np.diff(bucket)) + 1  # a new byte bucket starts a chunk
    starts = np.concatenate(([0], cuts, [n])).astype(np.int64)
    # Split runs longer than max_samples into equal-count pieces.
    pieces = []
    for lo, hi in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        pieces.append(np.arange(lo, hi, max(int(max_samples), 1), dtype=np.int64))
    return ChunkLayout(np.concatenate([*pieces, np.array([n], dtype=np.int64)]))


# -- reading (rank side) --------------------------------------------------------------
class Chunk:
    """A read-only view of one chunk's columns (zero-copy from the object store).

    >>> c = Chunk({"_": np.array([[0, 1, 2], [10, 11, 12]]),
    ...            "__failed__": np.zeros(2, dtype=bool)})
    >>> len(c), c.sample(1).tolist(), c.fields
    (2, [10, 11, 12], ['_'])
    """

    def __init__(self, columns: dict[str, np.ndarray]):
        self.columns = columns
        self.failed = columns[FAILED]
        self.has_failures = bool(self.failed.any())
        names = {k.split("/", 1)[0] for k in columns if not k.startswith("__")}
        self.fields = sorted(names)
        self.is_plain = self.fields == [PLAIN_FIELD]
        self.stacked = {f: columns[f] for f in self.fields if f in columns}
        self.nbytes = int(sum(v.nbytes for v in columns.values()))
        self.targets = columns.get(TARGET)
        self.sourced = columns.get(SOURCED)
        variant = columns.get(VARIANT)
        # Which augmented variant this is (None: the base form): a rank that
        # asked for a variant tells a fallback to the base form by it.
        self.variant = None if variant is None else int(variant[0])

    def __len__(self) -> int:
        return len(self.failed)

    def error(self, row: int) -> tuple[str, str] | None:
        """The ``(error class, message)`` of a failed row, else ``None``."""
        if not self.failed[row]:
            return None
        errors = row_errors(self.columns)
        kind, message = errors.get(str(row), ("RemoteFetchError", "member failed"))
        return str(kind), str(message)

    def field(self, field: str, row: int) -> np.ndarray:
        stacked = self.stacked.get(field)
        if stacked is not None:
            return stacked[row, ...]  # a view even for 0-d samples (not a scalar)
        offsets = self.columns[f"{field}/offsets"]
        shape = tuple(int(s) for s in self.columns[f"{field}/shapes"][row])
        data = self.columns[f"{field}/data"]
        return data[int(offsets[row]) : int(offsets[row + 1])].reshape(shape)

    def sample(self, row: int) -> Value:
        """One sample as zero-copy numpy views (a dict for dict samples)."""
        if self.is_plain:
            return self.field(PLAIN_FIELD, row)
        return {f: self.field(f, row) for f in self.fields}


def gather(
    chunks: Mapping[int, Chunk],
    chunk_ids: Sequence[int],
    rows: Sequence[int],
    field: str,
    out: np.ndarray,
) -> None:
    """Copy ``field`` of chunk ``chunk_ids[j]`` row ``rows[j]`` into ``out[j]``
    for every j (``chunks``: the batch's chunks by id).

    One view per row, then one ``np.concatenate`` into ``out``, so the
    copies run in one C loop: a row assignment each (``out[j] = view``)
    costs ~0.4 us of numpy dispatch per row, a view ~0.15 us; 64 rows of
    4 KB from 3 chunks gather in ~22 us against ~47, 16 of 150 KB in ~54
    against ~83 (``bench/gather_cost.py``). Rows stay in batch order: a
    shuffled batch may touch as many chunks as it has rows, so grouping
    them by chunk would cost a scatter.
    """
    columns = {c: chunk.stacked.get(field) for c, chunk in chunks.items()}
    if any(column is None for column in columns.values()):  # ragged chunks
        views = [
            chunks[c].field(field, r) if (column := columns[c]) is None else column[r]
            for c, r in zip(chunk_ids, rows, strict=True)
        ]
    else:
        views = [columns[c][r] for c, r in zip(chunk_ids, rows, strict=True)]
    if out.ndim > 1 and out.size and out.flags.c_contiguous:
        # (B, d0, d1...) viewed as (B * d0, d1...): the rows end to end;
        # "unsafe" casts as a row assignment does (a row of another dtype).
        flat = out.reshape((-1, *out.shape[2:]))
        np.concatenate(views, axis=0, out=flat, casting="unsafe")
        return
    for j, view in enumerate(views):  # scalar rows, or rows of no elements
        out[j] = view


def batch_shape(
    chunks: Mapping[int, Chunk],
    chunk_ids: Sequence[int],
    rows: Sequence[int],
    field: str,
) -> tuple:
    """The per-sample shape every sample of the batch shares, or CollateError.

    Stacked chunks are checked once each; only ragged chunks look at rows.
    """
    shapes: set[tuple[int, ...]] = set()
    for c in set(chunk_ids):  # not a chunk of the batch's whose rows were replaced
        chunk = chunks[c]
        stacked = chunk.stacked.get(field)
        if stacked is not None:
            shapes.add(tuple(stacked.shape[1:]))
        else:
            shapes.update(
                tuple(chunk.field(field, r).shape)
                for i, r in zip(chunk_ids, rows, strict=True)
                if i == c
            )
    if len(shapes) > 1:
        where = "samples" if field == PLAIN_FIELD else f"field {field!r} of samples"
        a, b = sorted(shapes)[:2]
        raise CollateError(
            f"{where} in one batch have shapes {list(a)} and {list(b)}; a batch "
            "tensor needs one shape. Resize or pad in preprocess, or read samples "
            "one at a time with ds[i]."
        )
    return shapes.pop()


def row_errors(columns: dict[str, np.ndarray]) -> dict[str, list[str]]:
    """A chunk's failed rows, ``{row: [error class, message]}`` (its
    ``__errors__`` column; ``{}`` when it has none).

    >>> row_errors({ERRORS: np.frombuffer(b'{"2": ["A", "b"]}', np.uint8)})
    {'2': ['A', 'b']}
    """
    raw = columns.get(ERRORS)
    return {} if raw is None else json.loads(bytes(raw).decode() or "{}")

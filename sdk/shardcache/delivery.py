"""What a batch's chunks become for the caller: a collated batch, or samples the caller owns.

Every function here copies out of the chunks: their columns are views of
shared memory that every process of the node maps, and ``torch.from_numpy``
ignores numpy's read-only flag, so a view handed out would let one in-place
op (``x.mul_(2)``) change what every other reader gets. A collated batch is
one gather into a fresh tensor; a list of samples is that same gather handed
out as rows; only ragged samples are copied one by one. A sample whose
object could not be read or built is raised with the build's own error, or
(``on_error="skip"``) stood in for by another sample of its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardcache import batch_rows, errors
from shardcache.buffers import BATCH_BUFFERS
from shardcache.chunks import PLAIN_FIELD, Chunk, batch_shape, gather

__all__ = [
    "as_tuple",
    "collate",
    "is_tuple_sample",
    "raise_failed",
    "sample",
    "samples",
    "substitute_failed",
]


# DataLoader's default collate returns a batch gathered here instead of a copy.
batch_rows.install()


def is_tuple_sample(sample: Any) -> bool:
    """A dict whose fields are ``"(0)"``, ``"(1)"``...: a tuple a Dataset returned."""
    return (
        isinstance(sample, dict)
        and bool(sample)
        and all(
            isinstance(k, str) and k.startswith("(") and k.endswith(")") for k in sample
        )
    )


def as_tuple(sample: Any) -> Any:
    if not is_tuple_sample(sample):
        return sample
    return tuple(sample[f"({i})"] for i in range(len(sample)))


def collate(
    chunks: dict[int, Chunk],
    chunk_ids: np.ndarray,
    rows: np.ndarray,
    indices: np.ndarray,
    pin_memory: bool,
    url_of: Callable[[int], str],
    name_objects: bool = True,
) -> Any:
    """One batch as tensors: ``(B, ...)``, a dict of them, plus targets if any.

    Raises:
        CollateError: samples of the batch differ in shape (``name_objects``:
            naming two of them and their objects).
    """
    ids, row_list = chunk_ids.tolist(), rows.tolist()
    if any(chunk.has_failures for chunk in chunks.values()):
        raise_failed([chunks[c] for c in ids], row_list, indices, url_of)
    first = chunks[ids[0]]
    try:
        out = {
            f: _gather_field(chunks, ids, row_list, f, pin_memory) for f in first.fields
        }
    except errors.CollateError as exc:
        if not name_objects:
            raise
        which = _two_shapes(chunks, ids, row_list, indices.tolist(), url_of)
        raise errors.CollateError(f"{exc} {which}".rstrip()) from None
    x = out[PLAIN_FIELD] if first.is_plain else out
    if first.targets is None:
        return x
    targets = np.stack(
        [chunks[c].targets[r] for c, r in zip(ids, row_list, strict=True)]
    )
    return x, torch.from_numpy(targets)


def samples(
    chunks: dict[int, Chunk],
    chunk_ids: np.ndarray,
    rows: np.ndarray,
    indices: np.ndarray,
    url_of: Callable[[int], str],
) -> list[Any]:
    """One batch as a list of samples the caller owns (``__getitems__``).

    Samples of one shape are gathered in one copy into a batch tensor of
    this call's own and handed out as its rows: a sample then costs a
    view (~1 us) instead of a copy and a dispatch of its own, and an
    in-place op on it changes only that private batch. DataLoader's
    default collate gives that batch back instead of stacking the rows
    again (:mod:`shardcache.batch_rows`). Ragged samples are copied one
    by one (:func:`sample`).
    """
    try:
        gathered = collate(chunks, chunk_ids, rows, indices, False, url_of, False)
    except errors.CollateError:
        # Shapes differ: each sample its own copy, marked so that DataLoader's
        # default collate raises CollateError, not torch's stack error.
        return [
            _ragged(sample(chunks[c], r, i, url_of))
            for c, r, i in zip(
                chunk_ids.tolist(), rows.tolist(), indices.tolist(), strict=True
            )
        ]
    x, targets = gathered if isinstance(gathered, tuple) else (gathered, None)
    if isinstance(x, dict):
        per_field = [batch_rows.as_rows(t) for t in x.values()]
        rows_of = zip(*per_field, strict=True)
        xs: list[Any] = [dict(zip(x, row, strict=True)) for row in rows_of]
    else:
        xs = batch_rows.as_rows(x)
    if targets is None:
        return xs
    return list(zip(xs, batch_rows.as_rows(targets), strict=True))


def sample(chunk: Chunk, row: int, index: int, url_of: Callable[[int], str]) -> Any:
    """One sample as tensors the caller owns (copies of the cached rows).

    The chunk's columns are views of shared memory that every process of
    the node maps, and ``torch.from_numpy`` ignores numpy's read-only
    flag: a view handed out here would let one in-place op (``x.mul_``
    in a transform) change what every other reader gets. One copy per
    sample is the price (a memcpy plus ~1 us of dispatch; BENCHMARKS.md
    "Read-only samples"); ``collate`` pays no extra, it copies anyway.
    """
    raise_failed([chunk], [row], np.array([index]), url_of)
    value = chunk.sample(row)
    x = (
        {k: _owned(v) for k, v in value.items()}
        if isinstance(value, dict)
        else _owned(value)
    )
    if chunk.targets is None:
        return x
    return x, _owned(np.asarray(chunk.targets[row]))


def _gather_field(
    chunks: dict[int, Chunk],
    ids: list[int],
    rows: list[int],
    field: str,
    pin_memory: bool,
) -> torch.Tensor:
    shape = (len(rows), *batch_shape(chunks, ids, rows, field))
    dtype = chunks[ids[0]].field(field, rows[0]).dtype
    if pin_memory:
        torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        pinned = torch.empty(shape, dtype=torch_dtype, pin_memory=True)
        gather(chunks, ids, rows, field, pinned.numpy())
        return pinned
    # A batch's pages written again instead of faulted in and zeroed: only
    # once nothing (a step, a kept sample) views the buffer (buffers.py).
    out = BATCH_BUFFERS.take_array(shape, dtype)
    gather(chunks, ids, rows, field, out)
    return torch.from_numpy(out)


def _two_shapes(
    chunks: dict[int, Chunk],
    ids: list[int],
    rows: list[int],
    indices: list[int],
    url_of: Callable[[int], str],
) -> str:
    """Which samples of a batch differ: the first one and the first of
    another shape, by index and object (every field's shape, for dict samples)."""

    def shape(j: int) -> Any:
        value = chunks[ids[j]].sample(rows[j])
        if isinstance(value, dict):
            return {k: list(np.shape(v)) for k, v in value.items()}
        return list(np.shape(value))

    first = shape(0)
    for j in range(1, len(ids)):
        other = shape(j)
        if other != first:
            return (
                f"Sample {indices[0]} ({url_of(indices[0])}) has shape {first}, "
                f"sample {indices[j]} ({url_of(indices[j])}) {other}."
            )
    return ""


def raise_failed(
    in_batch: list[Chunk],
    rows: list[int],
    indices: np.ndarray,
    url_of: Callable[[int], str],
) -> None:
    for j, (chunk, row) in enumerate(zip(in_batch, rows, strict=True)):
        if chunk.has_failures and chunk.failed[row]:
            kind, message = chunk.error(row) or ("RemoteFetchError", "")
            url = url_of(int(indices[j]))
            raise errors.error_type(kind, errors.RemoteFetchError)(
                f"sample {int(indices[j])} ({url!r}) could not be built: {message}"
            )


def substitute_failed(
    chunks: dict[int, Chunk],
    chunk_ids: np.ndarray,
    rows: np.ndarray,
    indices: np.ndarray,
    url_of: Callable[[int], str],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """``on_error="skip"``: every sample whose object could not be read or
    built is replaced by a good sample of the same batch (the next one,
    cycling), so the batch and the epoch keep their length and every
    rank its step count. Returns the new ``(chunk_ids, rows, indices)``
    and the skipped sample indices.

    Raises:
        RemoteFetchError (or the build's own error): no sample of the
            batch could be built, so there is nothing to stand in.
    """
    if not any(chunks[c].has_failures for c in np.unique(chunk_ids).tolist()):
        return chunk_ids, rows, indices, []
    failed = np.fromiter(
        (
            bool(chunks[c].failed[r])
            for c, r in zip(chunk_ids.tolist(), rows.tolist(), strict=True)
        ),
        dtype=bool,
        count=len(rows),
    )
    bad = np.flatnonzero(failed)
    good = np.flatnonzero(~failed)
    if len(good) == 0:
        j = int(bad[0])
        raise_failed([chunks[int(chunk_ids[j])]], [int(rows[j])], indices[j:], url_of)
    stand_in = good[np.arange(len(bad)) % len(good)]
    skipped = indices[bad].tolist()
    chunk_ids, rows, indices = chunk_ids.copy(), rows.copy(), indices.copy()
    chunk_ids[bad], rows[bad], indices[bad] = (
        chunk_ids[stand_in],
        rows[stand_in],
        indices[stand_in],
    )
    return chunk_ids, rows, indices, skipped


def _ragged(value: Any) -> Any:
    """Mark every tensor of one sample (fields, target) as ragged."""
    if isinstance(value, torch.Tensor):
        return batch_rows.mark_ragged(value)
    if isinstance(value, dict):
        return {k: _ragged(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_ragged(v) for v in value)
    return value


def _owned(view: np.ndarray) -> torch.Tensor:
    """A tensor of the caller's own: a copy of a (read-only, shared) view."""
    return torch.from_numpy(np.array(view, copy=True))

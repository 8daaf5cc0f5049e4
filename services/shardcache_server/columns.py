"""Lay preprocessed samples out as a chunk's columns (the store side of the format).

The column layout itself (names, ragged ``data/offsets/shapes``, the failed
mask and error JSON) is documented in :mod:`shardcache.chunks`, beside the
:class:`~shardcache.chunks.Chunk` reader ranks use; only stores build chunks.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardcache.chunks import ERRORS, FAILED, PLAIN_FIELD, TARGET
from shardcache.errors import PreprocessError

__all__ = ["build_chunk", "column_chunk"]

Value = Any  # np.ndarray | dict[str, np.ndarray]


def _fields(value: Value) -> dict[str, np.ndarray]:
    if isinstance(value, dict):
        return value
    return {PLAIN_FIELD: value}


def build_chunk(
    samples: Sequence[Value | None],
    errors: dict[int, tuple[str, str]] | None = None,
    names: Sequence[str] | None = None,
    targets: Sequence[Any] | None = None,
) -> dict[str, np.ndarray]:
    """Lay preprocessed samples out as columns; ``None`` marks a failed member.

    A sample whose fields differ from most of the chunk's (a packed sample
    missing a member, e.g. a tar shard without one sample's ``.cls``) is a
    failed member, with a ``PreprocessError`` naming both field sets: the
    rank raises it, or skips that sample alone with ``on_error="skip"``.
    Such rows are added to ``errors`` itself, so the build's report (the
    fetch_error event, the index entry's failed rows) names them too.

    Raises:
        PreprocessError: the samples disagree on their dtypes or number of
            dimensions (the message names two members that differ).

    >>> cols = build_chunk([np.zeros(2), np.ones(2)])
    >>> cols["_"].shape
    (2, 2)
    >>> sorted(build_chunk([np.zeros(2), np.ones(3)]))
    ['_/data', '_/offsets', '_/shapes', '__errors__', '__failed__']
    >>> errors = {}
    >>> _ = build_chunk([{"x": np.zeros(1)}, {"x": np.ones(1)}, {"y": np.ones(1)}], errors)
    >>> sorted(errors), errors[2][0]
    ([2], 'PreprocessError')
    """
    n = len(samples)
    names = names or [f"#{i}" for i in range(n)]
    ok = [i for i, s in enumerate(samples) if s is not None]
    cols: dict[str, np.ndarray] = {}
    failed = np.array([s is None for s in samples], dtype=bool)
    errors = {} if errors is None else errors
    if ok:
        ok = _same_fields(samples, ok, names, failed, errors)
    if ok:
        first = _fields(samples[ok[0]])
        for field, ref in first.items():
            arrays = [_fields(samples[i])[field] for i in ok]
            cols.update(_field_columns(field, arrays, ok, n, ref, names))
    cols[FAILED] = failed
    return _finish(cols, errors, names, targets)


def _same_fields(
    samples: Sequence[Value | None],
    ok: list[int],
    names: Sequence[str],
    failed: np.ndarray,
    errors: dict[int, tuple[str, str]],
) -> list[int]:
    """The rows of ``ok`` whose fields are the chunk's most common set; each
    other row is marked failed in ``failed`` and ``errors``."""
    first = _fields(samples[ok[0]]).keys()
    if all(_fields(samples[i]).keys() == first for i in ok):
        return ok  # the usual chunk: one key-view comparison per sample
    keys = [tuple(sorted(_fields(samples[i]))) for i in ok]
    # Most common first; a tie goes to the set seen first.
    common = Counter(keys).most_common(1)[0][0]
    model = ok[keys.index(common)]
    kept = []
    for i, k in zip(ok, keys, strict=True):
        if k == common:
            kept.append(i)
            continue
        failed[i] = True
        errors[i] = (
            "PreprocessError",
            f"sample {names[i]!r} has fields {list(k)} but {names[model]!r} has "
            f"{list(common)}: every sample of a dataset must have the same fields "
            "(a packed sample may be missing a member, e.g. a tar shard without "
            "one of its files). Fix the source, or pass on_error='skip'.",
        )
    return kept


def column_chunk(
    column: np.ndarray, names: Sequence[str], targets: Sequence[Any] | None = None
) -> dict[str, np.ndarray]:
    """A chunk whose one plain field was laid out already, a row per member
    (``npy_rows.read_npy_column``), none failed: the same columns
    ``build_chunk`` gives for those samples, without copying them again.

    >>> sorted(column_chunk(np.zeros((2, 3)), ["a", "b"]))
    ['_', '__errors__', '__failed__']
    """
    cols = {PLAIN_FIELD: column, FAILED: np.zeros(len(column), dtype=bool)}
    return _finish(cols, None, names, targets)


def _finish(
    cols: dict[str, np.ndarray],
    errors: dict[int, tuple[str, str]] | None,
    names: Sequence[str],
    targets: Sequence[Any] | None,
) -> dict[str, np.ndarray]:
    """The columns every chunk has besides its fields: target, errors."""
    if targets is not None:
        labels = np.asarray(targets)
        if labels.dtype.hasobject or labels.dtype.kind in "US":
            raise PreprocessError(
                f"target returned {type(targets[0]).__name__} for {names[0]!r}; it must "
                "return a number or a numeric array (the label, e.g. a class index)."
            )
        cols[TARGET] = labels
    cols[ERRORS] = np.frombuffer(
        json.dumps({str(k): list(v) for k, v in (errors or {}).items()}).encode(),
        dtype=np.uint8,
    ).copy()
    return cols


def _field_columns(
    field: str,
    arrays: list[np.ndarray],
    rows: list[int],
    n: int,
    ref: np.ndarray,
    names: Sequence[str],
) -> dict[str, np.ndarray]:
    for a, row in zip(arrays, rows, strict=True):
        if a.dtype != ref.dtype or a.ndim != ref.ndim:
            where = "" if field == PLAIN_FIELD else f" field {field!r}"
            raise PreprocessError(
                f"preprocess returned{where} {a.dtype}{list(a.shape)} for "
                f"{names[row]!r} but {ref.dtype}{list(ref.shape)} for {names[rows[0]]!r}; "
                "samples must share dtype and number of dimensions (cast in preprocess)."
            )
    if all(a.shape == ref.shape for a in arrays):
        # One copy per sample straight into its row (np.stack would copy twice);
        # rows of failed members are zeroed, the others written once.
        out = np.empty((n, *ref.shape), dtype=ref.dtype)
        for a, row in zip(arrays, rows, strict=True):
            out[row] = a
        if len(rows) < n:
            out[np.setdiff1d(np.arange(n), rows)] = 0
        return {field: out}
    shapes = np.zeros((n, ref.ndim), dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    for a, row in zip(arrays, rows, strict=True):
        shapes[row] = a.shape
        lengths[row] = a.size
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    data = np.concatenate([a.reshape(-1) for a in arrays]).astype(ref.dtype, copy=False)
    return {
        f"{field}/data": data,
        f"{field}/offsets": offsets,
        f"{field}/shapes": shapes,
    }

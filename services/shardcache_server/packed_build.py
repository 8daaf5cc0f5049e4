"""Build one chunk of a packed dataset: read its unit, preprocess, lay out columns.

The unit is read with the format's ranged reads, sized from what the
listing kept (a tar span or a .npy slab, Parquet column chunks, HDF5 rows or
chunks), at the listed version: a file rewritten since fails the unit with
StaleVersionError, never a chunk of two versions. When the user kept
the default preprocess and the format has rows of arrays (.npy, HDF5,
numeric Parquet), the unit's slab *is* the chunk's column: no Python per
sample. A unit that cannot be read fails every row with the format's error,
so a rank reading it gets that error, naming the file.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shardcache.checksum import seal
from shardcache.chunks import ERRORS, FAILED
from shardcache.decoders import as_arrays
from shardcache.errors import ShardCacheError
from shardcache.packed_manifest import PackedManifest
from shardcache.source import open_remote
from shardcache_server.columns import build_chunk
from shardcache_server.formats import SourceFile, UnitRequest, get_format
from shardcache_server.objects import ranged_options
from shardcache_server.packed_listing import DATASET_FORMAT
from shardcache_server.preprocess import run_preprocess

__all__ = ["build_unit"]


def _with_key(fn: Callable[..., Any]) -> Callable[[Any, str], Any]:
    """``fn(raw, key)`` when ``fn`` takes two arguments, else ``fn(raw)``."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        params = []
    if len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return fn
    return lambda raw, key: fn(raw)


def _unit(
    manifest: PackedManifest,
    chunk: int,
    storage_options: dict[str, Any],
    span: Any,
    budget: Any,
) -> UnitRequest:
    url, etag, lo, hi = manifest.unit(chunk)
    fs, path = open_remote(url, ranged_options(url, storage_options, budget))
    start, end = (int(x) for x in manifest.layout.bounds(chunk))
    file_index = manifest.unit_file(chunk)
    unit = UnitRequest(
        SourceFile(fs, path, url, etag, manifest.file(file_index)[2], budget=budget),
        lo,
        hi,
        manifest.keys(start, end),
        manifest.file_meta(file_index),
        manifest.options,
        span,
    )
    return unit


def build_unit(
    manifest: PackedManifest,
    chunk: int,
    preprocess: Callable[..., Any],
    target: Callable[[str], Any] | None,
    storage_options: dict[str, Any],
    source: Any = None,
    span: Any = None,
    budget: Any = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read and build chunk ``chunk``; returns ``(columns, report)`` like
    :func:`~shardcache_server.builder.build_members`.

    ``span`` is the unit's bytes when the listing kept them (tar, spans.py):
    the build then reads nothing from the source and reports no read.
    ``budget``: the source's request budget its GETs take (``source_rps``).
    """
    started = time.perf_counter()
    start, end = (int(x) for x in manifest.layout.bounds(chunk))
    n = end - start
    errors: dict[int, tuple[str, str]] = {}
    columns: dict[str, np.ndarray] | None = None
    samples: list[Any] = [None] * n
    try:
        raw: list[tuple[str, Any]] | None = None
        if manifest.format == DATASET_FORMAT:
            url, _, lo, hi = manifest.unit(chunk)
            raw = []
            for row, i in enumerate(range(lo, hi)):
                key = f"{url}#{i}"
                try:
                    raw.append((key, source[i]))
                except Exception as exc:  # a user's __getitem__: this item only
                    errors[row] = (
                        "PreprocessError",
                        f"{type(exc).__name__} in __getitem__({i}) of {url}: {exc}",
                    )
                    raw.append((key, None))
        else:
            unit = _unit(manifest, chunk, storage_options, span, budget)
            fmt = get_format(manifest.format)
            if preprocess is as_arrays and target is None and fmt.stacks_columns(unit):
                columns = fmt.read_columns(unit)
            if columns is None:
                raw = fmt.read_samples(unit)
        if columns is None:
            assert raw is not None
            call = _with_key(preprocess)
            for row, (key, value) in enumerate(raw):
                if row in errors:
                    continue
                try:
                    samples[row] = run_preprocess(
                        lambda v, k=key: call(v, k), value, key
                    )
                except ShardCacheError as exc:
                    errors[row] = (type(exc).__name__, str(exc))
    except ShardCacheError as exc:
        errors = {row: (type(exc).__name__, str(exc)) for row in range(n)}
        samples = [None] * n
    except Exception as exc:  # a user's Dataset.__getitem__: theirs to see
        message = f"{type(exc).__name__} reading {manifest.unit(chunk)[0]}: {exc}"
        errors = {row: ("PreprocessError", message) for row in range(n)}
        samples = [None] * n
    if columns is not None:
        columns = {k: np.ascontiguousarray(v) for k, v in columns.items()}
        columns[FAILED] = np.zeros(n, dtype=bool)
        columns[ERRORS] = np.frombuffer(b"{}", dtype=np.uint8).copy()
    else:
        # One name per sample, for messages and for ``target``: computed once.
        names = [manifest.url(i) for i in range(start, end)]
        targets = [target(k) for k in names] if target else None
        columns = build_chunk(samples, errors, names=names, targets=targets)
    seal(columns)  # the contents as built: verify and sampled reads check them
    # A unit whose bytes came with the listing was read from the source by
    # the listing, on this unit's behalf and once: counted here all the same,
    # so the source bytes the dashboard shows are the ones the source sent.
    is_read = not (errors and len(errors) == n)
    nbytes = manifest.chunk_source_bytes(chunk)
    report = {
        "reads": int(is_read),
        "bytes_read": nbytes if is_read else 0,
        "errors": {str(k): list(v) for k, v in errors.items()},
        "build_ms": int((time.perf_counter() - started) * 1000),
        "nbytes": int(sum(v.nbytes for v in columns.values())),
    }
    return columns, report

"""List a packed dataset: its files, each cut into units by its format.

Runs where every listing runs (a task on the publishing store's node): the
source is listed once (one ListObjectsV2 per prefix), then each new or
rewritten file is opened by its format, many at once; a file whose ETag is
the one the previous listing saw keeps its units without being read again.
"""

from __future__ import annotations

import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardcache.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_SAMPLES
from shardcache.errors import EmptyDatasetError
from shardcache.packed_manifest import FileUnits, PackedManifest
from shardcache.source import open_remote
from shardcache_server.formats import SourceFile, get_format
from shardcache_server.objects import list_source, ranged_options
from shardcache_server.spans import SpanKeeper

__all__ = ["DATASET_FORMAT", "list_packed"]

DATASET_FORMAT = "dataset"  # a user's map-style Dataset, called on the cluster
_LISTING_THREADS = 16  # files opened at once (footers, headers: latency-bound)


def _files(
    spec: dict[str, Any], extensions: tuple[str, ...], budget: Any = None
) -> list[tuple[str, int, str]]:
    """``(url, size, etag)`` of the source's files of this format, in order."""
    listed = list_source(spec["urls"], spec.get("storage_options") or {}, budget)
    if spec["format"] == "lmdb":
        # A database is a directory holding data.mdb (or a single .mdb file).
        found = []
        for i in range(len(listed)):
            url = listed.url(i)
            if posixpath.basename(url) == "data.mdb":
                found.append((posixpath.dirname(url), listed.size(i), listed.etag(i)))
            elif url.endswith(extensions) and not url.endswith("lock.mdb"):
                found.append((url, listed.size(i), listed.etag(i)))
        files = found
    else:
        files = [
            (listed.url(i), listed.size(i), listed.etag(i))
            for i in range(len(listed))
            if listed.url(i).lower().endswith(extensions)
        ]
    if not files:
        held = (
            f"it holds {len(listed)} other object(s), such as {listed.url(0)!r}"
            if len(listed)
            else "it holds no objects"
        )
        raise EmptyDatasetError(
            f"source {spec['urls']!r} lists no {spec['format']} files "
            f"({', '.join(extensions)}): {held}. Check the URL, or pass the "
            "format those files are in (format= is optional: the extension "
            "names it)."
        )
    return files


def _dataset_units(spec: dict[str, Any], chunk_samples: int) -> list[FileUnits]:
    from shardcache_server.formats.base import cut_rows

    source = spec["source_object"]
    count = len(source)
    # Sample sizes are unknown until built: units are bounded by sample count.
    bounds, samples, _ = cut_rows(count, 1, chunk_samples, chunk_samples)
    version = spec.get("source_version", "")
    return [
        FileUnits(f"dataset://{spec['name']}", version, count, bounds, samples, samples)
    ]


def list_packed(
    spec: dict[str, Any],
    previous: Any,
    keeper: SpanKeeper | None = None,
    budget: Any = None,
) -> PackedManifest:
    """List ``spec`` (with ``format``, ``format_options``) into a PackedManifest.

    With ``keeper``, a format that reads whole units while listing (tar)
    hands their bytes to it, so builds need not read them again (spans.py).
    ``budget``: the source's request budget, taken by every LIST request
    and every ranged GET the format's listing reads.

    Raises:
        ConfigError: unknown format.
        SourceFormatError: a file is not valid in its format (named).
        EmptyDatasetError, SourceNotFound: the source lists no such file.
    """
    chunk_samples = int(spec.get("chunk_samples") or DEFAULT_CHUNK_SAMPLES)
    chunk_bytes = int(spec.get("chunk_bytes") or DEFAULT_CHUNK_BYTES)
    options = dict(spec.get("format_options") or {})
    protocol = spec.get("protocol", "file")
    if spec["format"] == DATASET_FORMAT:
        units = _dataset_units(spec, chunk_samples)
        return PackedManifest.from_files(protocol, DATASET_FORMAT, units, options)
    fmt = get_format(spec["format"])
    fmt.check_options(options)
    files = _files(spec, fmt.extensions, budget)
    storage_options = ranged_options(
        files[0][0], spec.get("storage_options") or {}, budget
    )
    fs, _ = open_remote(files[0][0], storage_options)
    kept: dict[str, tuple[FileUnits, bytes]] = {}
    if (
        isinstance(previous, PackedManifest)
        and previous.format == spec["format"]
        and previous.options == options
    ):
        for i in range(previous.num_files):
            units = previous.file_units(i)
            kept[units.url] = (units, previous.file_meta(i))

    def one(entry: tuple[str, int, str]) -> tuple[FileUnits, bytes]:
        url, size, etag = entry
        old = kept.get(url)
        if old is not None and old[0].etag == etag:
            return old
        _, path = open_remote(url, storage_options)
        keep = keeper.for_file(url, etag) if keeper is not None else None
        return fmt.list_file(
            SourceFile(fs, path, url, etag, size, keep, budget),
            options,
            chunk_samples,
            chunk_bytes,
        )

    with ThreadPoolExecutor(min(_LISTING_THREADS, len(files))) as pool:
        listed = list(pool.map(one, files))
    return PackedManifest.from_files(
        protocol,
        spec["format"],
        [u for u, _ in listed],
        options,
        [m for _, m in listed],
    )

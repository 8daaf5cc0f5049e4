"""WebDataset tar shards: members sharing a basename form one sample.

``train/000123.jpg`` and ``train/000123.cls`` are the sample with key
``train/000123``, returned as ``{"jpg": bytes, "cls": bytes}`` (the
WebDataset convention: the key ends at the first dot of the file name).

A tar has no index, so the listing reads each shard once to find its
members (streaming, in large blocks) and keeps the sample keys; a unit is a
run of whole samples, read at build time with one ranged read of its span.
"""

from __future__ import annotations

import io
import tarfile
from typing import Any

from shardcache.errors import SourceFormatError
from shardcache.packed_manifest import FORMAT_EXTENSIONS, FileUnits
from shardcache_server.formats.base import SourceFile, SourceFormat, UnitRequest

__all__ = ["TarFormat", "split_member_name"]

_BLOCK_BYTES = 16 * 2**20  # the listing's read size: few GETs per shard
_END_BLOCKS_BYTES = 1024  # two 512-byte zero blocks close every tar archive


def split_member_name(name: str) -> tuple[str, str]:
    """``(key, extension)`` by the WebDataset convention.

    >>> split_member_name("train/000123.seg.png")
    ('train/000123', 'seg.png')
    """
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext


def _samples(
    tar: tarfile.TarFile, url: str
) -> list[tuple[str, int, int, dict[str, Any]]]:
    """``(key, span start, span end, {ext: member})`` per sample, in tar order."""
    out: list[tuple[str, int, int, dict[str, Any]]] = []
    try:
        for member in tar:
            if not member.isfile():
                continue
            key, ext = split_member_name(member.name)
            end = member.offset_data + -(-member.size // 512) * 512
            if out and out[-1][0] == key:
                out[-1] = (key, out[-1][1], end, {**out[-1][3], ext: member})
            else:
                out.append((key, member.offset, end, {ext: member}))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise SourceFormatError(
            f"{url} is not a valid tar shard (truncated or corrupt): {exc}"
        ) from exc
    return out


class TarFormat(SourceFormat):
    name = "tar"
    extensions = FORMAT_EXTENSIONS["tar"]

    def list_file(
        self,
        file: SourceFile,
        options: dict[str, Any],
        chunk_samples: int,
        chunk_bytes: int,
    ) -> tuple[FileUnits, bytes]:
        with file.fs.open(
            file.path, "rb", block_size=_BLOCK_BYTES, cache_type="readahead"
        ) as f:
            try:
                tar = tarfile.open(fileobj=f, mode="r:")
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise SourceFormatError(f"{file.url} is not a tar file: {exc}") from exc
            samples = _samples(tar, file.url)
        # A complete archive ends with two zero blocks after its last member;
        # tarfile reads a cut-off header as the end, so check it here.
        if samples and samples[-1][2] + _END_BLOCKS_BYTES > file.size:
            raise SourceFormatError(
                f"{file.url} is a truncated tar shard: it ends {file.size - samples[-1][2]} "
                f"bytes after member {samples[-1][0]!r}, without the end-of-archive "
                "blocks. Rewrite the shard."
            )
        if not samples:
            raise SourceFormatError(f"{file.url} is a tar shard with no file members")
        units = FileUnits(file.url, file.etag, file.size)
        start = 0
        while start < len(samples):
            end = start + 1
            while (
                end < len(samples)
                and end - start < chunk_samples
                and samples[end][2] - samples[start][1] <= chunk_bytes
            ):
                end += 1
            lo, hi = samples[start][1], samples[end - 1][2]
            units.bounds.append((lo, hi))
            units.samples.append(end - start)
            units.nbytes.append(hi - lo)
            start = end
        units.keys = [s[0].encode() for s in samples]
        return units, b""

    def read_samples(self, unit: UnitRequest) -> list[tuple[str, Any]]:
        span = unit.file.fs.cat_file(unit.file.path, start=unit.lo, end=unit.hi)
        if len(span) != unit.hi - unit.lo:
            raise SourceFormatError(
                f"{unit.file.url} returned {len(span)} bytes for span {unit.lo}-"
                f"{unit.hi}: the shard was truncated since the listing. Call refresh()."
            )
        tar = tarfile.open(fileobj=io.BytesIO(span), mode="r:")
        found = _samples(tar, unit.file.url)
        keys = [k.decode() for k in unit.keys]
        if [s[0] for s in found] != keys:
            raise SourceFormatError(
                f"{unit.file.url}: bytes {unit.lo}-{unit.hi} no longer hold samples "
                f"{keys[0]}..{keys[-1]}; the shard changed since the listing. "
                "Call refresh()."
            )
        view = memoryview(span)
        return [
            (
                key,
                {
                    ext: bytes(view[m.offset_data : m.offset_data + m.size])
                    for ext, m in members.items()
                },
            )
            for key, _, _, members in found
        ]

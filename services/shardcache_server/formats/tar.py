"""WebDataset tar shards: members sharing a basename form one sample.

``train/000123.jpg`` and ``train/000123.cls`` are the sample with key
``train/000123``, returned as ``{"jpg": bytes, "cls": bytes}`` (the
WebDataset convention: the key ends at the first dot of the file name).

A tar has no index, so the listing reads each shard once, front to back in
large blocks, to find its members, and keeps the sample keys; a unit is a
run of whole samples. The listing hands each unit's span (its bytes) to
``SourceFile.keep`` as soon as the unit closes, and the store holds it for
that unit's build (``spans.py``), so each byte of a shard is read from the
source once per cluster. A unit whose span was not kept (over the store's
span budget, taken by an earlier build, or lost with the listing store) is
read at build time with one ranged read of its span.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
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


def _members(tar: tarfile.TarFile, url: str) -> Iterator[tuple[str, str, Any, int]]:
    """``(key, extension, member, end of its padded data)`` per file member."""
    try:
        for member in tar:
            if member.isfile():
                key, ext = split_member_name(member.name)
                yield (
                    key,
                    ext,
                    member,
                    member.offset_data + -(-member.size // 512) * 512,
                )
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise SourceFormatError(
            f"{url} is not a valid tar shard (truncated or corrupt): {exc}"
        ) from exc


def _samples(
    tar: tarfile.TarFile, url: str
) -> list[tuple[str, int, int, dict[str, Any]]]:
    """``(key, span start, span end, {ext: member})`` per sample, in tar order."""
    out: list[tuple[str, int, int, dict[str, Any]]] = []
    for key, ext, member, end in _members(tar, url):
        if out and out[-1][0] == key:
            out[-1] = (key, out[-1][1], end, {**out[-1][3], ext: member})
        else:
            out.append((key, member.offset, end, {ext: member}))
    return out


def _sample_spans(tar: tarfile.TarFile, url: str) -> Iterator[tuple[str, int, int]]:
    """``(key, span start, span end)`` per sample, once its last member is read."""
    current: tuple[str, int, int] | None = None
    for key, _, member, end in _members(tar, url):
        if current is not None and current[0] == key:
            current = (key, current[1], end)
            continue
        if current is not None:
            yield current
        current = (key, member.offset, end)
    if current is not None:
        yield current


class _Tee:
    """A forward-only file over ``raw`` read in large blocks, for tarfile's
    stream mode; it keeps the bytes from ``base`` on so a unit's span can be
    handed over when the unit closes (then ``release`` drops them)."""

    def __init__(self, raw: Any, is_keeping: bool):
        self._raw, self._is_keeping = raw, is_keeping
        self._buf = bytearray()
        self._base = 0  # file offset of self._buf[0]
        self._pos = 0  # file offset of the next byte tarfile reads

    def read(self, size: int = -1) -> bytes:
        end = self._base + len(self._buf)
        while size < 0 or end < self._pos + size:
            block = self._raw.read(_BLOCK_BYTES)
            if not block:
                break
            self._buf += block
            end += len(block)
        at = self._pos - self._base
        out = bytes(self._buf[at : at + size] if size >= 0 else self._buf[at:])
        self._pos += len(out)
        if not self._is_keeping:
            self.release(self._pos)
        return out

    def span(self, lo: int, hi: int) -> bytes:
        return bytes(self._buf[lo - self._base : hi - self._base])

    def release(self, upto: int) -> None:
        del self._buf[: upto - self._base]
        self._base = upto


class TarFormat(SourceFormat):
    name = "tar"
    options = ()
    extensions = FORMAT_EXTENSIONS["tar"]
    keeps_spans = True

    def list_file(
        self,
        file: SourceFile,
        options: dict[str, Any],
        chunk_samples: int,
        chunk_bytes: int,
    ) -> tuple[FileUnits, bytes]:
        units = FileUnits(file.url, file.etag, file.size)
        keys: list[bytes] = []
        # Units are cut as samples complete (greedy, in tar order, as a
        # build expects): a unit closes when the next sample would pass
        # chunk_samples or chunk_bytes, and its bytes go to ``file.keep``
        # right then, so one unit (plus a read block) is in memory per file.
        first, lo, hi = 0, -1, -1  # the open unit: its first sample, byte span

        def close(tee: _Tee) -> None:
            units.bounds.append((lo, hi))
            units.samples.append(len(keys) - first)
            units.nbytes.append(hi - lo)
            if file.keep is not None:
                file.keep(lo, hi, tee.span(lo, hi))
                tee.release(hi)

        # No fsspec cache: the tee reads whole blocks, each one ranged GET.
        with file.fs.open(
            file.path, "rb", block_size=_BLOCK_BYTES, cache_type="none"
        ) as raw:
            tee = _Tee(raw, is_keeping=file.keep is not None)
            try:
                tar = tarfile.open(fileobj=tee, mode="r|")
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise SourceFormatError(f"{file.url} is not a tar file: {exc}") from exc
            for key, s_lo, s_hi in _sample_spans(tar, file.url):
                if lo >= 0 and (
                    len(keys) - first >= chunk_samples or s_hi - lo > chunk_bytes
                ):
                    close(tee)
                    first, lo = len(keys), -1
                keys.append(key.encode())
                lo, hi = (s_lo if lo < 0 else lo), s_hi
            if not keys:
                raise SourceFormatError(
                    f"{file.url} is a tar shard with no file members"
                )
            # A complete archive ends with two zero blocks after its last
            # member; tarfile reads a cut-off header as the end, so check it.
            if hi + _END_BLOCKS_BYTES > file.size:
                raise SourceFormatError(
                    f"{file.url} is a truncated tar shard: it ends "
                    f"{file.size - hi} bytes after member {keys[-1].decode()!r}, "
                    "without the end-of-archive blocks. Rewrite the shard."
                )
            close(tee)
        units.keys = keys
        return units, b""

    def read_samples(self, unit: UnitRequest) -> list[tuple[str, Any]]:
        span = (
            unit.file.read([(unit.lo, unit.hi)])[(unit.lo, unit.hi)]
            if unit.data is None
            else unit.data
        )
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

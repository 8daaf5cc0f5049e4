"""Ranged reads of packed files against faults caused at the S3 emulator: a
body cut short is read again, and when it stays short the unit fails with
RemoteFetchError (the store failed), never StaleVersionError (the file
changed); a range past the listed size is the listing's layout not fitting
the file (SourceFormatError); a rewrite is told by S3's 412 status."""

from __future__ import annotations

import numpy as np
import pytest

from shardcache.errors import RemoteFetchError, SourceFormatError, StaleVersionError
from shardcache.source import open_remote
from shardcache_server.emulator import FaultPlan
from shardcache_server.fetch import _is_precondition_failed
from shardcache_server.formats import SourceFile

DATA = bytes(range(256)) * 64  # 16 KiB


def _source(s3, s3fs_client, bucket, data=DATA):
    key = f"{bucket}/r/blob.bin"
    s3fs_client.pipe({key: data})
    info = s3fs_client.info(key)
    url = f"s3://{key}"
    fs, path = open_remote(url, s3.storage_options())
    return SourceFile(fs, path, url, info["ETag"].strip('"'), info["size"])


def _ranges():
    # Runs that do not touch: one GET each.
    return [(i * 1000, i * 1000 + 600) for i in range(12)]


def test_s3_ranges_cut_short_are_read_again(s3, s3fs_client, bucket):
    file = _source(s3, s3fs_client, bucket)
    s3.set_faults(FaultPlan(truncate_rate=0.3, seed=3))
    got = file.read(_ranges())
    assert got == {(lo, hi): DATA[lo:hi] for lo, hi in _ranges()}
    assert s3.total_gets > len(_ranges())  # some were cut and sent again


def test_s3_range_always_cut_short_is_a_fetch_error_not_a_rewrite(
    s3, s3fs_client, bucket
):
    file = _source(s3, s3fs_client, bucket)
    s3.set_faults(FaultPlan(truncate_rate=1.0))
    with pytest.raises(RemoteFetchError, match="blob.bin") as caught:
        file.read([(100, 900)])
    assert not isinstance(caught.value, StaleVersionError)
    assert "400 of the 800 bytes" in str(caught.value)


def test_range_past_the_listed_size_names_the_file_and_the_range(
    s3, s3fs_client, bucket
):
    file = _source(s3, s3fs_client, bucket)
    s3.reset_counts()
    with pytest.raises(SourceFormatError, match=r"blob.bin.*16000-16400.*16384"):
        file.read([(0, 10), (16000, 16400)])
    assert s3.total_gets == 0


def test_s3_rewrite_is_told_by_the_412_status(s3, s3fs_client, bucket):
    file = _source(s3, s3fs_client, bucket)
    s3fs_client.pipe({f"{bucket}/r/blob.bin": DATA[::-1]})
    with pytest.raises(StaleVersionError, match="blob.bin") as caught:
        file.read(_ranges())
    # The code botocore parsed from the response, not the message's words.
    assert _is_precondition_failed(caught.value.__cause__)
    assert not _is_precondition_failed(OSError("pre-conditions did not hold"))


def test_local_ranges_are_cut_from_their_merged_reads(tmp_path):
    path = tmp_path / "rows.bin"
    data = np.arange(4096, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    fs, local = open_remote(str(path))
    from shardcache_server.objects import _version_of

    file = SourceFile(fs, local, str(path), _version_of(fs, fs.info(local)), 4096)
    # Overlapping, touching, repeated and empty ranges, out of order.
    asked = [(900, 1000), (0, 10), (5, 20), (20, 30), (950, 960), (7, 7), (0, 10)]
    assert file.read(asked) == {(a, b): data[a:b] for a, b in asked}

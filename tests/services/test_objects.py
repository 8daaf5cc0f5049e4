from __future__ import annotations

import os

import numpy as np
import pytest

from shardcache.errors import (
    ConfigError,
    EmptyDatasetError,
    SourceNotFound,
    StaleVersionError,
)
from shardcache_server.objects import list_source


def test_list_source_prefix_is_sorted_with_sizes_and_etags(s3, s3fs_client, bucket):
    s3fs_client.pipe(
        {
            f"{bucket}/train/b.bin": b"bb",
            f"{bucket}/train/a.bin": b"a",
            f"{bucket}/other/c.bin": b"ccc",
        }
    )
    s3.reset_counts()
    manifest = list_source(f"s3://{bucket}/train/", s3.storage_options())
    assert manifest.urls() == [
        f"s3://{bucket}/train/a.bin",
        f"s3://{bucket}/train/b.bin",
    ]
    assert manifest.sizes.tolist() == [1, 2]
    # S3 ETag = MD5 for simple PUTs
    assert all(len(manifest.etag(i)) == 32 for i in range(len(manifest)))
    assert s3.total_gets == 0  # one listing, no per-object GET or HEAD


def test_list_source_glob_and_explicit_list(s3, s3fs_client, bucket):
    s3fs_client.pipe(
        {
            f"{bucket}/d/{i}.{ext}": b"x" * i
            for i in range(1, 4)
            for ext in ("jpg", "txt")
        }
    )
    by_glob = list_source(f"s3://{bucket}/d/*.jpg", s3.storage_options())
    assert len(by_glob) == 3
    urls = [f"s3://{bucket}/d/3.txt", f"s3://{bucket}/d/1.txt"]
    by_list = list_source(urls, s3.storage_options())
    assert by_list.urls() == sorted(urls)


def test_a_list_of_prefixes_globs_and_objects_lists_each_in_key_order(
    s3, s3fs_client, bucket
):
    s3fs_client.pipe(
        {
            f"{bucket}/val/b.bin": b"bb",
            f"{bucket}/train/a.bin": b"a",
            f"{bucket}/train/c.bin": b"ccc",
            f"{bucket}/test/x.jpg": b"j",
            f"{bucket}/test/y.txt": b"t",
        }
    )
    opts = s3.storage_options()
    urls = [
        f"s3://{bucket}/val/",
        f"s3://{bucket}/train/",
        f"s3://{bucket}/test/*.jpg",
        f"s3://{bucket}/train/a.bin",  # inside a prefix above: listed once
    ]
    manifest = list_source(urls, opts)
    assert manifest.urls() == [
        f"s3://{bucket}/test/x.jpg",
        f"s3://{bucket}/train/a.bin",
        f"s3://{bucket}/train/c.bin",
        f"s3://{bucket}/val/b.bin",
    ]
    assert manifest.sizes.tolist() == [1, 1, 3, 2]
    # A bucket as an entry is its whole content, as it is alone.
    whole = list_source([f"s3://{bucket}/"], opts)
    assert whole.urls() == list_source(f"s3://{bucket}/", opts).urls()
    with pytest.raises(SourceNotFound, match="nothing-here/' does not exist"):
        list_source([f"s3://{bucket}/train/", f"s3://{bucket}/nothing-here/"], opts)
    with pytest.raises(EmptyDatasetError, match=r"\*.png' in urls lists no objects"):
        list_source([f"s3://{bucket}/train/", f"s3://{bucket}/train/*.png"], opts)
    with pytest.raises(SourceNotFound, match="a prefix in a list ends with '/'"):
        list_source([f"s3://{bucket}/train"], opts)


def test_a_list_of_local_folders_lists_their_files(tmp_path):
    for name in ("a/1.bin", "a/2.bin", "b/3.bin"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    listed = list_source([str(tmp_path / "b"), f"{tmp_path}/a/"])
    assert listed.urls() == [
        str(tmp_path / n) for n in ("a/1.bin", "a/2.bin", "b/3.bin")
    ]


def test_list_source_missing_bucket_names_url_and_fix(s3):
    with pytest.raises(SourceNotFound, match="does not exist"):
        list_source("s3://no-such-bucket-xyz/train/", s3.storage_options())


def test_list_source_missing_local_dir_names_the_path_and_node(tmp_path):
    with pytest.raises(
        SourceNotFound, match=r"local path '.*/nope/' does not exist on"
    ):
        list_source(f"{tmp_path}/nope/")


def test_list_source_missing_prefix_is_not_found(s3, s3fs_client, bucket):
    s3fs_client.pipe({f"{bucket}/real/a": b"a"})
    with pytest.raises(SourceNotFound):
        list_source(f"s3://{bucket}/nothing-here/", s3.storage_options())


def test_list_source_empty_local_dir_is_empty_dataset(tmp_path):
    """The message says the folder is there and empty: the prefix hint of an
    S3 listing would point at nothing (a README trial)."""
    (tmp_path / "sub").mkdir()
    with pytest.raises(EmptyDatasetError, match="directory exists but holds no files"):
        list_source(f"{tmp_path}/")
    with pytest.raises(EmptyDatasetError, match="lists no objects"):
        list_source(f"{tmp_path}/*.npy")


def test_list_source_missing_object_in_list(s3, s3fs_client, bucket):
    s3fs_client.pipe({f"{bucket}/d/a": b"a"})
    with pytest.raises(SourceNotFound, match="do not exist"):
        list_source(
            [f"s3://{bucket}/d/a", f"s3://{bucket}/d/zzz"], s3.storage_options()
        )


@pytest.mark.parametrize("url", ["ftp://host/data/", "http://x/y", "s3://b/../etc/"])
def test_list_source_rejects_unsupported_or_traversal(url):
    with pytest.raises(ConfigError):
        list_source(url)


def test_a_local_rewrite_is_stale_only_on_the_host_that_listed_it(tmp_path):
    """Same size, new bytes, new mtime: stale where the listing was made. On
    another host the same path may be a copy with its own mtimes (copied
    without -t), which is no new version: checked by size only, as before."""
    from shardcache_server.builder import _read_local
    from shardcache_server.objects import LISTED_ON, listed_here

    for i in range(2):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * 8)
    manifest = list_source(f"{tmp_path}/")
    assert listed_here(manifest.columns)
    members = manifest.members(0, 2)
    (tmp_path / "1.bin").write_bytes(b"x" * 8)
    os.utime(tmp_path / "1.bin", (1, 1))  # another mtime, whatever the clock
    ok, stale = _read_local(members, check_versions=True)
    assert ok == bytes([0]) * 8
    assert isinstance(stale, StaleVersionError) and "1.bin" in str(stale)
    assert _read_local(members, check_versions=False)[1] == b"x" * 8
    manifest.columns[LISTED_ON] = np.frombuffer(b"another-host", np.uint8)
    assert not listed_here(manifest.columns)


def test_local_reads_take_one_read_and_read_on_when_a_mount_answers_in_parts(
    tmp_path, monkeypatch
):
    """A local file is read with one read of its listed size (plus a byte);
    a file grown or shrunk since the listing is told, never cut to size; a
    mount that answers in parts (FUSE, NFS: not caused here for real, so
    os.read is made to answer 7 bytes at a time) still reads whole."""
    from shardcache.errors import CorruptObjectError
    from shardcache_server import builder

    sizes = [0, 1, 100, 4096]
    for i, n in enumerate(sizes):
        (tmp_path / f"{i}.bin").write_bytes(
            bytes(range(256)) * (n // 256) + b"z" * (n % 256)
        )
    manifest = list_source(f"{tmp_path}/")
    members = manifest.members(0, len(sizes))
    expected = [(tmp_path / f"{i}.bin").read_bytes() for i in range(len(sizes))]
    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(
        builder.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n)
    )
    assert builder._read_local(members, check_versions=False) == expected
    assert len(reads) == len(sizes)  # one read per file
    monkeypatch.setattr(builder.os, "read", lambda fd, n: real_read(fd, min(n, 7)))
    assert builder._read_local(members, check_versions=False) == expected
    (tmp_path / "2.bin").write_bytes(b"y" * 101)  # grown by a byte
    (tmp_path / "3.bin").write_bytes(b"y" * 10)  # shrunk
    grown, shrunk = builder._read_local(members, check_versions=False)[2:]
    assert isinstance(grown, CorruptObjectError) and "101 bytes" in str(grown)
    assert isinstance(shrunk, CorruptObjectError) and "10 bytes" in str(shrunk)

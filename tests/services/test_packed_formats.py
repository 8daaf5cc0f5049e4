"""Packed formats read in place (files written by tarfile, pyarrow, h5py, lmdb,
numpy): every sample equals its source, bytes are read once, a rewritten
file changes only its own units, and a bad file is a SourceFormatError
naming it."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
from packed_files import (
    parquet_bytes,
    tar_bytes,
    write_hdf5,
    write_lmdb,
    write_npy,
    write_npy_bytes,
)

from shardcache.chunks import Chunk
from shardcache.decoders import as_arrays
from shardcache.errors import ConfigError, EmptyDatasetError, SourceFormatError
from shardcache_server.packed_build import build_unit
from shardcache_server.packed_listing import list_packed
from shardcache_server.spans import SpanKeeper


def _spec(url, fmt, chunk_samples=8, **extra):
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return {
        "name": "t",
        "urls": url,
        "format": fmt,
        "protocol": protocol,
        "chunk_samples": chunk_samples,
        **extra,
    }


def _samples(
    manifest, preprocess=as_arrays, target=None, storage_options=None, spans=None
):
    """Every sample, unit by unit; a unit whose bytes are in ``spans`` (by
    version, as the listing kept them) is built from them."""
    out = []
    items = manifest.chunk_items(range(len(manifest.layout)))
    for c, (_, version, _) in enumerate(items):
        columns, report = build_unit(
            manifest,
            c,
            preprocess,
            target,
            storage_options or {},
            span=(spans or {}).pop(version, None),
        )
        assert report["errors"] == {}
        chunk = Chunk(columns)
        out += [chunk.sample(r) for r in range(len(chunk))]
    return out


def _local_files(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes(25))
    (tmp_path / "b.parquet").write_bytes(parquet_bytes(30, row_group=7))
    write_hdf5(tmp_path / "c.h5", 20)
    write_lmdb(tmp_path / "e.lmdb", 15)
    write_npy(tmp_path / "f.npy", 50)
    return tmp_path


def test_tar_samples_are_dicts_of_member_bytes_keyed_by_extension(tmp_path):
    _local_files(tmp_path)
    manifest = list_packed(_spec(str(tmp_path / "a.tar"), "tar"), None)
    assert len(manifest) == 25 and len(manifest.layout) == 4
    samples = _samples(manifest)
    for i, s in enumerate(samples):
        assert (
            bytes(s["bin"]) == bytes([i]) * 100 and bytes(s["cls"]) == str(i).encode()
        )
    assert manifest.url(3).endswith("a.tar#train/000003")


def test_parquet_rows_keep_numeric_dtypes_and_columns_are_selectable(tmp_path):
    _local_files(tmp_path)
    url = str(tmp_path / "b.parquet")
    samples = _samples(list_packed(_spec(url, "parquet"), None))
    assert [int(s["id"]) for s in samples] == list(range(30))
    assert all(
        s["x"].dtype == np.float32 and float(s["x"]) == 2 * i
        for i, s in enumerate(samples)
    )
    assert bytes(samples[4]["text"]) == b"row-4"
    # Numeric columns only: the fast path stacks the row group's columns.
    manifest = list_packed(
        _spec(url, "parquet", format_options={"columns": ["id"]}), None
    )
    columns, _ = build_unit(manifest, 1, as_arrays, None, {})
    assert columns["id"].tolist() == list(range(7, 14))  # one row group per unit
    with pytest.raises(SourceFormatError, match="no column"):
        list_packed(_spec(url, "parquet", format_options={"columns": ["nope"]}), None)


@pytest.mark.parametrize(
    "name, fmt, options, match",
    [
        ("b.parquet", "parquet", {"colums": ["id"]}, "did you mean 'columns'"),
        ("b.parquet", "parquet", {"columns": "id"}, "must be a list of names"),
        ("c.h5", "hdf5", {"dataset": ["x"]}, "did you mean 'datasets'"),
        ("a.tar", "tar", {"columns": ["x"]}, "it takes none"),
    ],
)
def test_format_options_it_does_not_read_are_named_before_listing(
    tmp_path, name, fmt, options, match
):
    # A misspelled key was ignored (every column came back) and a string was
    # taken letter by letter ("no column(s) ['i', 'd']").
    _local_files(tmp_path)
    with pytest.raises(ConfigError, match=match):
        list_packed(_spec(str(tmp_path / name), fmt, format_options=options), None)


def test_a_format_that_matches_no_file_names_what_the_source_holds(tmp_path):
    _local_files(tmp_path)
    with pytest.raises(EmptyDatasetError, match=r"no hdf5 files .*such as '.*f\.npy'"):
        list_packed(_spec(str(tmp_path / "f.npy"), "hdf5"), None)


def test_hdf5_npy_and_lmdb_rows_equal_the_source(tmp_path):
    _local_files(tmp_path)
    h5 = _samples(list_packed(_spec(str(tmp_path / "c.h5"), "hdf5"), None))
    assert [s["x"].tolist() for s in h5] == np.arange(80).reshape(20, 4).tolist()
    assert [int(s["y"]) for s in h5] == list(range(20))
    only_y = list_packed(
        _spec(str(tmp_path / "c.h5"), "hdf5", format_options={"datasets": ["y"]}), None
    )
    assert [int(s) for s in _samples(only_y)] == list(range(20))
    npy = _samples(list_packed(_spec(str(tmp_path / "f.npy"), "npy"), None))
    assert np.array_equal(np.stack(npy), np.arange(150, dtype=np.int32).reshape(50, 3))
    write_npy_bytes(tmp_path / "g.npy", 20)  # dtype "|u1": a byte-order-free header
    rows = _samples(list_packed(_spec(str(tmp_path / "g.npy"), "npy"), None))
    assert np.stack(rows).tolist() == (np.arange(100) % 251).reshape(20, 5).tolist()
    db = list_packed(_spec(str(tmp_path / "e.lmdb"), "lmdb"), None)
    assert [bytes(s) for s in _samples(db)] == [
        f"value-{i}".encode() for i in range(15)
    ]
    assert db.url(2).endswith("e.lmdb#key-000002")


def test_preprocess_and_target_receive_the_sample_key(tmp_path):
    _local_files(tmp_path)
    manifest = list_packed(_spec(str(tmp_path / "a.tar"), "tar"), None)

    def label(sample, key):
        return np.array([int(bytes(sample["cls"])), int(key.rsplit("/", 1)[-1])])

    samples = _samples(manifest, preprocess=label)
    assert all(s.tolist() == [i, i] for i, s in enumerate(samples))
    columns, _ = build_unit(
        manifest, 0, as_arrays, lambda key: int(key.rsplit("/", 1)[-1]), {}
    )
    assert columns["__target__"].tolist() == list(range(8))


def test_bad_files_are_source_format_errors_naming_the_file(tmp_path):
    data = tar_bytes(10, payload=2000)
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2 + 100])
    with pytest.raises(SourceFormatError, match="cut.tar"):
        list_packed(_spec(str(tmp_path / "cut.tar"), "tar"), None)
    good = parquet_bytes(10, row_group=5)
    (tmp_path / "bad.parquet").write_bytes(good[:-30] + b"\0" * 26 + b"PAR1")
    with pytest.raises(SourceFormatError, match="bad.parquet"):
        list_packed(_spec(str(tmp_path / "bad.parquet"), "parquet"), None)
    write_hdf5(tmp_path / "c.h5", 5)
    with pytest.raises(SourceFormatError, match=r"c\.h5 has no dataset.*'missing'"):
        list_packed(
            _spec(
                str(tmp_path / "c.h5"), "hdf5", format_options={"datasets": ["missing"]}
            ),
            None,
        )
    (tmp_path / "fake.lmdb").mkdir()
    (tmp_path / "fake.lmdb" / "data.mdb").write_bytes(b"this is not a database" * 100)
    with pytest.raises(SourceFormatError, match="fake.lmdb"):
        list_packed(_spec(str(tmp_path / "fake.lmdb"), "lmdb"), None)
    with pytest.raises(ConfigError, match="unknown format 'zip'"):
        list_packed(_spec(str(tmp_path / "c.h5"), "zip"), None)


def test_rewritten_file_changes_only_its_own_units(tmp_path):
    for i in range(3):
        (tmp_path / f"s{i}.tar").write_bytes(tar_bytes(10, start=10 * i))
    spec = _spec(str(tmp_path / "*.tar"), "tar", chunk_samples=5)
    before = list_packed(spec, None)
    (tmp_path / "s1.tar").write_bytes(tar_bytes(10, start=10, payload=101))
    after = list_packed(spec, before)
    changed = np.flatnonzero(
        before.chunk_versions(before.layout) != after.chunk_versions(after.layout)
    )
    assert changed.tolist() == [2, 3]  # s1.tar's two units, nothing else
    assert after.changed_files(before) == [str(tmp_path / "s1.tar")]


def test_s3_parquet_and_npy_read_each_byte_at_most_once(s3, s3fs_client, bucket):
    data = parquet_bytes(40, row_group=10)
    rows = io.BytesIO()
    np.save(rows, np.arange(600, dtype=np.int32).reshape(200, 3))
    s3fs_client.pipe(
        {f"{bucket}/pq/p0.parquet": data, f"{bucket}/n/a.npy": rows.getvalue()}
    )
    options = s3.storage_options()
    s3.reset_counts()
    pq = list_packed(
        _spec(
            f"s3://{bucket}/pq/", "parquet", chunk_samples=10, storage_options=options
        ),
        None,
    )
    # The footer's length, then exactly the footer: no row group byte.
    assert s3.total_gets == 2
    footer_bytes = s3.total_get_bytes
    assert footer_bytes == int.from_bytes(data[-8:-4], "little") + 8
    assert [int(s["id"]) for s in _samples(pq, storage_options=options)] == list(
        range(40)
    )
    # One ranged read per unit (a row group); the footer came with the
    # manifest. Every byte once, except the leading magic, which nothing needs.
    assert s3.total_gets - 2 == len(pq.layout) == 4
    assert s3.total_get_bytes == len(data) - 4
    s3.reset_counts()
    npy = list_packed(_spec(f"s3://{bucket}/n/", "npy", storage_options=options), None)
    header = s3.total_get_bytes  # the prefix, then the rest of the header
    assert s3.total_gets == 2 and header == json.loads(npy.file_meta(0))["offset"]
    assert np.stack(_samples(npy, storage_options=options)).ravel().tolist() == list(
        range(600)
    )
    assert s3.total_get_bytes == len(rows.getvalue())


def test_s3_tar_listing_keeps_each_unit_so_builds_read_nothing(s3, s3fs_client, bucket):
    shards = {f"{bucket}/tar/s{k}.tar": tar_bytes(20, start=20 * k) for k in (0, 1)}
    s3fs_client.pipe(shards)
    size = sum(len(v) for v in shards.values())
    options = s3.storage_options()
    spec = _spec(f"s3://{bucket}/tar/", "tar", storage_options=options)
    s3.reset_counts()
    kept: dict[str, np.ndarray] = {}
    keeper = SpanKeeper(size, kept.__setitem__, {})
    tar = list_packed(spec, None, keeper)
    # One pass over each shard, in large blocks (one GET each here).
    assert s3.total_get_bytes == size and s3.total_gets == 2
    assert keeper.report() == {
        "kept": len(tar.layout),
        "kept_bytes": int(tar.columns["unit_bytes"].sum()),
        "over": 0,
        "over_bytes": 0,
    }
    versions = [v for _, v, _ in tar.chunk_items(range(len(tar.layout)))]
    assert sorted(kept) == sorted(versions)
    _, report = build_unit(tar, 0, as_arrays, None, options, span=kept[versions[0]])
    # Counted once, as the unit's source bytes (the listing read them for it).
    assert report["reads"] == 1
    assert report["bytes_read"] == tar.columns["unit_bytes"][0]
    samples = _samples(tar, storage_options=options, spans=kept)
    assert [bytes(s["cls"]) for s in samples] == [str(i).encode() for i in range(40)]
    assert not kept
    assert s3.total_gets == 2 and s3.total_get_bytes == size  # builds read nothing

    # Over the budget: units not kept are read again, one ranged read each.
    s3.reset_counts()
    small = SpanKeeper(int(tar.columns["unit_bytes"][0]), kept.__setitem__, {})
    again = list_packed(spec, None, small)
    assert small.report()["kept"] == 1 and small.report()["over"] == len(tar.layout) - 1
    assert len(_samples(again, storage_options=options, spans=kept)) == 40
    assert s3.total_gets == 2 + len(tar.layout) - 1  # the kept unit is not read
    assert s3.total_get_bytes == size + int(tar.columns["unit_bytes"][1:].sum())


def test_lmdb_and_hdf5_files_that_vanish_fail_the_build_with_the_file_named(tmp_path):
    write_lmdb(tmp_path / "e.lmdb", 6)
    manifest = list_packed(_spec(str(tmp_path / "e.lmdb"), "lmdb"), None)
    shutil.rmtree(tmp_path / "e.lmdb")
    columns, report = build_unit(manifest, 0, as_arrays, None, {})
    assert Chunk(columns).failed.all()
    assert all(kind == "SourceFormatError" for kind, _ in report["errors"].values())
    assert "e.lmdb" in report["errors"]["0"][1]


def test_hdf5_unit_reads_its_chunks_without_copying_the_chunk_table(tmp_path):
    import tracemalloc

    import h5py

    from shardcache.source import open_remote
    from shardcache_server.formats import SourceFile, UnitRequest, get_format

    # 20000 one-row chunks: a chunk table of 20000 x 5 int64 (800 kB).
    x = np.arange(20000 * 8, dtype=np.float32).reshape(20000, 8)
    with h5py.File(tmp_path / "rows.h5", "w") as h5:
        h5.create_dataset("x", data=x, chunks=(1, 8))
    url = str(tmp_path / "rows.h5")
    fs, path = open_remote(url)
    from shardcache_server.objects import _version_of

    file = SourceFile(fs, path, url, _version_of(fs, fs.info(path)), fs.size(path))
    fmt = get_format("hdf5")
    units, meta = fmt.list_file(file, {}, 64, 2**20)
    assert len(meta) > 20000 * 5 * 8
    lo, hi = units.bounds[200]
    unit = UnitRequest(file, lo, hi, [], meta, {})
    tracemalloc.start()
    try:
        slab = fmt.read_columns(unit)["_"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(slab, x[lo:hi])
    assert peak < 200_000, peak  # the unit's 64 chunks, not the file's 20000

"""Bytes each packed format reads from S3, counted at the emulator: the listing
and every unit's build together read at most 1.05x the file (each byte
once, plus the few metadata bytes the build never needs again), at the
default chunk size and at ``chunk_samples=512``, with every sample equal to
what the format's own library reads. A file rewritten after the listing is
never read as a mix of two versions: its units fail with StaleVersionError.
Keys hold spaces, unicode and ``%``."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile

import numpy as np
import pytest
from packed_files import hdf5_bytes, lmdb_dir, parquet_bytes, tar_bytes

from shardcache.chunks import Chunk
from shardcache.decoders import as_arrays
from shardcache.errors import StaleVersionError
from shardcache_server.packed_build import build_unit
from shardcache_server.packed_listing import list_packed
from shardcache_server.spans import SpanKeeper

ROWS = 2048
ODD = "data set/ünï %41 key"  # a space, unicode and a literal %41 in the key
MAX_RATIO = 1.05


def _spec(url, fmt, chunk_samples, options, **extra):
    spec = {"name": "t", "urls": url, "format": fmt, "protocol": "s3"}
    if chunk_samples:
        spec["chunk_samples"] = chunk_samples
    return {**spec, "storage_options": options, **extra}


def _build_all(manifest, options, spans=None):
    """Every sample, unit by unit; a unit whose bytes the listing kept (tar,
    by unit version, as a store holds them) is built from them."""
    out = []
    items = manifest.chunk_items(range(len(manifest.layout)))
    for c, (_, version, _) in enumerate(items):
        span = (spans or {}).pop(version, None)
        columns, report = build_unit(manifest, c, as_arrays, None, options, span=span)
        assert report["errors"] == {}, next(iter(report["errors"].values()))
        chunk = Chunk(columns)
        out += [chunk.sample(r) for r in range(len(chunk))]
    return out


def _hdf5_reference(data):
    import h5py

    with h5py.File(io.BytesIO(data), "r") as h5:
        return h5["x"][()], h5["y"][()]


def _files(fmt, tmp_path):
    """``{key suffix: bytes}``, the URL to list, and a check of the samples
    against the format's own reader."""
    if fmt.startswith("hdf5-"):
        data = hdf5_bytes(ROWS, fmt.split("-", 1)[1])
        x, y = _hdf5_reference(data)

        def check(samples):
            assert np.array_equal(np.stack([s["x"] for s in samples]), x)
            assert [int(s["y"]) for s in samples] == y.tolist()

        return {"f.h5": data}, "f.h5", "hdf5", check
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # Several row groups, one of them larger than 512 rows.
        files = {
            "p0.parquet": parquet_bytes(1024, row_group=300),
            "p1.parquet": parquet_bytes(1024, row_group=1024, start=1024),
        }
        table = pa.concat_tables(
            pq.read_table(pa.BufferReader(files[k])) for k in sorted(files)
        ).to_pydict()

        def check(samples):
            assert [int(s["id"]) for s in samples] == table["id"]
            assert [float(s["x"]) for s in samples] == table["x"]
            assert [bytes(s["text"]).decode() for s in samples] == table["text"]

        return files, "", "parquet", check
    if fmt == "tar":
        files = {
            f"s{k}.tar": tar_bytes(ROWS // 4, start=k * ROWS // 4) for k in range(4)
        }
        members = {}
        for k in sorted(files):
            with tarfile.open(fileobj=io.BytesIO(files[k])) as tar:
                for m in tar.getmembers():
                    members[m.name] = tar.extractfile(m).read()

        def check(samples):
            for i, s in enumerate(samples):
                assert bytes(s["bin"]) == members[f"train/{i:06d}.bin"]
                assert bytes(s["cls"]) == members[f"train/{i:06d}.cls"]

        return files, "", "tar", check
    if fmt == "npy":
        rows = np.arange(ROWS * 24, dtype=np.float32).reshape(ROWS, 24)
        out = io.BytesIO()
        np.save(out, rows)
        return (
            {"rows.npy": out.getvalue()},
            "rows.npy",
            "npy",
            lambda samples: np.testing.assert_array_equal(np.stack(samples), rows),
        )
    assert fmt == "lmdb"
    import lmdb

    path = lmdb_dir(tmp_path / "db.lmdb", ROWS)
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        values = [v for _, v in txn.cursor()]
    env.close()

    def check(samples):
        assert [bytes(s) for s in samples] == values

    return (
        {"db.lmdb/data.mdb": (path / "data.mdb").read_bytes()},
        "db.lmdb",
        "lmdb",
        check,
    )


FORMATS = [
    "hdf5-contiguous",
    "hdf5-rows",
    "hdf5-gzip",
    "hdf5-tiles",
    "parquet",
    "tar",
    "npy",
    "lmdb",
]


@pytest.mark.parametrize("chunk_samples", [None, 512], ids=["default", "512"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_s3_format_reads_each_byte_once(
    fmt, chunk_samples, s3, s3fs_client, bucket, tmp_path, monkeypatch
):
    # LMDB's per-node copy goes to this test's own temporary directory.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    files, target, name, check = _files(fmt, tmp_path)
    s3fs_client.pipe({f"{bucket}/{ODD}/{k}": v for k, v in files.items()})
    options = s3.storage_options()
    s3.reset_counts()
    # What a store gives its listing: room for the units a listing reads
    # whole (tar; spans.py), here all of them.
    spans: dict[str, np.ndarray] = {}
    keeper = SpanKeeper(sum(map(len, files.values())), spans.__setitem__, {})
    manifest = list_packed(
        _spec(f"s3://{bucket}/{ODD}/{target}", name, chunk_samples, options),
        None,
        keeper,
    )
    samples = _build_all(manifest, options, spans)
    assert len(samples) == ROWS
    check(samples)
    file_bytes = sum(len(v) for v in files.values())
    ratio = s3.total_get_bytes / file_bytes
    assert ratio <= MAX_RATIO, (ratio, s3.total_gets, len(manifest.layout))
    if chunk_samples == 512 and name != "parquet":
        # Units are as asked (Parquet's are whole row groups instead).
        assert len(manifest.layout) >= ROWS // 512


def test_s3_packed_reads_take_the_source_budget_and_halve_it_on_503(
    s3, s3fs_client, bucket, redis_url, redis, tmp_path
):
    # The ranged GETs of packed files draw on the source's request budget
    # (source_rps) as the LISTs and per-object GETs do: every attempt takes
    # a token, and a 503 SlowDown halves the shared rate instead of being
    # sent again unseen underneath (s3fs, botocore).
    import time

    from shardcache.index import RedisIndex
    from shardcache_server.budget import RequestBudget
    from shardcache_server.emulator import FaultPlan

    files, target, name, check = _files("parquet", tmp_path)
    s3fs_client.pipe({f"{bucket}/{ODD}/{k}": v for k, v in files.items()})
    options = s3.storage_options()
    url = f"s3://{bucket}/{ODD}/{target}"
    manifest = list_packed(_spec(url, name, 512, options), None, None)
    s3.reset_counts()
    check(_build_all(manifest, options))
    clean_gets = s3.total_gets
    # A ceiling of 1 request/s with a burst of 1,000: nothing waits, and the
    # bucket refills by at most one token per second of reading.
    budget = RequestBudget(RedisIndex.from_url(redis_url, "packedbudget"), 1.0, 1000)
    s3.reset_counts()
    s3.set_faults(FaultPlan(error_rate=0.25, error_status=503, seed=11))
    started = time.monotonic()
    samples = []
    for c in range(len(manifest.layout)):
        columns, report = build_unit(
            manifest, c, as_arrays, None, options, budget=budget
        )
        assert report["errors"] == {}, next(iter(report["errors"].values()))
        chunk = Chunk(columns)
        samples += [chunk.sample(r) for r in range(len(chunk))]
    refilled = time.monotonic() - started + 1
    s3.set_faults(FaultPlan())
    check(samples)
    assert s3.total_gets > clean_gets  # some GETs were answered 503, sent again
    tokens = float(redis.hget(budget.key(url), "tokens"))
    assert tokens <= 1000 - s3.total_gets + refilled  # each attempt took a token
    assert budget.current_rate(url) < 1.0  # the 503s throttled the source


def test_parquet_row_groups_are_never_split_below_chunk_bytes(s3, s3fs_client, bucket):
    s3fs_client.pipe({f"{bucket}/{ODD}/p.parquet": parquet_bytes(1024, row_group=300)})
    options = s3.storage_options()
    url = f"s3://{bucket}/{ODD}/p.parquet"
    joined = list_packed(_spec(url, "parquet", 700, options), None)
    # 300 + 300 join (600 <= 700); 300 + 124 join; nothing splits a group.
    assert [tuple(b) for b in joined.columns["unit_bounds"]] == [(0, 600), (600, 1024)]
    small = list_packed(_spec(url, "parquet", 100, options), None)
    assert [tuple(b) for b in small.columns["unit_bounds"]] == [
        (0, 300),
        (300, 600),
        (600, 900),
        (900, 1024),
    ]
    # A group larger than chunk_bytes is split (each piece reads the group).
    split = list_packed(_spec(url, "parquet", 100, options, chunk_bytes=1000), None)
    starts = split.layout.starts.tolist()
    assert len(starts) - 1 > 4 and {300, 600, 900} <= set(starts)
    # A unit of several groups reads only the chosen columns' chunks, which
    # do not touch (another column's chunks lie between them).
    some = list_packed(
        _spec(url, "parquet", 700, options, format_options={"columns": ["id", "text"]}),
        None,
    )
    s3.reset_counts()
    rows = _build_all(some, options)
    assert [int(r["id"]) for r in rows] == list(range(1024))
    assert bytes(rows[5]["text"]) == b"row-5" and "x" not in rows[0]
    assert s3.total_get_bytes == some.total_bytes
    assert [int(s["id"]) for s in _build_all(split, options)] == list(range(1024))


@pytest.mark.parametrize("fmt", ["hdf5-gzip", "parquet", "npy", "tar"])
def test_s3_file_rewritten_after_listing_fails_its_units_stale(
    fmt, s3, s3fs_client, bucket, tmp_path
):
    files, target, name, _ = _files(fmt, tmp_path)
    s3fs_client.pipe({f"{bucket}/{ODD}/{k}": v for k, v in files.items()})
    options = s3.storage_options()
    manifest = list_packed(
        _spec(f"s3://{bucket}/{ODD}/{target}", name, 512, options), None
    )
    first = sorted(files)[0]
    data = files[first]
    # Same length, other bytes: only the version tells the two apart.
    s3fs_client.pipe({f"{bucket}/{ODD}/{first}": data[:-1] + bytes([data[-1] ^ 1])})
    _, report = build_unit(manifest, 0, as_arrays, None, options)
    kinds = {kind for kind, _ in report["errors"].values()}
    assert kinds == {"StaleVersionError"}, report["errors"]["0"]
    assert "refresh()" in report["errors"]["0"][1]


def test_local_file_rewritten_after_listing_raises_stale(tmp_path):
    from shardcache.source import open_remote
    from shardcache_server.formats import SourceFile

    path = tmp_path / "rows.npy"
    np.save(path, np.zeros((10, 2), np.float32))
    manifest = list_packed(
        {"name": "t", "urls": str(path), "format": "npy", "protocol": "file"}, None
    )
    url, etag, size = manifest.file(0)
    np.save(path, np.ones((10, 2), np.float32))  # same size
    os.utime(path, ns=(10**9, 10**9))  # a new mtime even within one clock tick
    fs, local = open_remote(url)
    with pytest.raises(StaleVersionError, match="rows.npy.*refresh"):
        SourceFile(fs, local, url, etag, size).read([(0, 16)])


def _pipe_table(s3fs_client, key, table, **write):
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(table, out, **write)
    s3fs_client.pipe({key: out.getvalue()})
    return out.getvalue()


def test_parquet_dotted_column_names_read_their_own_column_chunks(
    s3, s3fs_client, bucket
):
    import pyarrow as pa

    # "f.x" (a column) and "f" (a struct with child x) have the same
    # path_in_schema, "f.x": only the schema's order tells them apart.
    table = pa.table(
        {
            "f.x": np.arange(50, dtype=np.int64),
            "f": pa.array([{"x": -i} for i in range(50)]),
            "y": np.arange(50, dtype=np.float32) / 2,
        }
    )
    _pipe_table(s3fs_client, f"{bucket}/d/p.parquet", table, row_group_size=20)
    options = s3.storage_options()
    for columns in (["f.x", "y"], ["f.x"], ["f"]):
        manifest = list_packed(
            _spec(
                f"s3://{bucket}/d/p.parquet",
                "parquet",
                20,
                options,
                format_options={"columns": columns},
            ),
            None,
        )
        s3.reset_counts()
        rows = []
        for c in range(len(manifest.layout)):
            columns_, report = build_unit(manifest, c, _unnest, None, options)
            assert report["errors"] == {}, next(iter(report["errors"].values()))
            chunk = Chunk(columns_)
            rows += [chunk.sample(r) for r in range(len(chunk))]
        assert s3.total_get_bytes == manifest.total_bytes, columns
        assert sorted(rows[7]) == sorted(columns)
        if "f.x" in columns:
            assert [int(r["f.x"]) for r in rows] == list(range(50))
        if "f" in columns:
            assert [int(r["f"]) for r in rows] == [-i for i in range(50)]


def _unnest(row):
    """A struct cell's ``x``, every other value as it is, as arrays."""
    return {k: np.asarray(v["x"] if isinstance(v, dict) else v) for k, v in row.items()}


def test_parquet_unit_with_nulls_reads_its_bytes_once(s3, s3fs_client, bucket):
    import pyarrow as pa

    # A null makes the column path give up; the per-row path reuses its
    # table (whose None the default preprocess then refuses, by name).
    x = pa.array([None if i % 7 == 0 else float(i) for i in range(64)], pa.float64())
    table = pa.table({"id": np.arange(64), "x": x})
    _pipe_table(s3fs_client, f"{bucket}/n/p.parquet", table, row_group_size=16)
    options = s3.storage_options()
    manifest = list_packed(
        _spec(f"s3://{bucket}/n/p.parquet", "parquet", 16, options), None
    )
    s3.reset_counts()
    _, report = build_unit(manifest, 0, as_arrays, None, options)
    assert set(report["errors"]) == {"0", "7", "14"}, report["errors"]
    assert "'x'" in report["errors"]["7"][1]
    assert s3.total_gets == 1
    assert s3.total_get_bytes == manifest.chunk_source_bytes(0)
    kept = build_unit(
        manifest, 1, lambda row: np.array([row["x"] or -1.0]), None, options
    )
    assert kept[1]["errors"] == {} and s3.total_gets == 2


def test_parquet_row_group_of_few_huge_rows_is_split_by_chunk_bytes(
    s3, s3fs_client, bucket
):
    import pyarrow as pa

    # 40 rows of 50 kB in one group: few rows, but 2 MB against 256 kB units.
    blobs = [bytes([i]) * 50_000 for i in range(40)]
    table = pa.table({"id": np.arange(40), "blob": blobs})
    _pipe_table(s3fs_client, f"{bucket}/h/p.parquet", table, compression="none")
    options = s3.storage_options()
    manifest = list_packed(
        _spec(
            f"s3://{bucket}/h/p.parquet",
            "parquet",
            None,
            options,
            chunk_bytes=256 * 2**10,
        ),
        None,
    )
    assert len(manifest.layout) >= 7
    rows = _build_all(manifest, options)
    assert [bytes(r["blob"]) for r in rows] == blobs


def test_parquet_file_rewritten_before_its_listing_read_is_stale(
    s3, s3fs_client, bucket
):
    from shardcache_server.formats import SourceFile, get_format

    key = f"{bucket}/r/p.parquet"
    s3fs_client.pipe({key: parquet_bytes(100, row_group=10)})
    info = s3fs_client.info(key)
    etag, size = info["ETag"].strip('"'), info["size"]
    # Rewritten between the source listing and the footer read: the footer
    # of the new file must not be kept under the old ETag.
    s3fs_client.pipe({key: parquet_bytes(100, row_group=50)})
    fs = type(s3fs_client)(skip_instance_cache=True, **s3.storage_options())
    url = f"s3://{key}"
    with pytest.raises(StaleVersionError, match="p.parquet"):
        get_format("parquet").list_file(
            SourceFile(fs, key, url, etag, size), {}, 10, 2**20
        )


def _lmdb_copies(tmp_path):
    return sorted(p.name for p in (tmp_path / "shardcache-lmdb").iterdir())


def test_s3_single_file_lmdb_is_read_from_its_own_key(
    s3, s3fs_client, bucket, tmp_path, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node"))
    (tmp_path / "node").mkdir()
    path = lmdb_dir(tmp_path / "db", 300)
    # One object named like a directory: the data.mdb pages themselves.
    s3fs_client.pipe({f"{bucket}/one/db.lmdb": (path / "data.mdb").read_bytes()})
    options = s3.storage_options()
    manifest = list_packed(
        _spec(f"s3://{bucket}/one/db.lmdb", "lmdb", 100, options), None
    )
    rows = _build_all(manifest, options)
    assert [bytes(r) for r in rows] == [bytes([i % 256]) * 200 for i in range(300)]


def test_s3_lmdb_download_that_fails_leaves_nothing_and_old_copies_go(
    s3, s3fs_client, bucket, tmp_path, monkeypatch
):
    from shardcache.errors import ConfigError, RemoteFetchError
    from shardcache_server.emulator import FaultPlan
    from shardcache_server.formats import SourceFile, get_format

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    key = f"{bucket}/db.lmdb/data.mdb"
    s3fs_client.pipe({key: (lmdb_dir(tmp_path / "v1", 50) / "data.mdb").read_bytes()})
    options = s3.storage_options()
    spec = _spec(f"s3://{bucket}/db.lmdb", "lmdb", 10, options)
    s3.set_faults(FaultPlan(truncate_rate=1.0))
    with pytest.raises(RemoteFetchError):
        list_packed(spec, None)
    assert _lmdb_copies(tmp_path) == [_lock_name(tmp_path)]  # no .part left
    s3.set_faults(FaultPlan())
    first = list_packed(spec, None)
    assert len(_build_all(first, options)) == 50
    (old,) = [n for n in _lmdb_copies(tmp_path) if not n.endswith(".lock")]
    # A newer version replaces the copy, and a part a killed download left.
    (tmp_path / "shardcache-lmdb" / f"{old}.part999999").mkdir()
    s3fs_client.pipe({key: (lmdb_dir(tmp_path / "v2", 70) / "data.mdb").read_bytes()})
    second = list_packed(spec, first)
    assert len(_build_all(second, options)) == 70
    copies = [n for n in _lmdb_copies(tmp_path) if not n.endswith(".lock")]
    assert len(copies) == 1 and copies != [old]
    # A node without room for the copy says which directory to change.
    url, etag, size = second.file(0)
    fs, path = type(s3fs_client)(skip_instance_cache=True, **options), key[:-9]
    huge = SourceFile(fs, path, url, "other", 2**62)
    with pytest.raises(ConfigError, match="TMPDIR"):
        get_format("lmdb").list_file(huge, {}, 10, 2**20)


def _lock_name(tmp_path):
    (lock,) = [n for n in _lmdb_copies(tmp_path) if n.endswith(".lock")]
    return lock

"""Bytes each packed format reads from S3, per byte of the file.

    .venv/bin/python bench/formats.py            # or: scripts/bench.sh formats

Writes one file (or a few, for tar and Parquet) of ``--samples`` samples per
format with the format's own library into the project's S3 emulator, then
runs what the stores run for a dataset: the listing (``list_packed``, with
room to keep the units a listing reads whole, as a store gives it) and the
build of every unit (``build_unit``), once at the default chunk size and
once at ``--chunk-samples``. Bytes and GET requests are counted at the
emulator, the listing's included; every sample is compared with the
format's own reader. Prints the table and, with ``--write``, puts it in
BENCHMARKS.md under its own heading.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "sdk"), str(ROOT / "services")]

HEADING = "## Packed formats over S3: bytes read per file byte"
KEY_PREFIX = "bench formats/ünï %41"  # a space, unicode and % in every key


def _hdf5(samples: int, width: int, layout: str) -> dict[str, bytes]:
    import h5py

    x = np.random.default_rng(0).random((samples, width), dtype=np.float32)
    if layout == "gzip+shuffle":
        x = np.round(x, 1)  # compressible
    kwargs = {
        "contiguous": {},
        "chunk per row": {"chunks": (1, width)},
        "gzip+shuffle": {"chunks": (64, width), "compression": "gzip", "shuffle": True},
    }[layout]
    out = io.BytesIO()
    with h5py.File(out, "w") as h5:
        h5.create_dataset("x", data=x, **kwargs)
        h5.create_dataset("y", data=np.arange(samples))
    return {"f.h5": out.getvalue()}


def _parquet(samples: int, width: int) -> dict[str, bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    for k in range(2):  # one file of several row groups, one of a single group
        ids = np.arange(k * samples // 2, (k + 1) * samples // 2)
        table = pa.table(
            {
                "id": ids,
                "x": pa.FixedSizeListArray.from_arrays(
                    np.random.default_rng(k).random(len(ids) * width, np.float32),
                    width,
                ),
            }
        )
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=300 if k == 0 else len(ids))
        out[f"p{k}.parquet"] = buf.getvalue()
    return out


def _tar(samples: int, width: int) -> dict[str, bytes]:
    out = {}
    per = samples // 4
    for k in range(4):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(k * per, (k + 1) * per):
                for ext, data in (("bin", bytes([i % 256]) * width * 4), ("cls", b"1")):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        out[f"s{k}.tar"] = buf.getvalue()
    return out


def _npy(samples: int, width: int) -> dict[str, bytes]:
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(0).random((samples, width), dtype=np.float32))
    return {"rows.npy": buf.getvalue()}


def _lmdb(samples: int, width: int) -> dict[str, bytes]:
    import lmdb

    with tempfile.TemporaryDirectory() as tmp:
        env = lmdb.open(tmp, map_size=2**30)
        with env.begin(write=True) as txn:
            for i in range(samples):
                txn.put(f"{i:08d}".encode(), bytes([i % 256]) * width * 4)
        env.close()
        return {"db.lmdb/data.mdb": (Path(tmp) / "data.mdb").read_bytes()}


CASES: list[tuple[str, str, str, Any]] = [
    # (label, format, URL suffix, writer)
    ("HDF5 contiguous", "hdf5", "f.h5", lambda n, w: _hdf5(n, w, "contiguous")),
    ("HDF5 chunk per row", "hdf5", "f.h5", lambda n, w: _hdf5(n, w, "chunk per row")),
    (
        "HDF5 gzip+shuffle chunks",
        "hdf5",
        "f.h5",
        lambda n, w: _hdf5(n, w, "gzip+shuffle"),
    ),
    ("Parquet (2 files, row groups 300 and 1024)", "parquet", "", _parquet),
    ("tar (4 shards)", "tar", "", _tar),
    (".npy", "npy", "rows.npy", _npy),
    ("LMDB (downloaded once per node)", "lmdb", "db.lmdb", _lmdb),
]


def _run_case(
    emu: Any, fs: Any, bucket: str, case: tuple, samples: int, width: int, cs: int
) -> dict[str, Any]:
    from shardcache.chunks import Chunk
    from shardcache.decoders import as_arrays
    from shardcache_server.packed_build import build_unit
    from shardcache_server.packed_listing import list_packed
    from shardcache_server.spans import SpanKeeper

    label, fmt, suffix, write = case
    files = write(samples, width)
    prefix = f"{bucket}/{KEY_PREFIX}/{fmt}-{cs}"
    fs.pipe({f"{prefix}/{k}": v for k, v in files.items()})
    options = emu.storage_options()
    spec = {
        "name": "bench",
        "urls": f"s3://{prefix}/{suffix}",
        "format": fmt,
        "protocol": "s3",
        "storage_options": options,
    }
    if cs:
        spec["chunk_samples"] = cs
    spans: dict[str, Any] = {}
    file_bytes = sum(len(v) for v in files.values())
    emu.reset_counts()
    started = time.perf_counter()
    manifest = list_packed(spec, None, SpanKeeper(file_bytes, spans.__setitem__, {}))
    listed_gets, listed_bytes = emu.total_gets, emu.total_get_bytes
    count = 0
    items = manifest.chunk_items(range(len(manifest.layout)))
    for c, (_, version, _) in enumerate(items):
        columns, report = build_unit(
            manifest, c, as_arrays, None, options, span=spans.pop(version, None)
        )
        if report["errors"]:
            raise RuntimeError(f"{label}: {next(iter(report['errors'].values()))}")
        count += len(Chunk(columns))
    if count != samples:
        raise RuntimeError(f"{label}: built {count} samples of {samples}")
    return {
        "format": label,
        "chunk_samples": cs or "default",
        "file_bytes": file_bytes,
        "units": len(manifest.layout),
        "list_gets": listed_gets,
        "list_bytes": listed_bytes,
        "gets": emu.total_gets,
        "bytes": emu.total_get_bytes,
        "ratio": emu.total_get_bytes / file_bytes,
        "seconds": time.perf_counter() - started,
    }


def _table(rows: list[dict[str, Any]], command: str, samples: int) -> str:
    lines = [
        HEADING,
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d')}; {samples} samples per format, "
        "the project's S3 emulator, bytes and GETs counted at the server, the "
        "listing's included; what the stores run: `list_packed` with room to keep "
        "the units a listing reads whole, then `build_unit` for every unit; every "
        "sample compared with the format's own reader in tests/services/"
        "test_packed_bytes.py). Target: <= 1.05x.",
        "",
        "| format | chunk_samples | file MB | units | listing GETs / KB "
        "| GETs | bytes read / file bytes |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['chunk_samples']} | {r['file_bytes'] / 1e6:.1f} "
            f"| {r['units']} | {r['list_gets']} / {r['list_bytes'] / 1e3:.1f} "
            f"| {r['gets']} | {r['ratio']:.4f}x |"
        )
    return "\n".join(lines) + "\n"


def measure(samples: int, width: int, chunk_samples: int) -> list[dict[str, Any]]:
    """Every case at the default chunk size and at ``chunk_samples``: one row each."""
    import s3fs

    from shardcache_server.emulator import S3Emulator

    emu = S3Emulator().start()
    rows = []
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **emu.storage_options())
        bucket = "bench-formats"
        fs.mkdir(bucket)
        previous = tempfile.tempdir
        with tempfile.TemporaryDirectory() as tmp:
            tempfile.tempdir = tmp  # LMDB's node copy: gone with this run
            try:
                for case in CASES:
                    for cs in (0, chunk_samples):
                        rows.append(
                            _run_case(emu, fs, bucket, case, samples, width, cs)
                        )
            finally:
                tempfile.tempdir = previous  # also when a case fails
    finally:
        emu.stop()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1536, help="float32 per sample")
    parser.add_argument("--chunk-samples", type=int, default=512)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args(argv)
    rows = measure(args.samples, args.width, args.chunk_samples)
    command = "scripts/bench.sh formats " + " ".join(argv or sys.argv[1:])
    section = _table(rows, command.strip(), args.samples)
    print(section)
    if args.write:
        from report import write_section

        write_section(ROOT / "BENCHMARKS.md", HEADING, section)


if __name__ == "__main__":
    main()

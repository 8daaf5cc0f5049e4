"""Real packed files, written by the real libraries, for the format tests.

Sample ``i`` of every file holds ``i`` somewhere recognisable, so a test can
check each sample read against the source.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np


def tar_bytes(
    count: int, start: int = 0, payload: int = 100, missing: str = ""
) -> bytes:
    """A WebDataset shard: ``{i:06d}.bin`` (payload) and ``{i:06d}.cls`` (label),
    without the member named ``missing`` (a broken shard)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i in range(start, start + count):
            for ext, data in (
                ("bin", bytes([i % 256]) * payload),
                ("cls", str(i).encode()),
            ):
                if f"{i:06d}.{ext}" == missing:
                    continue
                info = tarfile.TarInfo(f"train/{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def parquet_bytes(count: int, row_group: int, start: int = 0) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = np.arange(start, start + count, dtype=np.int64)
    table = pa.table(
        {
            "id": ids,
            "x": (ids * 2).astype(np.float32),
            "text": [f"row-{i}" for i in ids],
        }
    )
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=row_group)
    return out.getvalue()


def write_hdf5(path: Path, count: int) -> None:
    import h5py

    with h5py.File(path, "w") as h5:
        h5["x"] = np.arange(count * 4, dtype=np.float32).reshape(count, 4)
        h5["y"] = np.arange(count, dtype=np.int64)


def write_lmdb(path: Path, count: int) -> None:
    import lmdb

    env = lmdb.open(str(path), map_size=64 * 2**20)
    with env.begin(write=True) as txn:
        for i in range(count):
            txn.put(f"key-{i:06d}".encode(), f"value-{i}".encode())
    env.close()


def write_npy(path: Path, count: int) -> None:
    np.save(path, np.arange(count * 3, dtype=np.int32).reshape(count, 3))


def write_npy_bytes(path: Path, count: int) -> None:
    np.save(path, (np.arange(count * 5) % 251).astype(np.uint8).reshape(count, 5))


def hdf5_bytes(count: int, layout: str, width: int = 96) -> bytes:
    """An HDF5 file of ``count`` rows: ``x`` (float32 rows of ``width``) stored
    ``contiguous``, ``rows`` (one chunk per row, the layout that read 7.45x
    before), ``gzip`` (64-row chunks through shuffle + deflate) or ``tiles``
    (chunks that cut rows and columns); ``y`` (int64, 256-row chunks)."""
    import h5py

    rng = np.random.default_rng(count)
    x = rng.random((count, width), dtype=np.float32)
    if layout == "gzip":
        x = np.round(x, 1)  # compressible
    x[:, 0] = np.arange(count)
    layouts = {
        "contiguous": {},
        "rows": {"chunks": (1, width)},
        "gzip": {"chunks": (64, width), "compression": "gzip", "shuffle": True},
        "tiles": {"chunks": (100, 40)},
    }
    out = io.BytesIO()
    with h5py.File(out, "w") as h5:
        h5.create_dataset("x", data=x, **layouts[layout])
        h5.create_dataset(
            "y",
            data=np.arange(count),
            chunks=None if layout == "contiguous" else (256,),
        )
    return out.getvalue()


def lmdb_dir(path: Path, count: int, payload: int = 200) -> Path:
    """An LMDB database directory of ``count`` keys with ``payload``-byte values."""
    import lmdb

    env = lmdb.open(str(path), map_size=256 * 2**20)
    with env.begin(write=True) as txn:
        for i in range(count):
            txn.put(f"key-{i:06d}".encode(), bytes([i % 256]) * payload)
    env.close()
    return path

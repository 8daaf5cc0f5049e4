"""HDF5 files: one or more datasets indexed along axis 0, a unit per slab of rows.

h5py reads through an fsspec file object (ranged reads; the block cache
holds the metadata h5py asks for), or the path itself when it is local.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardcache.errors import SourceFormatError
from shardcache.packed_manifest import FORMAT_EXTENSIONS, FileUnits
from shardcache_server.formats.base import (
    SourceFile,
    SourceFormat,
    UnitRequest,
    cut_rows,
)

__all__ = ["Hdf5Format"]

_BLOCK_BYTES = 4 * 2**20  # reads of metadata and small slabs share blocks


def _open(file: SourceFile) -> Any:
    import h5py

    try:
        if file.url.startswith("/") or file.url.startswith("file://"):
            return h5py.File(file.path, "r")
        handle = file.fs.open(file.path, "rb", block_size=_BLOCK_BYTES)
        return h5py.File(handle, "r")
    except OSError as exc:
        raise SourceFormatError(
            f"{file.url} is not a readable HDF5 file: {exc}"
        ) from exc


def _datasets(h5: Any, options: dict[str, Any], url: str) -> list[str]:
    import h5py

    names = options.get("datasets")
    available = sorted(k for k, v in h5.items() if isinstance(v, h5py.Dataset))
    if not names:
        names = available
    missing = [n for n in names if n not in h5 or not isinstance(h5[n], h5py.Dataset)]
    if missing or not names:
        raise SourceFormatError(
            f"{url} has no dataset(s) {missing or names}; its root holds "
            f"{available}. Pass format_options={{'datasets': [...]}}."
        )
    lengths = {n: h5[n].shape[0] if h5[n].shape else 0 for n in names}
    if len(set(lengths.values())) != 1:
        raise SourceFormatError(
            f"{url}: datasets {lengths} differ in length along axis 0; choose ones "
            "of one length with format_options={'datasets': [...]}."
        )
    return list(names)


class Hdf5Format(SourceFormat):
    name = "hdf5"
    extensions = FORMAT_EXTENSIONS["hdf5"]

    def list_file(
        self,
        file: SourceFile,
        options: dict[str, Any],
        chunk_samples: int,
        chunk_bytes: int,
    ) -> tuple[FileUnits, bytes]:
        with _open(file) as h5:
            names = _datasets(h5, options, file.url)
            rows = h5[names[0]].shape[0]
            row_bytes = sum(
                int(np.prod(h5[n].shape[1:], dtype=np.int64)) * h5[n].dtype.itemsize
                for n in names
            )
        bounds, samples, nbytes = cut_rows(rows, row_bytes, chunk_samples, chunk_bytes)
        return FileUnits(file.url, file.etag, file.size, bounds, samples, nbytes), b""

    def stacks_columns(self, unit: UnitRequest) -> bool:
        return True

    def read_columns(self, unit: UnitRequest) -> dict[str, np.ndarray]:
        with _open(unit.file) as h5:
            names = _datasets(h5, unit.options, unit.file.url)
            slabs = {n: h5[n][unit.lo : unit.hi] for n in names}
        if any(s.dtype.hasobject for s in slabs.values()):
            raise SourceFormatError(
                f"{unit.file.url}: dataset(s) of variable-length or string type cannot "
                "be cached as tensors; choose numeric datasets."
            )
        return {"_": slabs[names[0]]} if len(names) == 1 else slabs

    def read_samples(self, unit: UnitRequest) -> list[tuple[str, Any]]:
        slabs = self.read_columns(unit)
        n = unit.hi - unit.lo
        rows: list[Any] = (
            [slabs["_"][i] for i in range(n)]
            if list(slabs) == ["_"]
            else [{k: v[i] for k, v in slabs.items()} for i in range(n)]
        )
        return [(f"{unit.file.url}#{unit.lo + i}", r) for i, r in enumerate(rows)]

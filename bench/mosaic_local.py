"""Mosaic Streaming over local files, for ``larger_than_memory.py``.

Runs in ``.venv-mosaic`` (bench/mosaic.py says why), as two subprocesses of
the larger-than-memory bench, so the read can run inside its memory cgroup
while the conversion does not:

    .venv-mosaic/bin/python bench/mosaic_local.py convert DATA_DIR MDS_DIR
    .venv-mosaic/bin/python bench/mosaic_local.py read MDS_DIR BATCH

``convert`` writes the ``.npy`` samples as MDS shards with a fixed-shape
``ndarray`` column (the raw float32 bytes, no per-sample header), as a user
converting for Mosaic would. ``read`` is what its docs show for a local
dataset: ``StreamingDataset(local=..., shuffle=True)`` (no remote: shards
read in place, its default shuffle) with a ``StreamingDataLoader`` of 2
persistent workers, like the plain baseline; it prints the second epoch's
samples/s and waits as JSON (the first epoch reads the shards in).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

# This file's folder is on sys.path when it runs as a script; the timing is
# the bench's own (that module imports nothing of the project's venv).
from larger_than_memory import _timed

# Mosaic hands out read-only views of its shards; the samples are only read.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

WORKERS = 2  # as the plain DataLoader beside it


def convert(data_dir: str, mds_dir: str) -> dict[str, float]:
    from streaming import MDSWriter

    paths = sorted(Path(data_dir).glob("*.npy"))
    first = np.load(paths[0])
    shape = ",".join(map(str, first.shape))
    start = time.perf_counter()
    with MDSWriter(out=mds_dir, columns={"x": f"ndarray:{first.dtype}:{shape}"}) as w:
        for path in paths:
            w.write({"x": np.load(path)})
    return {"samples": len(paths), "convert_s": round(time.perf_counter() - start, 2)}


def read(mds_dir: str, batch: int) -> dict[str, float]:
    from streaming import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(local=mds_dir, shuffle=True, batch_size=batch)
    loader = StreamingDataLoader(
        ds, batch_size=batch, num_workers=WORKERS, persistent_workers=True
    )
    _timed(loader, count=_samples)  # its first epoch
    return _timed(loader, count=_samples)


def _samples(batch: dict) -> int:
    return len(batch["x"])


def main() -> None:
    mode = sys.argv[1]
    if mode == "convert":
        out = convert(sys.argv[2], sys.argv[3])
    elif mode == "read":
        out = read(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode!r}: convert or read")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""What counting a cold batch's samples by origin costs the rank.

``ChunkReader.count`` runs once per batch. In a cold epoch under full
shuffle a 64-sample batch touches most of the rank's chunks, each read from
the source, and a sample counts as ``source`` only on its first delivery in
the epoch. This times ``count`` over such batches, in-process (no cluster):
40 chunks of 1,000 samples, all read from the source, 200 random batches.

    PYTHONPATH=sdk:services .venv/bin/python bench/count_cost.py
"""

from __future__ import annotations

import json
import timeit

import numpy as np

from shardcache.manifest import Manifest
from shardcache.reader import ChunkReader

SAMPLES, CHUNK, BATCH, BATCHES = 40_000, 1_000, 64, 200


def main() -> None:
    urls = [f"/d/{i}" for i in range(SAMPLES)]
    manifest = Manifest.from_entries("file", urls, [1024] * SAMPLES, ["e"] * SAMPLES)
    manifest.columns["chunk_starts"] = np.arange(0, SAMPLES + 1, CHUNK)
    reader = ChunkReader(None, "bench", manifest, manifest.digest, 2**20, 5.0)
    rng = np.random.default_rng(0)
    batches = [rng.permutation(SAMPLES)[:BATCH] for _ in range(BATCHES)]
    located = [(reader.locate(b)[0], b) for b in batches]

    def epoch() -> None:  # every chunk just read from the source
        reader._origin = dict.fromkeys(range(SAMPLES // CHUNK), "source")
        reader._sourced.clear()
        for chunk_ids, indices in located:
            reader.count(chunk_ids, indices)

    best_s = min(timeit.repeat(epoch, number=5, repeat=5)) / (5 * BATCHES)
    print(
        json.dumps(
            {"command": "bench/count_cost.py", "us_per_batch": round(best_s * 1e6, 1)}
        )
    )


if __name__ == "__main__":
    main()

"""What gathering one batch of rows costs, by method: the loader's bound at small samples.

``bench/loader.py`` compares the loader with numpy's gather from a shard it
just wrote; the loader gathers rows of chunks that sit in the object store,
a working set larger than the cache. This times, on one such column (rows
read at random, as a shuffled epoch reads them), the ways a batch can be
gathered into a reused output buffer:

- ``per_row``: ``out[j] = column[row]`` for each row (what ``chunks.gather``
  did until 2026-12-02);
- ``concat``: one view per row, then ``np.concatenate(views, out=out)``
  (what ``chunks.gather`` does: per row, since a shuffled batch may touch
  as many chunks as it has rows, but the copies in one C loop);
- ``np_take``: ``np.take(column, rows, axis=0, out=out)``;
- ``fancy``: ``out[...] = column[rows]`` (a temporary, then a copy);
- ``torch_1t`` / ``torch_default``: ``torch.index_select`` into the output,
  with one intra-op thread, and with torch's default thread count.

The methods run interleaved, round after round, so a noisy machine slows
all of them alike; medians and minima per batch are printed as JSON.

    .venv/bin/python bench/gather_cost.py --rows 4096 --row-bytes 4096 --batch 64
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4096, help="rows in the column")
    ap.add_argument("--row-bytes", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=300, help="per round")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    column = rng.integers(0, 255, (args.rows, args.row_bytes), dtype=np.uint8)
    column.flags.writeable = False  # as a chunk's column in the object store
    out = np.empty((args.batch, args.row_bytes), np.uint8)
    out_t = torch.from_numpy(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only: only read here
        column_t = torch.from_numpy(column)
    picks = [rng.integers(0, args.rows, args.batch) for _ in range(args.batches)]
    picks_t = [torch.from_numpy(p) for p in picks]
    default_threads = torch.get_num_threads()

    def per_row(k: int) -> None:
        for j, row in enumerate(picks[k].tolist()):
            out[j] = column[row]

    def concat(k: int) -> None:
        views = [column[row] for row in picks[k].tolist()]
        np.concatenate(views, axis=0, out=out.reshape(-1))

    def np_take(k: int) -> None:
        np.take(column, picks[k], axis=0, out=out)

    def fancy(k: int) -> None:
        out[...] = column[picks[k]]

    def torch_1t(k: int) -> None:
        torch.index_select(column_t, 0, picks_t[k], out=out_t)

    methods = [per_row, concat, np_take, fancy, torch_1t, torch_1t]
    names = ["per_row", "concat", "np_take", "fancy", "torch_1t", "torch_default"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name, method in zip(names, methods, strict=True):
            torch.set_num_threads(default_threads if name == "torch_default" else 1)
            start = time.perf_counter()
            for k in range(args.batches):
                method(k)
            times[name].append((time.perf_counter() - start) / args.batches * 1e6)
    torch.set_num_threads(default_threads)
    print(
        json.dumps(
            {
                "command": "bench/gather_cost.py "
                f"--rows {args.rows} --row-bytes {args.row_bytes} "
                f"--batch {args.batch}",
                "torch_default_threads": default_threads,
                "us_per_batch": {
                    n: {
                        "median": round(float(np.median(t)), 1),
                        "min": round(float(np.min(t)), 1),
                    }
                    for n, t in times.items()
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

"""Each source byte read once, at any size: the figures, from one run.

    scripts/bench.sh scale --write      # or: .venv/bin/python bench/at_scale.py --write

One command for what reading at scale costs, run in order on one machine
(run it with nothing else going: every figure below is a time or a memory
growth that other jobs would move):

1. packed formats over S3, bytes read per file byte, at the default chunk
   size and at ``chunk_samples=512`` (bench/formats.py);
2. what one listing costs at each of ``--listing`` keys: LIST requests,
   wall and CPU seconds, peak and kept bytes per object (bench/listing.py,
   the emulator's synthetic bucket, ``--latency-ms`` per LIST);
3. memory per sample and the cold epoch against the plain read a user runs
   today, over ``--scale`` local files of 100 B (bench/scale.py --plain);
4. time to the first batch at each of ``--first-batch`` objects, the README's
   lines, while the listing runs (bench/first_batch.py).

Each step runs in a process of its own (its memory is its own). Writes the
JSON of every step to ``bench/results/at-scale-<date>.json`` and, with
``--write``, one section of BENCHMARKS.md with the targets checked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HEADING = "## Reading at scale: every figure from one run"
# Targets, from the issue "Each source byte read once, at any dataset size".
MAX_BYTES_RATIO = 1.05
RANK_B, RAY_SIDE_B, REDIS_B = 16, 32, 4
COLD_WITHIN = 1.2  # the cold epoch's time over the plain read's
FIRST_BATCH_S = 10.0


def _json_lines(cmd: list[str]) -> list[dict[str, Any]]:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]


def _formats(samples: int, chunk_samples: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(HERE))
    import formats

    print("+ formats.measure", samples, chunk_samples, file=sys.stderr, flush=True)
    return formats.measure(samples, 1536, chunk_samples)


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def _ok(met: bool) -> str:
    return "met" if met else "**missed**"


def _section(run: dict[str, Any], command: str) -> str:
    out = [
        HEADING,
        "",
        f"`{command}` ({run['date']}, commit {run['commit']}, {run['cpus']} CPUs, "
        f"load average {run['load_before']} before and {run['load_after']} after; "
        f"{run['minutes']:.1f} min in all; JSON in `{run['json']}`). Each step in "
        "a process of its own, one after the other; the S3 figures from the "
        "project's S3 emulator, bytes and requests counted at the server.",
        "",
        "**Packed formats over S3** (bench/formats.py: a file of "
        f"{run['formats_samples']} samples per format written by the format's own "
        "library, listed and every unit built as the stores do; the listing's "
        f"reads included; target <= {MAX_BYTES_RATIO}x):",
        "",
        "| format | chunk_samples | file MB | units | GETs | bytes read / file bytes | target |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in run["formats"]:
        out.append(
            f"| {r['format']} | {r['chunk_samples']} | {r['file_bytes'] / 1e6:.1f} "
            f"| {r['units']} | {r['gets']} | {r['ratio']:.4f}x "
            f"| {_ok(r['ratio'] <= MAX_BYTES_RATIO)} |"
        )
    out += [
        "",
        "**One listing** (bench/listing.py --source emulator: the synthetic bucket, "
        f"1,000 keys per LIST page, {run['latency_ms']:g} ms added to every LIST; "
        "peak = growth of the lister's peak RSS, kept = the published manifest's "
        "arrays, per object):",
        "",
        "| objects | LIST requests | wall s | CPU s | peak B/object | kept B/object |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in run["listing"]:
        out.append(
            f"| {r['objects']:,} | {r['list_requests']:,} | {r['list_s']:.1f} "
            f"| {r['cpu_s']:.1f} | {r['peak_bytes_per_object']:.0f} "
            f"| {r['kept_bytes_per_object']:.1f} |"
        )
    s = run["scale"]
    cold_ratio = s["plain_samples_per_s"] / s["cold_samples_per_s"]
    out += [
        "",
        f"**Memory per sample and the cold epoch** (bench/scale.py --plain: "
        f"{s['samples']:,} local files of {s['sample_bytes']} B, one rank, batch "
        f"{s['batch_size']}; anonymous memory grown per sample after a cold and a "
        "warm epoch; the Ray side is every process of the cluster: GCS, raylet, "
        "the store, the listing and build workers; the plain read is "
        "`DataLoader(num_workers=2, persistent_workers=True, shuffle=True)` over "
        "a map-style Dataset of the same files, its better of two epochs, in a "
        "process of its own after the cache is down):",
        "",
        "| list + publish s | cold samples/s | plain samples/s | cold epoch time / plain "
        "| warm samples/s | rank B/sample | Ray side B/sample (store alone) "
        "| Redis B/sample |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['list_publish_s']:.1f} | {s['cold_samples_per_s']:,.0f} "
        f"| {s['plain_samples_per_s']:,.0f} | {cold_ratio:.2f}x "
        f"| {s['warm_samples_per_s']:,.0f} | {s['rank_anon_bytes_per_sample']} "
        f"| {s['ray_side_anon_bytes_per_sample']} ({s['store_anon_bytes_per_sample']}) "
        f"| {s['redis_bytes_per_sample']} |",
        "",
        f"Targets: cold epoch within {COLD_WITHIN}x of the plain read's time: "
        f"{_ok(cold_ratio <= COLD_WITHIN)}; rank <= {RANK_B} B/sample: "
        f"{_ok(s['rank_anon_bytes_per_sample'] <= RANK_B)}; Ray side <= "
        f"{RAY_SIDE_B}: {_ok(s['ray_side_anon_bytes_per_sample'] <= RAY_SIDE_B)}; "
        f"Redis <= {REDIS_B}: {_ok(s['redis_bytes_per_sample'] <= REDIS_B)}.",
        "",
        "**Time to the first batch while the listing runs** (bench/first_batch.py: "
        "the synthetic bucket as above; a fresh process runs the README's lines "
        "with one rank, `DistributedCachedDataset(url)`, `DataLoader(ds, "
        "batch_size=64, sampler=ds.sampler)`, `next(iter(loader))`, then "
        "`len(ds)`; its head, stores and build actors started by a script "
        f"before, as a user's second script finds them; target <= {FIRST_BATCH_S:g} s):",
        "",
        "| objects | first batch s | from a prefix (objects then) | whole listing "
        "published s | process exits s | GETs by exit | target |",
        "|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in run["first_batch"]:
        prefix = f"yes ({r['prefix_objects']:,})" if r["from_prefix"] else "no"
        out.append(
            f"| {r['objects']:,} | {r['first_batch_s']:.1f} | {prefix} "
            f"| {r['listing_s']:.1f} | {r['wall_s']:.1f} | {r['gets_by_exit']:,} "
            f"| {_ok(r['first_batch_s'] <= FIRST_BATCH_S)} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--formats-samples", type=int, default=2048)
    ap.add_argument("--chunk-samples", type=int, default=512)
    ap.add_argument("--listing", default="1000000,10000000")
    ap.add_argument("--scale", type=int, default=1_000_000)
    ap.add_argument("--first-batch", default="100000,1000000,10000000")
    ap.add_argument("--latency-ms", type=float, default=30.0)
    ap.add_argument("--dir", default="/tmp/scale", help="the local files (reused)")
    ap.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = ap.parse_args()
    py = sys.executable
    started = time.time()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    run: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": commit or "?",
        "cpus": os.cpu_count(),
        "load_before": round(os.getloadavg()[0], 1),
        "latency_ms": args.latency_ms,
        "formats_samples": args.formats_samples,
    }
    run["formats"] = _formats(args.formats_samples, args.chunk_samples)
    run["listing"] = []
    for n in _sizes(args.listing):
        (row,) = _json_lines(
            [py, "bench/listing.py", "--source", "emulator", "--samples", str(n),
             "--latency-ms", str(args.latency_ms)]
        )  # fmt: skip
        run["listing"].append({"objects": n, **row})
    (run["scale"],) = _json_lines(
        [py, "bench/scale.py", "--samples", str(args.scale), "--sample-bytes", "100",
         "--dir", args.dir, "--plain"]
    )  # fmt: skip
    run["first_batch"] = _json_lines(
        [py, "bench/first_batch.py", "--samples", args.first_batch,
         "--latency-ms", str(args.latency_ms)]
    )  # fmt: skip
    run["load_after"] = round(os.getloadavg()[0], 1)
    run["minutes"] = (time.time() - started) / 60
    out = HERE / "results" / f"at-scale-{time.strftime('%Y-%m-%dT%H%M')}.json"
    run["json"] = str(out.relative_to(ROOT))
    out.write_text(json.dumps(run, indent=1) + "\n")
    command = "scripts/bench.sh scale " + " ".join(sys.argv[1:])
    section = _section(run, command.strip())
    print(section)
    if args.write:
        from report import write_section

        write_section(ROOT / "BENCHMARKS.md", HEADING, section)


if __name__ == "__main__":
    main()

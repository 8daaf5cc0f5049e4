"""The many-jobs scenario's figures and its table (bench/many_jobs.py runs it).

One run is N jobs of one system on one source; :func:`summarise` turns its
per-rank rows and timestamps into per-job and per-run figures, :func:`table`
into the Markdown section BENCHMARKS.md keeps under :data:`HEADING`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
from typing import Any

from samples import VALUE_BYTES

HEADING = "## Many jobs on one node: N concurrent jobs on one dataset"


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: per job, then over the run."""
    per_job = []
    for launched, ranks in zip(result["launched"], result["jobs"], strict=True):
        samples = sum(row["samples"] for r in ranks for row in r["rows"])
        first = max(r["first_batch"] for r in ranks)
        ended = max(r["ended"] for r in ranks)
        per_job.append(
            {
                "launched": launched,
                "first_batch": first,
                "ended": ended,
                "samples": samples,
                "samples_per_s": samples / (ended - launched),
                "loop_samples_per_s": samples / (ended - first),
                "source_samples": sum(r.get("misses", 0) for r in ranks),
            }
        )
    last = per_job[-1]
    busy = [  # earlier jobs between their first batch and their end
        j for j in per_job[:-1] if j["first_batch"] <= last["first_batch"] <= j["ended"]
    ]
    total = sum(j["samples"] for j in per_job)
    span = max(j["ended"] for j in per_job) - min(j["launched"] for j in per_job)
    rates = sorted(j["samples_per_s"] for j in per_job)
    out = {
        "jobs": len(per_job),
        "per_job_samples_per_s": (rates[0], rates[len(rates) // 2], rates[-1]),
        "per_job_loop_samples_per_s": sorted(j["loop_samples_per_s"] for j in per_job),
        "aggregate_samples_per_s": total / span,
        "first_job_ttfb_s": per_job[0]["first_batch"] - per_job[0]["launched"],
        "last_job_ttfb_s": last["first_batch"] - last["launched"],
        "last_job_overlapped": len(busy),
        "later_jobs_source_samples": sum(j["source_samples"] for j in per_job[1:]),
        "per_job": per_job,
    }
    if "gets" in result:
        out["gets_per_object"] = result["gets"] / result["objects"]
    return out


def _gb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def row(result: dict[str, Any]) -> str:
    s, mem = summarise(result), result["memory_peak"]
    lo, med, hi = s["per_job_samples_per_s"]
    loops = s["per_job_loop_samples_per_s"]
    loop = loops[len(loops) // 2]
    gets = s.get("gets_per_object")
    gets_text = "-" if gets is None else f"{gets:.2f}"
    if result.get("prepare_gets"):
        gets_text += f" (+{result['prepare_gets'] / result['objects']:.2f} conversion)"
    later = (
        str(s["later_jobs_source_samples"]) if result["system"] == "shardcache" else "-"
    )
    skipped = (
        f" ({result['skipped_for_memory']} not started: memory)"
        if result["skipped_for_memory"]
        else ""
    )
    return (
        f"| {result['source']} | {result['system']} | {result['n']}{skipped} "
        f"| {lo:,.0f} / {med:,.0f} / {hi:,.0f} | {loop:,.0f} "
        f"| {s['aggregate_samples_per_s']:,.0f} "
        f"| {gets_text} | {_gb(mem['jobs_anon'])} | {_gb(mem['cache_anon'])} "
        f"| {_gb(mem['shm'])} | {_gb(result.get('store_bytes'))} "
        f"| {_gb(result['disk_bytes'])} | {s['last_job_ttfb_s']:.1f} "
        f"({s['first_job_ttfb_s']:.1f}) | {s['last_job_overlapped']} | {later} |"
    )


def table(
    results: list[dict[str, Any]], args: argparse.Namespace, command: str,
    data: dict[str, Any], notes: list[str], load: str,
) -> str:  # fmt: skip
    objects = len(next(iter(data.values()))["urls"])
    sizes = ", ".join(f"{k} {v['object_bytes'] / 1e3:.0f} KB" for k, v in data.items())
    lines = [
        HEADING,
        "",
        f"`{command}` ({dt.date.today().isoformat()}; {os.cpu_count()} cores shared "
        f"with other engineers' tests; `uptime` at the start and end: {load}).",
        "",
        f"{objects:,} JPEGs ({sizes} each; decoded and resized to 3x224x224 uint8, "
        f"{VALUE_BYTES['images'] / 1e3:.0f} KB per sample, by every system), "
        f"{args.epochs} epochs, batch {args.batch_size}; each job is 2 gloo ranks "
        f"under `torch.distributed.run` with a {args.step_ms:g} ms step and an "
        f"all-reduce per batch; jobs start {args.stagger_s:g} s apart.",
        "",
        "| source | system | N jobs | per-job samples/s min / median / max "
        "| per-job samples/s from first batch (median) | aggregate samples/s | GETs/object | jobs RssAnon GB (peak) "
        "| cache side RssAnon GB | /dev/shm growth GB | stores hold GB | disk GB "
        "| last job's first batch s (first job's) | jobs mid-epoch then "
        "| later jobs' samples not cached yet when asked |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(row(r) for r in results),
        "",
        "Per-job samples/s run from the job's launch (start-up included) to its "
        "last rank's end; aggregate is every sample of every job over the first "
        "launch to the last end. `jobs mid-epoch then`: earlier jobs between their "
        "first batch and their end when the last job got its first batch.",
        *[f"- {note}" for note in notes],
    ]
    return "\n".join(lines) + "\n"

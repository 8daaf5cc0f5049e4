"""Turn a bench/run.py result into BENCHMARKS.md (and a PNG when matplotlib is present)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def _med(values: list[float]) -> str:
    if not values:
        return "-"
    v = np.asarray(values, dtype=float)
    if len(v) == 1:
        return f"{v[0]:,.1f}"
    return f"{np.median(v):,.1f} ({v.min():,.1f}-{v.max():,.1f})"


def summarise(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, list[float]]]:
    by: dict[tuple[str, str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in report["rows"]:
        by[(r["dataset"], r["system"], r["rep"], r["epoch"])].append(r)
    out: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for (dataset, system, _rep, epoch), ranks in by.items():
        total = sum(r["samples"] for r in ranks) / max(r["seconds"] for r in ranks)
        per_rank = [r["samples_per_s"] for r in ranks]
        means = [r["wait_mean_ms"] for r in ranks]
        m = out[(dataset, system)]
        key = "cold" if epoch == 0 else "warm"
        m[f"{key}_total_sps"].append(total)
        if epoch == 0:
            m["first_batch_s"].append(max(r["first_batch_s"] for r in ranks))
            m["gets_per_object"].append(ranks[0]["gets_per_object"])
        else:
            m["warm_rank_sps"].append(float(np.mean(per_rank)))
            m["p50"].append(float(np.mean([r["wait_p50_ms"] for r in ranks])))
            m["p99"].append(max(r["wait_p99_ms"] for r in ranks))
            m["spread"].append(max(means) / max(min(means), 1e-9))
            m["pss"].append(max(r["pss_mb"] for r in ranks))
            m["uss"].append(max(r["uss_mb"] for r in ranks))
            m["delivery_gbps"].append(
                float(np.mean([r.get("delivery_gbps", 0.0) for r in ranks]))
            )
            m["memcpy_frac"].append(
                total
                * report["object_bytes"][dataset]
                / (report["memcpy_gbps"][dataset] * 1e9)
            )
    return out


def write_report(report: dict[str, Any], md_path: Path, png_path: Path) -> None:
    summary = summarise(report)
    lines = [
        "# Benchmarks",
        "",
        f"Measured {report['date']} with `{report['command']}` on {report['machine']['cpus']} CPUs "
        f"({report['machine']['platform']}, Python {report['machine']['python']}). Storage: moto S3 "
        f"behind the emulator's `{report['profile']}` latency model; GETs counted at the server. "
        f"2 gloo ranks on one machine, step = 2 ms sleep + all-reduce. Medians over repetitions "
        f"(min-max). memcpy of the same bytes: "
        + ", ".join(f"{d} {g:.1f} GB/s" for d, g in report["memcpy_gbps"].items())
        + ".",
        "",
    ]
    for dataset in sorted({d for d, _ in summary}):
        lines += [
            f"## {dataset} ({report['object_bytes'][dataset] / 1024:.0f} KB objects)",
            "",
            "| system | epoch-1 samples/s | warm samples/s | warm per rank | first batch s | GETs/object | "
            "warm p50 ms | warm p99 ms | rank spread | PSS MB/rank | USS MB/rank | warm / memcpy |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for (d, system), m in sorted(summary.items()):
            if d != dataset:
                continue
            lines.append(
                f"| {system} | {_med(m['cold_total_sps'])} | {_med(m['warm_total_sps'])} | "
                f"{_med(m['warm_rank_sps'])} | {_med(m['first_batch_s'])} | "
                f"{_med(m['gets_per_object'])} | {_med(m['p50'])} | {_med(m['p99'])} | "
                f"{_med(m['spread'])} | {_med(m['pss'])} | {_med(m['uss'])} | "
                f"{np.median(m['memcpy_frac']):.4f} | {_med(m['delivery_gbps'])} | "
                f"{np.median(m['delivery_gbps']) / report['memcpy_gbps'][dataset]:.2f} |"
                if m["memcpy_frac"]
                else "| - |"
            )
        lines.append("")
    md_path.write_text("\n".join(lines) + "\n" + _notes())
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, dataset in zip(axes, sorted({d for d, _ in summary}), strict=False):
        systems = sorted(s for d, s in summary if d == dataset)
        cold = [np.median(summary[(dataset, s)]["cold_total_sps"]) for s in systems]
        warm = [np.median(summary[(dataset, s)]["warm_total_sps"]) for s in systems]
        x = np.arange(len(systems))
        ax.bar(x - 0.2, cold, 0.4, label="epoch 1")
        ax.bar(x + 0.2, warm, 0.4, label="warm epochs")
        ax.set_xticks(x, systems, rotation=20)
        ax.set_title(f"{dataset}: samples/s (2 ranks)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


def _notes() -> str:
    path = Path(__file__).with_name("NOTES.md")
    return path.read_text() if path.exists() else ""


if __name__ == "__main__":
    src = Path(sys.argv[1])
    write_report(
        json.loads(src.read_text()),
        Path(__file__).resolve().parents[1] / "BENCHMARKS.md",
        src.with_suffix(".png"),
    )

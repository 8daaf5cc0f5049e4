"""Turn a bench/run.py result into BENCHMARKS.md (and a PNG when matplotlib is present)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def _med(values: list[float]) -> str:
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    if not len(v):
        return "-"
    if len(v) == 1:
        return f"{v[0]:,.1f}"
    return f"{np.median(v):,.1f} ({v.min():,.1f}-{v.max():,.1f})"


def _epoch_gets(ranks_by_epoch: dict[int, list[dict[str, Any]]]) -> list[int]:
    """GETs the server saw during each epoch (rank 0 reads the counter at epoch end)."""
    totals = [
        next(r["server_gets"] for r in ranks_by_epoch[e] if r["rank"] == 0)
        for e in sorted(ranks_by_epoch)
    ]
    return [b - a for a, b in zip([0, *totals], totals, strict=False)]


def summarise(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, list[float]]]:
    by: dict[tuple[str, str, int], dict[int, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in report["rows"]:
        if "error" not in r:
            by[(r["dataset"], r["system"], r["rep"])][r["epoch"]].append(r)
    out: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for (dataset, system, _rep), epochs in by.items():
        m = out[(dataset, system)]
        m["epoch_gets"].append(_epoch_gets(epochs))  # type: ignore[arg-type]
        for epoch, ranks in epochs.items():
            total = sum(r["samples"] for r in ranks) / max(r["seconds"] for r in ranks)
            key = "cold" if epoch == 0 else "warm"
            m[f"{key}_total_sps"].append(total)
            if epoch == 0:
                m["first_batch_s"].append(max(r["first_batch_s"] for r in ranks))
                m["gets_per_object"].append(ranks[0]["gets_per_object"])
                m["prepare_s"].append(ranks[0].get("prepare_s", 0.0))
                m["storage_cpu_s"].append(ranks[0].get("storage_cpu_s", float("nan")))
                continue
            m["warm_rank_sps"].append(
                float(np.mean([r["samples_per_s"] for r in ranks]))
            )
            m["pss"].append(max(r["pss_mb"] for r in ranks))
            m["uss"].append(max(r["uss_mb"] for r in ranks))
            gbps = float(np.mean([r["delivery_gbps"] for r in ranks]))
            m["delivery_gbps"].append(gbps)
            m["memcpy_frac"].append(gbps / report["memcpy_gbps"][dataset])
            m["refreshed"].append(sum(r.get("refreshed", 0) for r in ranks))
        _pooled_waits(m, epochs)
    return out


def _pooled_waits(m: dict[str, list[Any]], epochs: dict[int, list[dict[str, Any]]]):
    """Per-rank wait percentiles over all warm epochs of one repetition.

    One warm epoch of a rank is a few dozen batches at most, so a per-epoch
    p99 is its maximum; pooling the warm epochs gives the percentile more
    batches to stand on.
    """
    warm = [r for e, rows in epochs.items() if e > 0 for r in rows]
    if not warm:
        return
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in warm:
        by_rank[r["rank"]].append(r)
    p50, p99, mean, cpu50, cpu99 = [], [], [], [], []
    for rank in sorted(by_rank):
        w = np.concatenate([r["waits_ms"] for r in by_rank[rank]])
        p50.append(float(np.percentile(w, 50)))
        p99.append(float(np.percentile(w, 99)))
        mean.append(float(w.mean()))
        cpu50.append(float(np.mean([r["wait_cpu_p50_ms"] for r in by_rank[rank]])))
        cpu99.append(float(max(r["wait_cpu_p99_ms"] for r in by_rank[rank])))
    m["p50"].append(float(np.mean(p50)))
    m["p99"].append(max(p99))
    m["p99_over_p50"].append(
        max(b / max(a, 1e-9) for a, b in zip(p50, p99, strict=True))
    )
    m["spread"].append(max(mean) / max(min(mean), 1e-9))
    m["p99_by_rank"].append(p99)  # type: ignore[arg-type]
    m["cpu_p50"].append(float(np.mean(cpu50)))
    m["cpu_p99"].append(max(cpu99))


MAIN_HEADER = (
    "| system | epoch-1 samples/s | warm samples/s | warm per rank | first batch s | "
    "prepare s | GETs/object | storage CPU s | warm p50 ms | warm p99 ms | worst p99/p50 | rank spread | "
    "loop CPU p50 ms | loop CPU p99 ms | "
    "PSS MB/rank | USS MB/rank | warm GB/s/rank | of memcpy |\n" + "|---" * 18 + "|"
)


def _calibration(report: dict[str, Any]) -> str:
    cal = report.get("storage_calibration")
    if not cal:
        return ""
    return (
        f"moto alone (no latency model): {cal['sequential_get_ms_p50']:.1f} ms per "
        f"sequential GET, {cal['concurrent16_gets_per_s']:.0f} GET/s with 16 clients, "
        f"{cal['storage_cpu_ms_per_get']:.1f} ms of storage-side CPU per GET; "
        "`storage CPU s` is that CPU over the whole job. "
    )


def _main_row(system: str, m: dict[str, list[float]]) -> str:
    cells = [
        system,
        _med(m["cold_total_sps"]),
        _med(m["warm_total_sps"]),
        _med(m["warm_rank_sps"]),
        _med(m["first_batch_s"]),
        _med(m["prepare_s"]),
        _med(m["gets_per_object"]),
        _med(m["storage_cpu_s"]),
        _med(m["p50"]),
        _med(m["p99"]),
        _med(m["p99_over_p50"]),
        _med(m["spread"]),
        _med(m["cpu_p50"]),
        _med(m["cpu_p99"]),
        _med(m["pss"]),
        _med(m["uss"]),
        _med(m["delivery_gbps"]),
        f"{np.median(m['memcpy_frac']):.0%}" if m["memcpy_frac"] else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def write_report(report: dict[str, Any], md_path: Path, png_path: Path) -> None:
    summary = summarise(report)
    layout = report.get("layout", "2 gloo ranks on one machine")
    lines = [
        "# Benchmarks",
        "",
        f"Measured {report['date']} with `{report['command']}` on {report['machine']['cpus']} CPUs "
        f"({report['machine']['platform']}, Python {report['machine']['python']}). Storage: moto S3 "
        f"behind the emulator's `{report['profile']}` latency model; GETs counted at the server. "
        f"{layout}, step = 2 ms sleep + all-reduce. Medians over repetitions "
        f"(min-max). memcpy of the same bytes: "
        + ", ".join(f"{d} {g:.1f} GB/s" for d, g in report["memcpy_gbps"].items())
        + ". "
        + _calibration(report)
        + "`prepare s` is a conversion or materialisation step before training; it is"
        " included in epoch 1 and its GETs in GETs/object.",
        "",
    ]
    datasets = sorted({d for d, _ in summary})
    for dataset in datasets:
        lines += [
            f"## {dataset} ({report['object_bytes'][dataset] / 1024:.0f} KB objects)",
            "",
            MAIN_HEADER,
        ]
        for (d, system), m in sorted(summary.items()):
            if d == dataset and not system.startswith("shardcache_"):
                lines.append(_main_row(system, m))
        lines.append("")
    scenarios = [(d, s) for d, s in sorted(summary) if s.startswith("shardcache_")]
    if scenarios:
        lines += [
            "## Scenarios (shardcache)",
            "",
            "`lru50`/`static50`: each node's store holds half of its share of the values"
            " (the rank pins nothing); `changed1`: 1% of the objects get a new version"
            " before the last epoch and every rank calls `refresh()`.",
            "",
            "| dataset | scenario | warm samples/s | GETs/object | GETs per epoch | refreshed |",
            "|---|---|---|---|---|---|",
        ]
        for d, s in scenarios:
            m = summary[(d, s)]
            lines.append(
                f"| {d} | {s.removeprefix('shardcache_')} | {_med(m['warm_total_sps'])} | "
                f"{_med(m['gets_per_object'])} | {m['epoch_gets'][0]} | "
                f"{int(max(m['refreshed'], default=0))} |"
            )
        lines.append("")
    failed = [r for r in report["rows"] if "error" in r]
    if failed:
        lines += ["## Systems that did not run", ""]
        lines += [
            f"- {r['system']} ({r['dataset']}, rep {r['rep']}): {r['error']}"
            for r in failed
        ]
        lines.append("")
    md_path.write_text("\n".join(lines) + "\n" + _notes())
    _plot(summary, datasets, png_path)


def _plot(
    summary: dict[tuple[str, str], dict[str, list[float]]],
    datasets: list[str],
    png_path: Path,
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not datasets:
        return
    fig, axes = plt.subplots(
        len(datasets), 3, figsize=(16, 4.2 * len(datasets)), squeeze=False
    )
    for row, dataset in zip(axes, datasets, strict=False):
        systems = sorted(
            s for d, s in summary if d == dataset and not s.startswith("shardcache_")
        )
        x = np.arange(len(systems))
        cold = [np.median(summary[(dataset, s)]["cold_total_sps"]) for s in systems]
        warm = [np.median(summary[(dataset, s)]["warm_total_sps"]) for s in systems]
        row[0].bar(x - 0.2, cold, 0.4, label="epoch 1")
        row[0].bar(x + 0.2, warm, 0.4, label="warm epochs")
        row[0].set_yscale("log")
        row[0].set_title(f"{dataset}: samples/s, all ranks")
        row[0].legend()
        row[1].bar(
            x, [np.median(summary[(dataset, s)]["gets_per_object"]) for s in systems]
        )
        row[1].set_title(f"{dataset}: S3 GETs per object (whole job)")
        for i, s in enumerate(systems):
            per_rank = np.median(
                np.asarray(summary[(dataset, s)]["p99_by_rank"]), axis=0
            )
            row[2].scatter([i] * len(per_rank), per_rank, s=18)
        row[2].set_yscale("log")
        row[2].set_title(f"{dataset}: warm p99 batch wait per rank, ms")
        for ax in row:
            ax.set_xticks(x, systems, rotation=20)
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

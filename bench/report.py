"""Turn a bench/run.py result into BENCHMARKS.md (and a PNG when matplotlib is present).

.venv/bin/python bench/report.py RESULT.json [OUT.md]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

Key = tuple[str, str, str, str]  # source, layout, dataset, system
# shardcache over another source layout, shown in the main table; every other
# ``shardcache_*`` system is a scenario (a budget, a change upstream).
MAIN_VARIANTS = ("shardcache_tar",)


def _is_scenario(system: str) -> bool:
    return system.startswith("shardcache_") and system not in MAIN_VARIANTS


Summary = dict[Key, dict[str, list[Any]]]


def _med(values: list[Any], fmt: str = ",.1f") -> str:
    v = np.asarray([x for x in values if x is not None], dtype=float)
    v = v[~np.isnan(v)]
    if not len(v):
        return "-"
    if len(v) == 1:
        return f"{v[0]:{fmt}}"
    return f"{np.median(v):{fmt}} ({v.min():{fmt}}-{v.max():{fmt}})"


def _median(values: list[Any]) -> float:
    v = [x for x in values if x is not None and not np.isnan(x)]
    return float(np.median(v)) if v else float("nan")


def _epoch_gets(ranks_by_epoch: dict[int, list[dict[str, Any]]]) -> list[int] | None:
    """GETs the server saw during each epoch (rank 0 reads the counter at epoch end)."""
    totals = [
        next(r["server_gets"] for r in ranks_by_epoch[e] if r["rank"] == 0)
        for e in sorted(ranks_by_epoch)
    ]
    if any(t is None for t in totals):
        return None
    return [b - a for a, b in zip([0, *totals], totals, strict=False)]


def summarise(report: dict[str, Any]) -> Summary:
    by: dict[tuple[Key, int], dict[int, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in report["rows"]:
        if "error" not in r:
            key = (r["source"], r["layout"], r["dataset"], r["system"])
            by[(key, r["rep"])][r["epoch"]].append(r)
    cpus = report["machine"]["cpus"]
    out: Summary = defaultdict(lambda: defaultdict(list))
    for (key, _rep), epochs in by.items():
        m = out[key]
        m["epoch_gets"].append(_epoch_gets(epochs))
        m["path"].append(epochs[0][0].get("path", ""))
        m["capped"].append(any(r["capped"] for rows in epochs.values() for r in rows))
        m["delivery_by_epoch"].append(
            [
                float(np.mean([r["delivery_gbps"] for r in epochs[e]]))
                for e in sorted(epochs)
            ]
        )
        last = epochs[max(epochs)]
        n = last[0]["dataset_samples"]
        m["rank_b_per_sample"].append(
            max(r["rank_anon_growth_bytes"] for r in last) / n
        )
        cache = last[0].get("cache_side_bytes")
        m["cache_b_per_sample"].append(None if cache is None else cache / n)
        m["redis_b_per_sample"].append(last[0].get("redis_growth_bytes", 0) / n)
        warm_batches = defaultdict(int)
        for epoch, ranks in epochs.items():
            total = sum(r["samples"] for r in ranks) / max(r["seconds"] for r in ranks)
            if epoch == 0:
                m["cold_total_sps"].append(total)
                m["cold_per_core"].append(total / cpus)
                cpu_s = next(r["machine_cpu_s"] for r in ranks if r["rank"] == 0)
                samples = sum(r["samples"] for r in ranks)
                m["cold_per_cpu_s"].append(samples / cpu_s if cpu_s else None)
                m["first_batch_s"].append(max(r["first_batch_s"] for r in ranks))
                m["gets_per_object"].append(ranks[0]["gets_per_object"])
                m["prepare_s"].append(ranks[0].get("prepare_s", 0.0))
                continue
            m["warm_total_sps"].append(total)
            m["warm_rank_sps"].append(
                float(np.mean([r["samples_per_s"] for r in ranks]))
            )
            m["pss"].append(max(r["pss_mb"] for r in ranks))
            gbps = float(np.mean([r["delivery_gbps"] for r in ranks]))
            m["delivery_gbps"].append(gbps)
            m["memcpy_frac"].append(gbps / report["memcpy_gbps"][key[2]])
            # Every rank's refresh() returns the same dataset-wide list.
            m["refreshed"].append(max(r.get("refreshed", 0) for r in ranks))
            for r in ranks:
                warm_batches[r["rank"]] += r["batches"]
        if warm_batches:
            m["warm_batches"].append(min(warm_batches.values()))
        _pooled_waits(m, epochs)
    return out


def _pooled_waits(m: dict[str, list[Any]], epochs: dict[int, list[dict[str, Any]]]):
    """Per-rank wait percentiles over all warm epochs of one repetition."""
    warm = [r for e, rows in epochs.items() if e > 0 for r in rows]
    if not warm:
        return
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in warm:
        by_rank[r["rank"]].append(r)
    p50, p99, mean, cpu50, cpu99 = [], [], [], [], []
    for rank in sorted(by_rank):
        w = np.concatenate([r["waits_ms"] for r in by_rank[rank]])
        c = [r["wait_cpu_p50_ms"] for r in by_rank[rank]]
        p50.append(float(np.percentile(w, 50)))
        p99.append(float(np.percentile(w, 99)))
        mean.append(float(w.mean()))
        cpu50.append(float(np.mean(c)))
        cpu99.append(float(max(r["wait_cpu_p99_ms"] for r in by_rank[rank])))
    ratios = [b / max(a, 1e-9) for a, b in zip(p50, p99, strict=True)]
    m["p50"].append(float(np.mean(p50)))
    m["p99"].append(max(p99))
    m["p99_over_p50"].append(max(ratios))
    m["p99_over_p50_by_rank"].append(ratios)
    m["spread"].append(max(mean) / max(min(mean), 1e-9))
    m["p99_by_rank"].append(p99)
    m["cpu_p50"].append(float(np.mean(cpu50)))
    m["cpu_p99"].append(max(cpu99))


MAIN_COLUMNS = (
    "system",
    "epoch-1 samples/s",
    "epoch-1 samples/s per core",
    "epoch-1 samples per busy CPU-s",
    "warm samples/s",
    "warm per rank",
    "warm batches/rank",
    "first batch s",
    "prepare s",
    "GETs/object",
    "warm p50 ms",
    "warm p99 ms",
    "worst p99/p50",
    "rank spread",
    "loop CPU p50 ms",
    "warm GB/s/rank (collated)",
    "of memcpy",
    "rank B/sample",
    "cache side B/sample",
    "Redis B/sample",
    "PSS MB/rank",
)


def _header(columns: tuple[str, ...]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]


def _main_row(system: str, m: dict[str, list[Any]]) -> str:
    frac = [x for x in m["memcpy_frac"] if x is not None]
    cells = [
        system + (" (capped)" if any(m["capped"]) else ""),
        _med(m["cold_total_sps"]),
        _med(m["cold_per_core"]),
        _med(m["cold_per_cpu_s"]),
        _med(m["warm_total_sps"]),
        _med(m["warm_rank_sps"]),
        _med(m["warm_batches"], ",.0f"),
        _med(m["first_batch_s"]),
        _med(m["prepare_s"]),
        _med(m["gets_per_object"], ".2f"),
        _med(m["p50"], ",.2f"),
        _med(m["p99"], ",.2f"),
        _med(m["p99_over_p50"]),
        _med(m["spread"], ".2f"),
        _med(m["cpu_p50"], ",.2f"),
        _med(m["delivery_gbps"], ".2f"),
        f"{np.median(frac):.0%}" if frac else "-",
        _med(m["rank_b_per_sample"], ",.0f"),
        _med(m["cache_b_per_sample"], ",.0f"),
        _med(m["redis_b_per_sample"], ",.0f"),
        _med(m["pss"], ",.0f"),
    ]
    return "| " + " | ".join(cells) + " |"


def _intro(report: dict[str, Any]) -> list[str]:
    mach = report["machine"]
    cal = report.get("storage_calibration")
    s3 = (
        f"`s3`: moto S3 behind the emulator's `{report['profile']}` latency model, "
        "GETs counted at the server"
        + (
            f" (moto alone: {cal['sequential_get_ms_p50']:.1f} ms per sequential GET, "
            f"{cal['concurrent16_gets_per_s']:.0f} GET/s with 16 clients, "
            f"{cal['storage_cpu_ms_per_get']:.1f} ms of storage CPU per GET)"
            if cal
            else ""
        )
    )
    local = "`local`: the same files on local disk, page cache warm, no latency"
    batch = report["batch_size"]
    return [
        "# Benchmarks",
        "",
        f"Measured {report['date']} with `{report['command']}` on {mach['cpus']} CPUs "
        f"({mach['platform']}, Python {mach['python']}). Sources: "
        + "; ".join(
            t
            for s, t in (("s3", s3), ("local", local))
            if s in report.get("sources", ["s3"])
        )
        + f". {report['layout']} ({report['cpus_per_ray_node']} Ray CPUs per node), "
        f"step = 2 ms sleep + all-reduce; batch {batch['images']} images / "
        f"{batch['blobs']} blobs; DataLoader-based systems use "
        f"{report['workers']} workers per rank. Every system delivers a collated "
        "batch by its own recommended path (the `path` column of the JSON). "
        "memcpy of the same bytes (batch-sized copies into fresh tensors, one "
        "thread, same run): "
        + ", ".join(f"{d} {g:.1f} GB/s" for d, g in report["memcpy_gbps"].items())
        + ". Medians over repetitions (min-max). `prepare s` is a conversion or "
        "materialisation step before training, included in epoch 1. `(capped)`: "
        f"epochs stopped after {report['epoch_cap_s']:.0f} s (all ranks together); "
        "its warm epochs are then partly cold.",
        "",
    ]


def write_section(path: Path, heading: str, section: str) -> None:
    """Put ``section`` (which starts with ``heading``) in the Markdown file at
    ``path``: in place of the section under the same heading, else at the end.
    For the scenarios that write one table of their own (formats, many jobs)."""
    text = path.read_text() if path.exists() else ""
    if heading in text:
        head, _, rest = text.partition(heading)
        tail = rest.split("\n## ", 1)
        text = head + section + ("\n## " + tail[1] if len(tail) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def write_report(report: dict[str, Any], md_path: Path, png_path: Path) -> None:
    summary = summarise(report)
    lines = _intro(report)
    main_layout = report["layout"].split(" Ray nodes x ")
    main = f"{main_layout[0]}x{main_layout[1].split()[0]}"
    groups = sorted({(s, d) for s, lay, d, _ in summary if lay == main})
    for source, dataset in groups:
        size = report["object_bytes"].get(dataset, 0) / 1024
        lines += [f"## {source}: {dataset} ({size:.0f} KB objects, {main})", ""]
        lines += _header(MAIN_COLUMNS)
        for (s, lay, d, system), m in sorted(summary.items()):
            if (s, lay, d) == (source, main, dataset) and not _is_scenario(system):
                lines.append(_main_row(system, m))
        lines.append("")
    lines += _consistency(summary, main)
    lines += _scenarios(summary)
    lines += _targets(summary, main)
    failed = [r for r in report["rows"] if "error" in r]
    if failed:
        lines += ["## Systems that did not run", ""]
        lines += [
            f"- {r['system']} ({r.get('source', 's3')} {r['dataset']} "
            f"{r.get('layout', '')}, rep {r['rep']}): {r['error']}"
            for r in failed
        ]
        lines.append("")
    md_path.write_text("\n".join(lines) + "\n" + _notes())
    _plot(summary, report, png_path)


def _consistency(summary: Summary, main: str) -> list[str]:
    """Warm latency consistency per layout, so contention shows apart from the loader."""
    keys = sorted(k for k in summary if summary[k]["p50"])
    lean = {(s, d, sy) for s, lay, d, sy in keys if lay != main}
    if not lean:
        return []
    rows = [k for k in keys if (k[0], k[2], k[3]) in lean]
    lines = [
        "## Latency consistency by layout (warm epochs)",
        "",
        "The same system with more ranks than cores and with no more ranks than "
        "cores: what the loader does apart from what waiting for a core adds.",
        "",
        *_header(
            (
                "source",
                "dataset",
                "system",
                "layout",
                "warm p50 ms",
                "warm p99 ms",
                "p99/p50 per rank",
                "worst p99/p50",
                "rank spread",
                "loop CPU p50 ms",
                "loop CPU p99 ms",
            )
        ),  # fmt: skip
    ]
    for s, lay, d, sy in sorted(rows, key=lambda k: (k[0], k[2], k[3], k[1])):
        m = summary[(s, lay, d, sy)]
        ratios = np.median(np.asarray(m["p99_over_p50_by_rank"]), axis=0)
        lines.append(
            f"| {s} | {d} | {sy} | {lay} | {_med(m['p50'], ',.2f')} | "
            f"{_med(m['p99'], ',.2f')} | {', '.join(f'{x:.1f}' for x in ratios)} | "
            f"{_med(m['p99_over_p50'])} | {_med(m['spread'], '.2f')} | "
            f"{_med(m['cpu_p50'], ',.2f')} | {_med(m['cpu_p99'], ',.2f')} |"
        )
    return [*lines, ""]


def _scenarios(summary: Summary) -> list[str]:
    keys = [k for k in sorted(summary) if _is_scenario(k[3])]
    if not keys:
        return []
    lines = [
        "## Scenarios (shardcache)",
        "",
        "`lru50`/`static50`/`clairvoyant50`: each node's store holds half of its"
        " share of the values"
        " (the rank holds at most 4 chunks, its shuffle blocks' working set;"
        " 256-sample chunks of blobs, 64 of images, shuffle blocks of 2 chunks);"
        " `changed1`: 1% of the objects get a new version"
        " before the last epoch and every rank calls `refresh()`.",
        "",
        *_header(
            (
                "source",
                "layout",
                "dataset",
                "scenario",
                "warm samples/s",
                "GETs/object",
                "GETs per epoch",
                "objects changed",
            )
        ),  # fmt: skip
    ]
    for s, lay, d, sy in keys:
        m = summary[(s, lay, d, sy)]
        lines.append(
            f"| {s} | {lay} | {d} | {sy.removeprefix('shardcache_')} | "
            f"{_med(m['warm_total_sps'])} | {_med(m['gets_per_object'], '.2f')} | "
            f"{m['epoch_gets'][0]} | {int(max(m['refreshed'], default=0))} |"
        )
    return [*lines, ""]


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**missed**")


def _targets(summary: Summary, main: str) -> list[str]:
    """shardcache's targets (issues 6 and 14), computed from this run."""

    def get(source: str, layout: str, dataset: str, system: str, field: str) -> float:
        m = summary.get((source, layout, dataset, system))
        return _median(m[field]) if m and m[field] else float("nan")

    rows: list[tuple[str, str, bool | None]] = []

    def add(target: str, value: float, ok: bool, text: str) -> None:
        rows.append((target, text, None if np.isnan(value) else ok))

    sources = sorted({k[0] for k in summary})
    layouts = sorted({k[1] for k in summary if k[3] == "shardcache"})
    for source in sources:
        for d in ("images", "blobs"):
            sc = get(source, main, d, "shardcache", "warm_total_sps")
            pl = get(source, main, d, "plain", "warm_total_sps")
            best = max(
                (
                    _median(m["warm_total_sps"])
                    for (s, lay, dd, sy), m in summary.items()
                    if (s, lay, dd) == (source, main, d)
                    and not sy.startswith("shardcache")  # other systems only
                    and m["warm_total_sps"]
                ),
                default=float("nan"),
            )
            add(f"{source} {d}: warm >= 10x plain", sc / pl, sc >= 10 * pl,
                f"{sc / pl:.1f}x plain")  # fmt: skip
            add(f"{source} {d}: warm ahead of every system", sc / best, sc > best,
                f"{sc / best:.2f}x the next best")  # fmt: skip
            cold = get(source, main, d, "shardcache", "cold_total_sps")
            plc = get(source, main, d, "plain", "cold_total_sps")
            want = 0.8 if source == "local" else 1.0
            add(f"{source} {d}: epoch 1 >= {want}x plain", cold / plc,
                cold >= want * plc, f"{cold / plc:.2f}x plain")  # fmt: skip
        frac = get(source, main, "images", "shardcache", "memcpy_frac")
        add(f"{source} images: collated warm delivery >= 50% of memcpy", frac,
            frac >= 0.5, f"{frac:.0%}")  # fmt: skip
        per_rank = get(source, main, "blobs", "shardcache", "warm_rank_sps")
        add(f"{source} blobs: >= 20,000 samples/s per rank", per_rank,
            per_rank >= 20000, f"{per_rank:,.0f}")  # fmt: skip
        gets = get(source, main, "images", "shardcache", "gets_per_object")
        add(f"{source}: GETs per object exactly 1.0", gets, gets == 1.0, f"{gets:.2f}")
        for lay in layouts:
            for d in ("images", "blobs"):
                r = get(source, lay, d, "shardcache", "p99_over_p50")
                add(f"{source} {d} {lay}: p99 within 2x p50 on every rank", r,
                    r <= 2.0, f"worst {r:.1f}x")  # fmt: skip
                sp = get(source, lay, d, "shardcache", "spread")
                add(f"{source} {d} {lay}: rank spread within 10%", sp, sp <= 1.1,
                    f"{sp:.2f}")  # fmt: skip
    lines = [
        "## Targets (shardcache, computed from this run)",
        "",
        *_header(("target", "result", "verdict")),
    ]
    lines += [
        f"| {t} | {text} | {_verdict(ok)} |" for t, text, ok in rows if ok is not None
    ]
    return [*lines, ""]


def _plot(summary: Summary, report: dict[str, Any], png_path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = sorted({(k[0], k[1], k[2]) for k in summary})
    if not groups:
        return
    fig, axes = plt.subplots(
        len(groups), 3, figsize=(17, 4.2 * len(groups)), squeeze=False
    )
    for row, (source, layout, dataset) in zip(axes, groups, strict=True):
        systems = sorted(k[3] for k in summary if k[:3] == (source, layout, dataset))
        x = np.arange(len(systems))
        ms = [summary[(source, layout, dataset, s)] for s in systems]
        row[0].bar(x - 0.2, [_median(m["cold_total_sps"]) for m in ms], 0.4,
                   label="epoch 1")  # fmt: skip
        row[0].bar(x + 0.2, [_median(m["warm_total_sps"]) for m in ms], 0.4,
                   label="warm epochs")  # fmt: skip
        row[0].set_yscale("log")
        row[0].set_title(f"{source} {dataset} {layout}: samples/s, all ranks")
        row[0].set_xticks(x, systems, rotation=20)
        row[0].legend()
        for s, m in zip(systems, ms, strict=True):
            per_epoch = np.median(np.asarray(m["delivery_by_epoch"]), axis=0)
            row[1].plot(np.arange(1, len(per_epoch) + 1), per_epoch, marker="o",
                        label=s)  # fmt: skip
        row[1].axhline(report["memcpy_gbps"][dataset], color="k", ls="--",
                       label="memcpy")  # fmt: skip
        row[1].set_yscale("log")
        row[1].set_xlabel("epoch")
        row[1].set_title(
            f"{source} {dataset} {layout}: collated delivery GB/s per rank"
        )
        row[1].legend(fontsize=7)
        for i, m in enumerate(ms):
            if m["p99_by_rank"]:
                per_rank = np.median(np.asarray(m["p99_by_rank"]), axis=0)
                row[2].scatter([i] * len(per_rank), per_rank, s=18)
        row[2].set_yscale("log")
        row[2].set_title(f"{source} {dataset} {layout}: warm p99 wait per rank, ms")
        row[2].set_xticks(x, systems, rotation=20)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)


def _notes() -> str:
    path = Path(__file__).with_name("NOTES.md")
    return path.read_text() if path.exists() else ""


if __name__ == "__main__":
    src = Path(sys.argv[1])
    write_report(
        json.loads(src.read_text()),
        Path(sys.argv[2])
        if len(sys.argv) > 2
        else Path(__file__).resolve().parents[1] / "BENCHMARKS.md",
        src.with_suffix(".png"),
    )

"""What one warm batch costs the rank, alone: ``ds.loader(B)`` against a memcpy.

The main benchmark's ``of memcpy`` column times the loop's wait for a batch
while 4 ranks, 2 stores and the step's all-reduce share 2 cores, so it mixes
the loader with scheduling. This isolates the loader: one rank, one process,
a warm cache, nothing else running; it reports the time per collated batch,
the delivery rate, and the rate of the same gather done by numpy alone and of
a plain memcpy of the batch's bytes, so the loader's own overhead per batch
stands apart.

    PYTHONPATH=sdk:services:bench .venv/bin/python bench/loader.py \\
        --samples 20000 --sample-bytes 4096 --batch 64

``--steps`` also times each step of the batch path (``STEPS``): where a
batch's fixed cost goes, step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
from samples import blob  # noqa: E402


def _write(root: Path, samples: int, sample_bytes: int) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(samples):
        data = rng.integers(0, 256, sample_bytes, dtype=np.uint8).tobytes()
        (root / f"s-{i:07d}.bin").write_bytes(data)


def _llc_bytes() -> int:
    """The largest CPU cache the machine reports (Linux sysfs), 0 if none."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def _best_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def _mark() -> tuple[float, int, int, int]:
    """This thread's CPU seconds, involuntary and voluntary context switches
    and minor page faults so far (Linux ``RUSAGE_THREAD``)."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time(), r.ru_nivcsw, r.ru_nvcsw, r.ru_minflt


def _cpu_by_thread() -> dict[tuple[str, str], tuple[str, int]]:
    """Nanoseconds on a CPU of every thread on the machine (``schedstat``)."""
    seen = {}
    for stat in Path("/proc").glob("[0-9]*/task/[0-9]*/schedstat"):
        try:
            ns = int(stat.read_text().split()[0])
            comm = (stat.parent / "comm").read_text().strip()
            proc = (stat.parents[2] / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        seen[(stat.parts[2], stat.parts[4])] = (f"{proc}/{comm}", ns)
    return seen


def _ours() -> set[str]:
    """This process and its descendants: the Ray head it started (GCS,
    raylet, workers, the store actor) and the Redis it started."""
    children: dict[str, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = stat.read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(stat.parts[2])
    ours, todo = set(), [str(os.getpid())]
    while todo:
        pid = todo.pop()
        ours.add(pid)
        todo += children.get(pid, [])
    return ours


def _others(before: dict, after: dict, wall_s: float) -> dict:
    """Who else ran while the warm epochs were timed: every thread but this
    one, by CPU milliseconds, against the epochs' wall time; this run's own
    processes apart from the rest of the machine. On 2 cores a thread that
    runs while the loop wants the core is what preempts it."""
    me = (str(os.getpid()), str(threading.get_native_id()))
    ours = _ours()
    used: dict[str, float] = {}
    elsewhere = 0.0
    started = {key[0] for key in after} - {key[0] for key in before}
    for key, (name, ns) in after.items():
        if key == me:
            continue
        ms = (ns - before.get(key, (name, 0))[1]) / 1e6
        if ms <= 0:
            continue
        if key[0] in ours:
            name += " (started meanwhile)" if key[0] in started else ""
            used[name] = used.get(name, 0.0) + ms
        else:
            elsewhere += ms
    top = sorted(used.items(), key=lambda kv: -kv[1])[:8]
    return {
        "wall_ms": round(wall_s * 1e3, 1),
        "this_runs_threads_cpu_ms": round(sum(used.values()), 1),
        "rest_of_machine_cpu_ms": round(elsewhere, 1),
        "top_of_this_run": {name: round(ms, 1) for name, ms in top},
    }


def _tail(waits: list[float], marks: list) -> dict:
    """Where the slow batches' time went. A batch whose wall time exceeds its
    CPU time was off the core: preempted (an involuntary switch: another
    process took the core) or blocked (a voluntary one). One whose CPU time is
    its wall time did more work (page faults, the collector, our code)."""
    wall = np.asarray(waits)
    cpu, invol, vol, faults = (np.asarray(c) for c in zip(*marks, strict=True))
    slow = wall > 2 * np.median(wall)
    quiet = (invol == 0) & (vol == 0)

    def ms(x: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(x, q) * 1e3), 4) if len(x) else None

    return {
        "batches_over_2x_p50": int(slow.sum()),
        "of_them_preempted": int((slow & (invol > 0)).sum()),
        "of_them_blocked": int((slow & (vol > 0) & (invol == 0)).sum()),
        "of_them_on_cpu_throughout": int((slow & quiet).sum()),
        "slow_off_cpu_ms_median": ms(wall[slow] - cpu[slow], 50),
        "slow_page_faults_median": float(np.median(faults[slow]))
        if slow.any()
        else None,
        "all_page_faults_median": float(np.median(faults)),
        "p99_ms_batches_never_switched": ms(wall[quiet], 99),
        "p50_ms_batches_never_switched": ms(wall[quiet], 50),
        "share_never_switched": round(float(quiet.mean()), 4),
    }


# What ``--steps`` times: each step of the batch path, by the function that
# does it (``RankSession.read_batch``'s steps, the dataset's index check
# around it, and the parts of the gather).
STEPS = (
    ("dataset", "DistributedCachedDataset", "_checked"),
    ("session", "RankSession", "read_batch"),
    ("reader", "ChunkReader", "locate"),
    ("session", "RankSession", "_chunks_of_one_generation"),
    ("delivery", None, "collate"),
    ("delivery", None, "batch_shape"),
    ("buffers", "ReusedBuffers", "take_array"),
    ("delivery", None, "gather"),
    ("reader", "ChunkReader", "count"),
    ("session", "RankSession", "_account"),
    ("session", "RankSession", "_look_ahead"),
)


def _time_steps() -> dict[str, list[float]]:
    """Wrap every step of ``STEPS`` in a timer; returns the seconds of each
    call by step (cleared by the caller before the timed epochs). A wrapper
    adds ~0.3 us to its step and to the steps around it."""
    import importlib

    spent: dict[str, list[float]] = {}
    for module, cls, name in STEPS:
        owner = importlib.import_module(f"shardcache.{module}")
        owner = getattr(owner, cls) if cls else owner
        fn, times = getattr(owner, name), spent.setdefault(name, [])

        def timed(*a, _fn=fn, _times=times, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _times.append(time.perf_counter() - t)

        setattr(owner, name, timed)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--sample-bytes", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--world", type=int, default=4, help="this rank's shard is 1/W")
    ap.add_argument("--epochs", type=int, default=5, help="warm epochs timed")
    ap.add_argument(
        "--dataloader", action="store_true",
        help="time the README's DataLoader(ds, batch_size=B, sampler=ds.sampler) "
        "instead of ds.loader(B)",
    )  # fmt: skip
    ap.add_argument(
        "--settle-s", type=float, default=0.0,
        help="seconds between the cold epoch and the timed ones",
    )  # fmt: skip
    ap.add_argument(
        "--steps", action="store_true",
        help="also time each step of the batch path (adds ~0.3 us per step)",
    )  # fmt: skip
    args = ap.parse_args()

    import ray
    import torch

    from shardcache import DistributedCachedDataset
    from shardcache.embedded import start_redis_server

    spent = _time_steps() if args.steps else {}
    tmp = Path(tempfile.mkdtemp(prefix="shardcache-loader-"))
    _write(tmp / "data", args.samples, args.sample_bytes)
    redis_proc, redis_url = start_redis_server(tmp, password="bench")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ds = DistributedCachedDataset(
            f"{tmp / 'data'}/",
            preprocess=blob,
            redis_url=redis_url,
            namespace="loaderbench",
            rank=0,
            world_size=args.world,
            seed=0,
        )
        if args.dataloader:
            loader = torch.utils.data.DataLoader(
                ds, batch_size=args.batch, sampler=ds.sampler, drop_last=True
            )
        else:
            loader = ds.loader(args.batch, drop_last=True)
        ds.set_epoch(0)
        for _ in loader:  # the cold epoch: builds and maps every chunk
            pass
        time.sleep(args.settle_s)
        waits: list[float] = []
        marks: list[tuple[float, int, int, int]] = []  # per batch, see _tail
        batch_bytes = 0
        cpu_before = _cpu_by_thread()
        for times in spent.values():
            times.clear()  # the cold epoch's calls
        for epoch in range(1, 1 + args.epochs):
            ds.set_epoch(epoch)
            t, mark = time.perf_counter(), _mark()
            for batch in loader:
                now, after = time.perf_counter(), _mark()
                waits.append(now - t)
                marks.append(tuple(b - a for a, b in zip(mark, after, strict=True)))
                batch_bytes = batch.numel() * batch.element_size()
                t, mark = now, after
        others = _others(cpu_before, _cpu_by_thread(), sum(waits))
        ds.close()
    finally:
        ray.shutdown()
        redis_proc.terminate()

    shard = np.random.default_rng(1).integers(
        0, 256, (args.samples // args.world, args.sample_bytes), dtype=np.uint8
    )
    picks = np.random.default_rng(2).integers(0, len(shard), args.batch)
    out = torch.empty((args.batch, args.sample_bytes), dtype=torch.uint8)
    flat = shard[: args.batch].copy()
    gather_ms = _best_ms(lambda: np.take(shard, picks, axis=0, out=out.numpy()), 2000)
    # The loader reads other rows at every batch (a shuffled epoch), not the
    # same rows 2,000 times from a warm CPU cache: numpy's gather of fresh
    # rows per call is the like-for-like reference for its own gather.
    fresh = iter(np.random.default_rng(3).integers(0, len(shard), (2000, args.batch)))
    fresh_ms = _best_ms(
        lambda: np.take(shard, next(fresh), axis=0, out=out.numpy()), 2000
    )
    memcpy_ms = _best_ms(lambda: out.numpy().reshape(-1).__setitem__(
        slice(None), flat.reshape(-1)), 2000)  # fmt: skip
    # The same copy from memory the CPU cache does not hold, while the copy
    # above reads the same batch-sized source from the cache every time:
    # contiguous slices, in turn, of a buffer 4x the last-level cache the
    # machine reports (2 GiB at least). Whether the loader's rows come from
    # the cache or from DRAM depends on its shard's size against that cache.
    cold_src = np.ones(max(2 * 2**30, 4 * _llc_bytes()), dtype=np.uint8)
    span = out.numel() * out.element_size()
    slots = iter(range(10**9))

    def cold_copy() -> None:
        at = (next(slots) * span) % (len(cold_src) - span)
        out.numpy().reshape(-1).view(np.uint8)[:] = cold_src[at : at + span]

    memcpy_cold_ms = _best_ms(cold_copy, 2000)
    loader_ms = float(np.median(waits) * 1e3)
    result = {
        "command": "bench/loader.py "
        f"--samples {args.samples} --sample-bytes {args.sample_bytes} "
        f"--batch {args.batch} --world {args.world} --epochs {args.epochs}"
        + (" --dataloader" if args.dataloader else "")
        + (" --steps" if args.steps else ""),
        "warm_batches": len(waits),
        "batch_bytes": batch_bytes,
        "loader_ms_p50": round(loader_ms, 4),
        "loader_ms_p99": round(float(np.percentile(waits, 99) * 1e3), 4),
        "loader_gbps": round(batch_bytes / loader_ms / 1e6, 3),
        "numpy_gather_ms": round(gather_ms, 4),
        "numpy_gather_fresh_rows_ms": round(fresh_ms, 4),
        "memcpy_ms": round(memcpy_ms, 4),
        "memcpy_gbps": round(batch_bytes / memcpy_ms / 1e6, 3),
        "of_memcpy": round(memcpy_ms / loader_ms, 3),
        "memcpy_uncached_ms": round(memcpy_cold_ms, 4),
        "of_memcpy_uncached": round(memcpy_cold_ms / loader_ms, 3),
        "llc_bytes": _llc_bytes(),
        "shard_bytes": args.samples // args.world * args.sample_bytes,
        "overhead_ms_per_batch": round(loader_ms - gather_ms, 4),
        "overhead_vs_fresh_rows_ms": round(loader_ms - fresh_ms, 4),
        "samples_per_s": round(args.batch / loader_ms * 1e3),
        "tail": _tail(waits, marks),
        "steps_us_p50_mean": {
            name: [
                round(float(np.median(t)) * 1e6, 1),
                round(float(np.mean(t)) * 1e6, 1),
            ]
            for name, t in spent.items()
            if t
        },
        "other_threads_on_cpu": others,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

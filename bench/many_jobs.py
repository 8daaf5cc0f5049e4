"""N concurrent training jobs on one dataset on one node (issue 30), each started
as a user starts one, shardcache beside what those users run today.

    scripts/bench.sh jobs --jobs 1,4,8,16 --write

For each source (the project's S3 emulator with its latency model, GETs
counted at the server; and the same files on local disk, page cache warm),
each system and each N, N jobs are started ``--stagger-s`` apart, each one
``python -m torch.distributed.run --nproc_per_node=2 bench/job.py`` (2 gloo
ranks, the README's loop, a fixed sleep plus an all-reduce per step), so
later jobs start while earlier ones are mid-epoch. Systems:

- ``shardcache``: embedded defaults (the first job starts a private Redis
  and Ray head under the run's own HOME; every later job joins them),
  ``ds.loader(B)``. A fresh HOME per (source, N): every N starts cold.
- ``plain``: a map-style Dataset reading each object (s3fs) or file in
  ``__getitem__``, ``DataLoader(num_workers=--workers)``; jobs share only
  the page cache.
- ``litdata`` and ``mosaic``: ``optimize()`` / ``MDSWriter`` once (timed
  apart, its GETs counted apart), then ``StreamingDataset`` with a cache
  directory of each job's own; Mosaic in ``.venv-mosaic`` (bench/mosaic.py).
  Either one missing here is a note under the table.

Per run: per-job samples/s (from the job's launch, start-up included, and
from its first batch), aggregate samples/s (every sample of every job over
the time from the first launch to the last end), GETs per object, memory
(peak RssAnon of the jobs' process trees; of the cache side, the shardcache
head's processes; /dev/shm growth, where Ray's object store lives; the
bytes the stores report cached), disk bytes of the caches, the time to the
first batch of the last job, how many earlier jobs were mid-epoch when it
got that batch, and the later jobs' samples not cached yet when asked
(they waited on a source read, their own or one they joined).
Writes ``bench/results/jobs-<date>.json``; ``--write`` puts the table in
BENCHMARKS.md under its own heading.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "sdk"), str(ROOT / "services")]

from jobs_report import HEADING, row, table  # noqa: E402
from launch import MOSAIC_PYTHON  # noqa: E402
from memory import available_bytes, disk_bytes, rss_anon, shm_used, tree_anon  # noqa: E402
from samples import VALUE_BYTES  # noqa: E402

from report import write_section  # noqa: E402

SYSTEMS = ("shardcache", "plain", "litdata", "mosaic")
CONVERTED = ("litdata", "mosaic")  # a conversion step first, once per source
RUN_TIMEOUT_S = 1200  # one (source, system, N) run; a hung one costs this
MEM_POLL_S = 0.5
# A job is not started while the machine has less memory available than
# this (other people's tests share it); the run says how many it skipped.
MIN_AVAILABLE_BYTES = 2 * 2**30
MEM_WAIT_S = 60


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--jobs", default="1,4,8,16", help="comma list of N")
    ap.add_argument("--systems", dest="run_systems", default=",".join(SYSTEMS))
    ap.add_argument("--sources", default="s3,local", help="comma list of: s3, local")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--image-px", type=int, default=376, help="~64 KB JPEGs")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (plain)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the training step")
    ap.add_argument("--stagger-s", type=float, default=2.0, help="between job starts")
    ap.add_argument(
        "--profile",
        default="s3-standard",
        choices=["none", "s3-standard", "slow", "express"],
        help="latency model of the s3 source",
    )
    ap.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    ap.add_argument("--out", default=str(HERE / "results"), help="for the JSON")
    args = ap.parse_args(argv)
    # What bench/prepare.py's writers read: no blobs, no tar shards, no cap.
    args.blobs, args.bandwidth_mb_s, args.systems = 0, 0.0, ""
    return args


# -- the data ----------------------------------------------------------------------
def _prepare(args: argparse.Namespace, tmp: Path) -> tuple[Any, dict[str, Any]]:
    """The JPEG set on each source (bench/prepare.py's writers); returns the
    emulator (or None) and, per source, what a job's config needs."""
    from prepare import prepare_local, prepare_s3

    data: dict[str, Any] = {}
    emulator = None
    if "s3" in args.sources:
        emulator, fs, calibration, sizes = prepare_s3(args, [])
        urls = sorted(f"s3://{p}" for p in fs.find("bench/images/"))
        data["s3"] = {
            "prefix": "s3://bench/images/",
            "urls": urls,
            "storage_options": emulator.storage_options(),
            "endpoint": emulator.endpoint_url,
            "object_bytes": sizes["images"],
            "calibration": calibration,
        }
    if "local" in args.sources:
        sizes = prepare_local(tmp / "local", args)
        folder = tmp / "local" / "images"
        data["local"] = {
            "prefix": f"{folder}/",
            "urls": sorted(str(p) for p in folder.iterdir()),
            "storage_options": {},
            "object_bytes": sizes["images"],
        }
    return emulator, data


def _user_env(home: Path) -> dict[str, str]:
    """A user's shell: their HOME, the venv on PATH, AWS test credentials, the
    checkout on PYTHONPATH; nothing shardcache-, Ray- or torchrun-specific."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHARDCACHE_", "TORCHELASTIC_", "RAY_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        HOME=str(home),
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        # The checkout first, then what the caller had (e.g. a LitData install).
        PYTHONPATH=os.pathsep.join(
            [str(ROOT / "sdk"), str(ROOT / "services"), str(HERE)]
            + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return env


# -- memory and disk -----------------------------------------------------------------
class _Meter(threading.Thread):
    """Peak memory while jobs run: the jobs' process trees (RssAnon of each
    torchrun agent, plus what its ranks and workers hold of their own), the
    cache side (the processes of the shardcache head under ``home``),
    /dev/shm growth (Ray's object store) and the bytes under ``caches``
    (LitData's and Mosaic's per-job caches)."""

    def __init__(self, home: Path | None, caches: Path):
        super().__init__(daemon=True)
        self.home, self.caches, self.agents = home, caches, []
        self.shm0 = shm_used()
        self.peak = {"jobs_anon": 0, "cache_anon": 0, "shm": 0, "total": 0, "disk": 0}
        self._done = threading.Event()

    def _head(self) -> list[int]:
        from shardcache.local_ray import HEAD_MARKER, ray_temp_dir
        from shardcache.processes import processes_marked

        state = self.home / ".cache" / "shardcache"  # type: ignore[operator]
        return processes_marked(HEAD_MARKER, str(ray_temp_dir(state)))

    def run(self) -> None:
        head: list[int] = []
        polls = 0
        while not self._done.wait(MEM_POLL_S):
            if polls % 6 == 0:  # a /proc scan and a du: every 3 s, not every poll
                if self.home is not None:
                    head = self._head()
                self.peak["disk"] = max(self.peak["disk"], disk_bytes(self.caches))
            polls += 1
            now = {
                "jobs_anon": sum(tree_anon(p) for p in list(self.agents)),
                "cache_anon": sum(rss_anon(p) for p in head),
                "shm": max(0, shm_used() - self.shm0),
            }
            now["total"] = sum(now.values())
            for k, v in now.items():
                self.peak[k] = max(self.peak[k], v)

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        return self.peak


# -- one run: N jobs ---------------------------------------------------------------
def _convert(
    system: str,
    args: argparse.Namespace,
    source: str,
    data: dict[str, Any],
    tmp: Path,
    emulator: Any,
) -> dict[str, Any]:
    """LitData's optimize() or Mosaic's MDSWriter, once per source (bench/launch.py
    runs them); the jobs read what it wrote. Timed, and its GETs counted, apart."""
    from launch import CONVERSIONS
    from mosaic import out_dir, remote_dir

    cfg = {**_job_cfg(args, source, data, tmp), "namespace": f"jobs{source}"}
    if emulator is not None:
        emulator.reset_counts()
    started = time.perf_counter()
    CONVERSIONS[system](cfg)
    out = {
        "prepare_s": time.perf_counter() - started,
        "prepare_gets": emulator.total_gets if source == "s3" and emulator else 0,
    }
    if system == "litdata":
        return {**out, "litdata_prefix": cfg["litdata_prefix"]}
    return {**out, "mosaic_remote": remote_dir(cfg), "mosaic_out": out_dir(cfg)}


def _job_cfg(args: argparse.Namespace, source: str, data: dict[str, Any],
             tmp: Path) -> dict[str, Any]:  # fmt: skip
    return {
        "source": source,
        "dataset": "images",
        "prefix": data["prefix"],
        "urls": data["urls"],
        "storage_options": data["storage_options"],
        "endpoint": data.get("endpoint"),  # Mosaic's S3 client needs it
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "value_bytes": VALUE_BYTES["images"],
        "workers": args.workers,
        "step_ms": args.step_ms,
        "ranks_per_node": 2,
        "world": 2,
        "epoch_cap_s": 0.0,
        "tmp": str(tmp),
    }


@dataclasses.dataclass
class JobsRun:
    """One run: ``n`` jobs of ``system`` on ``source``, and where they live.

    ``data`` is the source's entry of :func:`_prepare`; ``extra`` what a
    conversion (LitData, Mosaic) gives the jobs to read.
    """

    args: argparse.Namespace
    system: str
    source: str
    n: int
    data: dict[str, Any]
    tmp: Path
    extra: dict[str, Any]
    launched: list[float] = dataclasses.field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = dataclasses.field(default_factory=list)

    @property
    def home(self) -> Path:  # the user's HOME: the embedded cache's state
        return self.tmp / f"{self.system}-{self.source}-{self.n}" / "home"

    @property
    def work(self) -> Path:  # configs, logs, the ranks' results
        return self.home.parent / "work"

    @property
    def caches(self) -> Path:  # the jobs' own caches (LitData, Mosaic)
        return self.home.parent / "caches"

    def job_cfg(self, k: int) -> Path:
        cfg = {
            **_job_cfg(self.args, self.source, self.data, self.caches),
            **self.extra,
            "namespace": f"job{k}",  # the job's own cache directory
        }
        path = self.work / f"job{k}.json"
        path.write_text(json.dumps(cfg))
        return path


def run_jobs(run: JobsRun, emulator: Any) -> dict[str, Any]:
    """Start the run's jobs ``--stagger-s`` apart, wait for them, measure."""
    for d in (run.home, run.work, run.caches):
        d.mkdir(parents=True)
    env = _user_env(run.home)
    if emulator is not None:
        emulator.reset_counts()
    shardcache = run.system == "shardcache"
    meter = _Meter(run.home if shardcache else None, run.caches)
    meter.start()
    try:
        codes = _start_and_wait(run, env, meter)
    finally:
        for p in run.procs:
            if p.poll() is None:
                p.kill()
        peak = meter.stop()
        store_bytes = _stop_embedded(run.home, env) if shardcache else None
    failed = [k for k, c in enumerate(codes) if c != 0]
    if failed:
        # The run's folder goes with the temp dir: keep the failed jobs' logs.
        kept = Path(run.args.out) / f"failed-{run.system}-{run.source}-{run.n}"
        kept.mkdir(parents=True, exist_ok=True)
        for k in failed:
            shutil.copy(run.work / f"job{k}.log", kept / f"job{k}.log")
        raise RuntimeError(f"jobs {failed} failed; their logs are in {kept}")
    result = {
        "system": run.system,
        "source": run.source,
        "n": run.n,
        "skipped_for_memory": run.n - len(run.procs),
        "launched": run.launched,
        "jobs": [
            [json.loads((run.work / f"job{k}.{r}.json").read_text()) for r in (0, 1)]
            for k in range(len(run.procs))
        ],
        "memory_peak": peak,
        "disk_bytes": max(peak["disk"], disk_bytes(run.caches)),
        "store_bytes": store_bytes,
        "objects": len(run.data["urls"]),
        **{k: v for k, v in run.extra.items() if k.startswith("prepare_")},
    }
    if emulator is not None and run.source == "s3":
        result["gets"] = emulator.total_gets
        result["max_gets_per_object"] = max(emulator.gets.values(), default=0)
    shutil.rmtree(run.caches, ignore_errors=True)
    return result


def _start_and_wait(run: JobsRun, env: dict[str, str], meter: _Meter) -> list[int]:
    """Start up to ``run.n`` jobs ``--stagger-s`` apart (fewer when memory
    runs short); their exit codes."""
    t0 = time.time()
    python = str(MOSAIC_PYTHON) if run.system == "mosaic" else sys.executable
    for k in range(run.n):
        time.sleep(max(0.0, t0 + k * run.args.stagger_s - time.time()))
        deadline = time.time() + MEM_WAIT_S
        while available_bytes() < MIN_AVAILABLE_BYTES and time.time() < deadline:
            time.sleep(1.0)
        if available_bytes() < MIN_AVAILABLE_BYTES:
            break
        cfg_path = run.job_cfg(k)
        with open(run.work / f"job{k}.log", "wb") as log:
            run.launched.append(time.time())
            run.procs.append(
                subprocess.Popen(
                    [
                        python,
                        "-m",
                        "torch.distributed.run",
                        "--nproc_per_node=2",
                        "--master-addr=127.0.0.1",
                        f"--master-port={_free_port()}",
                        str(HERE / "job.py"),
                        run.system,
                        str(cfg_path),
                        str(run.work / f"job{k}"),
                    ],
                    cwd=run.work,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
        meter.agents.append(run.procs[-1].pid)
    end = time.time() + RUN_TIMEOUT_S
    return [p.wait(timeout=max(1.0, end - time.time())) for p in run.procs]


def _stop_embedded(home: Path, env: dict[str, str]) -> int | None:
    """The bytes the stores say they hold, then ``shardcache local stop``."""
    try:
        return _store_bytes(home)
    except (OSError, ValueError, KeyError):
        return None  # the jobs failed before the cache started
    finally:
        subprocess.run(
            [sys.executable, "-m", "shardcache_server.cli", "local", "stop"],
            env=env, capture_output=True, timeout=120,
        )  # fmt: skip


def _free_port() -> int:
    from shardcache.embedded import free_port

    return free_port()


def _store_bytes(home: Path) -> int:
    """The bytes the stores say they hold (every dataset, every node)."""
    from shardcache.index import RedisIndex

    url = json.loads((home / ".cache" / "shardcache" / "redis.json").read_text())["url"]
    time.sleep(1.5)  # one stats flush after the last batch
    stores = RedisIndex.from_url(url).stores()
    return sum(
        sum(info.get("bytes_by_dataset", {}).values()) for info in stores.values()
    )


def _missing(system: str) -> str:
    """Why ``system`` cannot run here, or ``""``."""
    if system == "mosaic":
        if not MOSAIC_PYTHON.exists():
            return f"{MOSAIC_PYTHON} is missing; scripts/bench.sh makes it"
        return ""
    try:
        import litdata  # noqa: F401
    except ImportError as exc:
        return f"{exc}; scripts/bench.sh installs litdata"
    return ""


def _uptime() -> str:
    done = subprocess.run(["uptime"], capture_output=True, text=True)
    return done.stdout.strip().split("load average:")[-1].strip()


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    load0 = _uptime()
    tmp = Path(tempfile.mkdtemp(prefix="shardcache-jobs-"))
    emulator, data = _prepare(args, tmp)
    systems = [s for s in args.run_systems.split(",") if s]
    results, notes = [], []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"jobs-{dt.datetime.now().strftime('%Y-%m-%dT%H%M')}.json"
    try:
        for source in args.sources.split(","):
            extra: dict[str, Any] = {}
            for system in systems:
                if system in CONVERTED:
                    missing = _missing(system)
                    if missing:
                        notes.append(f"{system}: not run here ({missing})")
                        continue
                    extra = _convert(system, args, source, data[source], tmp, emulator)
                    notes.append(
                        f"{system} on {source}: its conversion ran once before the "
                        f"jobs ({extra['prepare_s']:.0f} s, {extra['prepare_gets']} "
                        "GETs), outside the jobs' figures"
                    )
                for n in (int(x) for x in args.jobs.split(",")):
                    print(f"{source} {system} N={n} ...", end=" ", flush=True)
                    try:
                        run = JobsRun(args, system, source, n, data[source], tmp,
                                      extra if system in CONVERTED else {})  # fmt: skip
                        result = run_jobs(run, emulator)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        print(f"failed: {exc}", flush=True)
                        notes.append(f"{system} {source} N={n} failed: {exc}"[:400])
                        continue
                    results.append(result)
                    print(row(result), flush=True)
                    # Kept as it goes: a run stopped early keeps what finished.
                    json_path.write_text(
                        json.dumps(
                            {"args": vars(args), "results": results}, default=str
                        )
                    )
    finally:
        if emulator is not None:
            emulator.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    load = f"{load0} / {_uptime()}"
    command = "scripts/bench.sh jobs " + " ".join(argv or sys.argv[1:])
    section = table(results, args, command.strip(), data, sorted(set(notes)), load)
    print(section)
    json_path.write_text(
        json.dumps({"args": vars(args), "load": load, "results": results}, default=str)
    )
    if args.write:
        write_section(ROOT / "BENCHMARKS.md", HEADING, section)


if __name__ == "__main__":
    main()

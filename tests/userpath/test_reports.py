"""Reports without ceremony: what a rank delivered reaches Redis however it ends.

A script that raises mid-epoch, one SIGTERMed (as torchrun does to the other
ranks when one fails) and one SIGKILLed: no ``close()`` anywhere.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import redis as redis_py

from shardcache.usage import UsageReader

DELIVER = """
import json, sys, time
import numpy as np
from shardcache import DistributedCachedDataset

root, mode = sys.argv[1], sys.argv[2]
ds = DistributedCachedDataset(root, name="reports")
print(json.dumps({"job": ds.job}), flush=True)
delivered = 0
for epoch in range(1000):
    ds.set_epoch(epoch)
    for batch in ds.loader(16):
        delivered += len(batch)
        print(json.dumps({"delivered": delivered}), flush=True)
        if mode == "raise" and delivered == 80:
            raise RuntimeError("the model diverged")
        time.sleep(0.05)
"""


def _data(root: Path, n: int = 160) -> None:
    root.mkdir()
    for i in range(n):
        np.save(root / f"{i:04d}.npy", np.full((8,), i, np.float32))


def _reader(home: Path) -> UsageReader:
    url = json.loads((home / ".cache" / "shardcache" / "redis.json").read_text())
    return UsageReader(redis_py.Redis.from_url(url["url"], decode_responses=True))


def _start(user, script: Path, root: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), f"{root}/", mode],
        cwd=user.workdir, env=user.env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _follow(proc: subprocess.Popen[str], until: int) -> tuple[str, int]:
    """Read the script's lines until it delivered ``until`` samples."""
    job, delivered = "", 0
    assert proc.stdout is not None
    for line in proc.stdout:
        out = json.loads(line)
        job = out.get("job", job)
        delivered = out.get("delivered", delivered)
        if delivered >= until:
            break
    return job, delivered


def _follow_for(proc: subprocess.Popen[str], seconds: float, delivered: int) -> int:
    """Keep reading the script's lines for ``seconds``; the last count seen."""
    assert proc.stdout is not None
    deadline = time.monotonic() + seconds
    for line in proc.stdout:
        delivered = json.loads(line).get("delivered", delivered)
        if time.monotonic() > deadline:
            break
    return delivered


def _drain(proc: subprocess.Popen[str], delivered: int) -> int:
    """The last count the ended script printed (its buffered lines)."""
    assert proc.stdout is not None
    rest = [json.loads(x) for x in proc.stdout.read().splitlines() if x]
    return max([delivered] + [x.get("delivered", 0) for x in rest])


def test_a_rank_that_raises_reports_what_it_delivered(user):
    root = user.workdir / "data"
    _data(root)
    script = user.write("train.py", DELIVER)
    proc = _start(user, script, root, "raise")
    job, delivered = _follow(proc, 80)
    assert proc.wait(timeout=120) == 1
    assert "the model diverged" in proc.stderr.read()
    totals = _reader(user.home).job_totals("reports", job)
    assert (delivered, totals.samples) == (80, 80)
    [rank] = [r for r in _reader(user.home).ranks("reports") if r.job == job]
    assert rank.state(time.time(), 3.0) == "ended"


def test_sigterm_reports_everything_and_sigkill_loses_at_most_one_second(user):
    root = user.workdir / "data"
    _data(root)
    script = user.write("train.py", DELIVER)

    proc = _start(user, script, root, "run")
    job, delivered = _follow(proc, 96)
    proc.send_signal(signal.SIGTERM)  # what torchrun sends the other ranks
    # It exited (Ray's driver, or shardcache when no one else does, turns
    # SIGTERM into SystemExit) rather than died of the signal (rc < 0).
    assert proc.wait(timeout=60) in (signal.SIGTERM, 128 + signal.SIGTERM)
    delivered = _drain(proc, delivered)
    assert _reader(user.home).job_totals("reports", job).samples == delivered

    proc = _start(user, script, root, "run")
    job, delivered = _follow(proc, 160)
    delivered = _follow_for(proc, 2.5, delivered)  # a few flushes go out
    proc.kill()
    proc.wait(timeout=60)
    delivered = _drain(proc, delivered)
    time.sleep(3.5)  # the rank's silence outlasts three flush intervals
    reported = _reader(user.home).job_totals("reports", job).samples
    assert reported > 0
    # Batches come every ~50 ms: one flush interval (1 s) is ~20 of them.
    assert delivered - 20 * 16 <= reported <= delivered
    [rank] = [r for r in _reader(user.home).ranks("reports") if r.job == job]
    assert rank.state(time.time(), 3.0) == "lost"


IN_MAIN = """
import gc, io, json, sys, weakref
import numpy as np
import torch
from shardcache import DistributedCachedDataset

def load_npy(data):
    return torch.from_numpy(np.load(io.BytesIO(data)))

def main():
    ds = DistributedCachedDataset(sys.argv[1], preprocess=load_npy, name="in-main")
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler)
    ds.set_epoch(0)
    delivered = 0
    for step, x in enumerate(loader):
        delivered += len(x)
        if step == 1:
            torch.save(ds.state_dict(), f"state-{ds.rank}.pt")
            break
    print(json.dumps({"job": ds.job, "delivered": delivered}), flush=True)
    return weakref.ref(ds._session)  # the test's probe, not the user's code

if __name__ == "__main__":
    session = main()
    gc.collect()  # the collector may run any time after main() returns; here it does
    print(json.dumps({"collected": session() is None}), flush=True)
"""


def test_a_dataset_collected_before_exit_still_reports(user):
    """A README trial (2026-12-02): a checkpointing script whose dataset
    lived in ``main()`` delivered 2 x 64 samples and its job never reached
    ``shardcache stats``: the cyclic GC took the dataset once ``main``
    returned, and with it the counts the exit hook would have written."""
    root = user.workdir / "data"
    _data(root, 64)
    script = user.write("train.py", IN_MAIN)
    done = user.torchrun(script, f"{root}/")
    assert done.returncode == 0, done.stderr[-4000:]
    out = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    # The path under test: each rank's session was gone before its exit hook.
    assert [x["collected"] for x in out if "collected" in x] == [True, True]
    lines = [x for x in out if "job" in x]
    assert [x["delivered"] for x in lines] == [16, 16]
    reader = _reader(user.home)
    for job in {x["job"] for x in lines}:
        mine = sum(x["delivered"] for x in lines if x["job"] == job)
        assert reader.job_totals("in-main", job).samples == mine
    ranks = [r for r in reader.ranks("in-main") if r.job in {x["job"] for x in lines}]
    assert len(ranks) == 2
    assert all(r.state(time.time(), 3.0) == "ended" for r in ranks)

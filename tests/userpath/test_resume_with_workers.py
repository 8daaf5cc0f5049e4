"""Mid-epoch resume under the README's DataLoader with workers.

The workers read ahead of the loop (``prefetch_factor * num_workers``
batches), so the process that calls ``ds.state_dict()`` read nothing itself:
its count was 0, and a resume replayed every batch the loop had taken, with
no word. Now it says so and asks for ``consumed=``, and with it the resume is
exact: each of the epoch's samples once, across the two runs. A count one
rank gets wrong is refused on every rank as it is saved (before, the rank
that failed left the others waiting in the collective).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SCRIPT = """
import json, sys
import numpy as np
import torch
import torch.distributed as dist
from shardcache import DistributedCachedDataset
from shardcache.errors import ConfigError

if __name__ == "__main__":
    dist.init_process_group("gloo")
    url, state_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
    ds = DistributedCachedDataset(url)
    resuming = state_file != "-"
    if resuming:
        ds.load_state_dict(torch.load(state_file, weights_only=False))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler,
                                         num_workers=2, multiprocessing_context="spawn")
    got = {"values": [], "refused": "", "one_wrong": ""}
    for step, batch in enumerate(loader, start=1):
        got["values"] += batch[:, 0].tolist()
        if not resuming and step == 2:
            try:
                ds.state_dict()
            except ConfigError as exc:
                got["refused"] = str(exc)
            try:  # one rank's count is wrong: every rank is told, none waits for it
                ds.gather_state_dict(consumed=step * 8 if dist.get_rank() == 0 else 10**6)
            except ConfigError as exc:
                got["one_wrong"] = str(exc)
            state = ds.gather_state_dict(consumed=step * 8)
            if dist.get_rank() == 0:
                torch.save(state, f"{out}.state")
            break
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(got, f)
"""


def test_resume_under_dataloader_workers_asks_for_the_count_then_is_exact(user):
    data = user.workdir / "data"
    data.mkdir()
    for i in range(64):
        np.save(data / f"{i:03d}.npy", np.full(4, i, np.int64))
    script = user.write("train.py", SCRIPT)
    out = user.workdir / "out"
    url = f"file://{data}/*.npy"
    first = user.torchrun(script, url, "-", f"{out}-1")
    assert first.returncode == 0, first.stderr[-4000:]
    second = user.torchrun(script, url, f"{out}-1.state", f"{out}-2")
    assert second.returncode == 0, second.stderr[-4000:]
    seen = []
    for rank in (0, 1):
        before = json.loads(Path(f"{out}-1.{rank}.json").read_text())
        after = json.loads(Path(f"{out}-2.{rank}.json").read_text())
        assert (
            "consumed=" in before["refused"]
            and "StatefulDataLoader" in before["refused"]
        )
        assert "consumed=1000000" in before["one_wrong"], before["one_wrong"]
        assert len(before["values"]) == 16
        seen += before["values"] + after["values"]
    assert sorted(seen) == list(range(64)), sorted(seen)
    # Rank 0's own count was right; it raised rather than wait for rank 1.
    assert (
        "rank 1 could not give its state"
        in json.loads(Path(f"{out}-1.0.json").read_text())["one_wrong"]
    )

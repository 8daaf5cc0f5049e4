"""A weighted mixture of three datasets (two S3 prefixes and a local ``.npy``
file) under plain torchrun: 4 gloo ranks stop mid-epoch and save the
gathered state; the same state then resumes at 2 ranks (2 DataLoader
workers each), 3 and 6 ranks (``mix.loader()``), and each resumed job
finishes the epoch with every sample delivered exactly once and each rank
batch within the stated tolerance of the weights, then runs the next epoch
on the curriculum's new weights. (Workers only fetch: the order is dealt in
the rank's process, so their number cannot change it; more workers would
only slow this 3-torchrun test down.)

Each sample is ``[component, index]``, so what a batch holds says which
sample of which component a rank trained on.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np

from shardcache.mix_order import mixture_order, window_tolerance

SIZES = {"web": 60, "code": 30, "books": 30}
WEIGHTS = {0: [0.5, 0.25, 0.25], 1: [0.25, 0.5, 0.25]}
BATCH = 5

SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from shardcache import DistributedCachedDataset
from shardcache.mixture import MixedDataset

def curriculum(epoch):
    return [0.5, 0.25, 0.25] if epoch == 0 else [0.25, 0.5, 0.25]

if __name__ == "__main__":
    dist.init_process_group("gloo")
    bucket, options, phase, workers = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    web = DistributedCachedDataset(f"s3://{bucket}/web/", storage_options=options, chunk_samples=8)
    code = DistributedCachedDataset(f"s3://{bucket}/code/", storage_options=options, chunk_samples=8)
    books = DistributedCachedDataset("books.npy", chunk_samples=8)
    mix = MixedDataset([web, code, books], weights=curriculum, batch_size=5, seed=3,
                       names=["web", "code", "books"])
    rank, got = dist.get_rank(), {}
    if phase == "save":
        mix.set_epoch(0)
        got[0] = []
        for x in mix.loader():
            got[0].append(x.tolist())
            if len(got[0]) == 2:
                break  # preempted mid-epoch
        state = mix.gather_state_dict()
        if rank == 0:
            with open("state.json", "w") as f:
                json.dump(state, f)
    else:
        with open("state.json") as f:
            mix.load_state_dict(json.load(f))
        for epoch in (0, 1):
            mix.set_epoch(epoch)
            if workers:
                batches = torch.utils.data.DataLoader(
                    mix, batch_sampler=mix.sampler.batches(), num_workers=workers,
                    multiprocessing_context="spawn")
            else:
                batches = mix.loader()
            got[epoch] = [x.tolist() for x in batches]
    with open(f"{phase}.{rank}.json", "w") as f:
        json.dump({"epochs": got, "stats": mix.stats()["delivered"]}, f)
"""


def _npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value)
    return buf.getvalue()


def _run(user, script, world, phase, workers, s3, bucket) -> list[dict]:
    done = user.torchrun(
        script, bucket, json.dumps(s3.storage_options()), phase, str(workers),
        nproc=world,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return [
        json.loads((user.workdir / f"{phase}.{r}.json").read_text())
        for r in range(world)
    ]


def _check_batches(ranks: list[dict], epoch: int) -> list[tuple[int, int]]:
    """Every rank's batches of ``epoch``: equal step counts, each batch of
    BATCH samples within the tolerance; returns the samples delivered."""
    steps = {len(r["epochs"][str(epoch)]) for r in ranks}
    assert len(steps) == 1, steps  # every rank the same number of steps
    weights = np.array(WEIGHTS[epoch])
    tolerance = window_tolerance(weights)
    delivered = []
    for r in ranks:
        for batch in r["epochs"][str(epoch)]:
            samples = [(int(c), int(i)) for c, i in batch]
            delivered += samples
            if len(samples) == BATCH:
                counts = np.bincount([c for c, _ in samples], minlength=3)
                assert (np.abs(counts - weights * BATCH) <= tolerance).all(), batch
    return delivered


def test_mixture_of_4_ranks_resumes_at_2_3_and_6_ranks_exactly_once(
    user, s3, s3fs_client, bucket
):
    for k, name in enumerate(("web", "code")):
        s3fs_client.pipe(
            {
                f"{bucket}/{name}/{i:03d}.npy": _npy(np.array([k, i], np.float32))
                for i in range(SIZES[name])
            }
        )
    rows = np.stack([np.array([2, i], np.float32) for i in range(SIZES["books"])])
    np.save(user.workdir / "books.npy", rows)
    script = user.write("mix.py", SCRIPT)

    saved = _run(user, script, 4, "save", 0, s3, bucket)
    first = _check_batches(saved, 0)
    assert len(first) == 4 * 2 * BATCH
    state = json.loads(Path(user.workdir / "state.json").read_text())
    assert state["weights"] == WEIGHTS[0] and state["start"] == len(first)

    everything = [(k, i) for k, n in enumerate(SIZES.values()) for i in range(n)]
    # Epoch 1 on the new weights, "cycle": until web has read each sample
    # once, code and books starting new passes meanwhile.
    second = mixture_order(list(SIZES.values()), WEIGHTS[1], seed=3, epoch=1)
    again = Counter(
        zip(second.components.tolist(), second.indices.tolist(), strict=True)
    )
    assert {(0, i) for i in range(SIZES["web"])} <= set(again)
    assert max(n for (k, _), n in again.items() if k == 1) >= 3  # code cycled
    for world, workers in ((2, 2), (3, 0), (6, 0)):
        resumed = _run(user, script, world, f"resume{world}", workers, s3, bucket)
        rest = _check_batches(resumed, 0)
        assert sorted(first + rest) == everything, world  # each sample once
        assert Counter(_check_batches(resumed, 1)) == again, world

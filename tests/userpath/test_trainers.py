"""docs/trainers.md, run as written under each trainer: every sample once per epoch.

Each snippet of the doc is a script: ``from harness import DATA, Net``
(``trainer_scripts/harness.py``: a ``Net`` that records the sample values
it is fed and writes a rank<R>.json report at each epoch's end) followed by
the snippet's code block exactly as the doc shows it.
400 ``.npy`` samples (value = index), 2 CPU ranks, batch 20, 3 epochs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).with_name("trainer_scripts")  # harness.py
SAMPLES, EPOCHS, RANKS = 400, 3, 2


def snippet(heading: str) -> str:
    """The first python block under ``## heading`` of docs/trainers.md."""
    doc = (ROOT / "docs" / "trainers.md").read_text()
    section = doc.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def script(user, name: str, body: str) -> Path:
    return user.write(name, "from harness import DATA, Net\n\n" + body)


def make_data(
    user, name: str, base: int, samples: int = SAMPLES
) -> tuple[dict[str, str], Path]:
    """400 one-sample .npy files (value = base + index) and an empty report
    folder. Each scenario has its own ``base``: the cache is keyed by
    content, so equal files would be warm for the next scenario."""
    data = user.workdir / name
    data.mkdir()
    for i in range(samples):
        np.save(data / f"{i:04d}.npy", np.array([base + i], dtype=np.int64))
    out = user.workdir / f"{name}-out"
    out.mkdir()
    path = os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])
    env = {"TRAINERS_DATA": f"{data}/*.npy", "TRAINERS_OUT": str(out)}
    return {**env, "PYTHONPATH": path}, out


def check_run(proc, out: Path, base: int, samples: int = SAMPLES) -> list[dict]:
    """Every sample exactly once per epoch across ranks; each rank's shard
    the same every epoch; returns the rank reports."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert [r["world_size"] for r in reports] == [RANKS] * RANKS
    per_rank = []
    for rep in reports:
        n = rep["per_epoch"]
        values = rep["values"]
        assert len(values) == EPOCHS * n, (rep["rank"], len(values), n)
        epochs = [values[e * n : (e + 1) * n] for e in range(EPOCHS)]
        assert all(sorted(e) == sorted(epochs[0]) for e in epochs), rep["rank"]
        per_rank.append(epochs)
    for e in range(EPOCHS):
        union = [v for epochs in per_rank for v in epochs[e]]
        assert sorted(union) == list(range(base, base + samples)), f"epoch {e}"
    # One job on the dashboard: the ranks agreed on its id, however started.
    assert len({r["job"] for r in reports}) == 1, [r["job"] for r in reports]
    assert "no way to agree on a job id" not in proc.stderr
    return reports


def lightning_top_level(body: str) -> str:
    """The Lightning snippet with the dataset built at the top of the script
    and ``use_distributed_sampler=False``."""
    top = body.replace(
        "    def train_dataloader(self):\n"
        "        ds = DistributedCachedDataset(DATA)\n"
        "        return DataLoader(ds, batch_size=20, sampler=ds.sampler)\n",
        "    def train_dataloader(self):\n"
        "        return DataLoader(ds, batch_size=20, sampler=ds.sampler)\n\n"
        "ds = DistributedCachedDataset(DATA)\n",
    ).replace('strategy="ddp",', 'strategy="ddp", use_distributed_sampler=False,')
    assert "use_distributed_sampler=False" in top and "\nds = " in top
    return top


def check_counts(reports: list[dict], samples: int = SAMPLES) -> None:
    """``ds.stats()`` as plain torchrun gives it: only epoch 0 reads the
    source. (How much of epoch 0 counts as misses depends on how far the
    first batch's prefetch got, so that split is not compared.)"""
    per_rank = samples // RANKS
    for r in reports:
        assert r["hits"] + r["misses"] == EPOCHS * per_rank, r["rank"]
        assert r["hits"] >= (EPOCHS - 1) * per_rank, (r["rank"], r["hits"])
        assert r["misses"] <= per_rank, (r["rank"], r["misses"])
    # The job read the source in epoch 0. Per rank it can show 0 misses: a
    # chunk its look-ahead fetched before a trainer's repeated set_epoch(0)
    # counts as a local hit (seen once under heavy load with HF's Trainer).
    assert sum(r["misses"] for r in reports) > 0, reports


def test_trainers_torchrun_and_accelerate_deliver_every_sample_once(user):
    base = 0
    env, out = make_data(user, "plain", base)
    proc = user.torchrun(script(user, "plain.py", snippet("torchrun")), env=env)
    check_counts(check_run(proc, out, base))

    base = 1000
    env, out = make_data(user, "accel", base)
    body = snippet("Accelerate")
    proc = user.torchrun(script(user, "accel.py", body), env=env)
    check_counts(check_run(proc, out, base))

    # The loader given to prepare() too: an error naming the fix, not half the data.
    base = 2000
    env, out = make_data(user, "prepared", base)
    wrong = body.replace(
        "model, opt = accelerator.prepare(model, opt)",
        "model, opt, loader = accelerator.prepare(model, opt, loader)",
    )
    assert wrong != body
    proc = user.torchrun(script(user, "prepared.py", wrong), env=env)
    assert proc.returncode != 0
    assert "ShardedTwiceError" in proc.stderr, proc.stderr[-4000:]
    assert "accelerator.prepare()" in proc.stderr


def test_trainers_lightning_defaults_and_dataset_built_before_fit(user):
    base = 3000
    env, out = make_data(user, "lightning", base)
    proc = user.python(
        str(script(user, "lit.py", snippet("PyTorch Lightning"))), env=env
    )
    check_counts(check_run(proc, out, base))

    # The dataset built at the top of the script, before Trainer.fit starts
    # the other process (which gets LOCAL_RANK and WORLD_SIZE but no RANK),
    # with use_distributed_sampler=False: Lightning sets only the sampler's epoch.
    base = 4000
    env, out = make_data(user, "toplevel", base)
    top = lightning_top_level(snippet("PyTorch Lightning"))
    proc = user.python(str(script(user, "top.py", top)), env=env)
    check_counts(check_run(proc, out, base))


def test_trainers_lightning_ddp_spawn(user):
    base = 8000
    env, out = make_data(user, "spawn", base)
    body = snippet("PyTorch Lightning")
    spawn = body.replace('strategy="ddp",', 'strategy="ddp_spawn",')
    assert spawn != body
    proc = user.python(str(script(user, "spawn.py", spawn)), env=env)
    check_counts(check_run(proc, out, base))


def test_trainers_hugging_face_trainer_reads_each_ranks_shard(user):
    # 410 samples: each rank's 205 end in a short batch of 5, which
    # Accelerate's even_batches would fill from the epoch's start.
    base, samples = 5000, 410
    env, out = make_data(user, "hf", base, samples)
    body = snippet("Hugging Face Trainer")
    proc = user.torchrun(script(user, "hf.py", body), env=env)
    check_counts(check_run(proc, out, base, samples), samples)
    assert "does not use ds.sampler" not in proc.stderr

    # The plain Trainer: its RandomSampler over all samples, split by
    # Accelerate. Every sample once per epoch still, but not the rank's own
    # shard: a warning naming the subclass, never silence.
    base = 6000
    env, out = make_data(user, "hfplain", base)
    plain = body.replace("trainer = CachedTrainer(", "trainer = Trainer(")
    assert plain != body
    proc = user.torchrun(script(user, "hfplain.py", plain), env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stderr.count("does not use ds.sampler") == RANKS, proc.stderr[-6000:]
    values = [json.loads((out / f"rank{r}.json").read_text())["values"] for r in (0, 1)]
    per_epoch = SAMPLES // RANKS
    for e in range(EPOCHS):
        epoch = slice(e * per_epoch, (e + 1) * per_epoch)
        union = [v for vals in values for v in vals[epoch]]
        assert sorted(union) == list(range(base, base + SAMPLES)), f"epoch {e}"


def test_trainers_ray_train_delivers_every_sample_once(fresh_user):
    # TorchTrainer.fit() starts a Ray cluster of its own, where the ranks
    # start their stores: a HOME of its own too, so its Redis knows no store
    # of the module's embedded head.
    user = fresh_user
    base = 7000
    env, out = make_data(user, "raytrain", base)
    # Ray Train starts a Ray head and its workers: more than a torchrun script.
    proc = user.python(
        str(script(user, "ray_train.py", snippet("Ray Train"))), env=env, timeout=480
    )
    check_counts(check_run(proc, out, base))

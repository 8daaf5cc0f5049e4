"""Augmented variants as a user runs them: the README's ``augment.py`` as
written, then a script that records what each rank read, under plain
torchrun at 2 ranks with embedded defaults (no ``job=``, no ``close()``).

It proves what the feature promises: over 4 epochs every sample is read
once per epoch and as 4 distinct views, each equal to ``augment(base,
variant_rng(seed, variant, index))`` recomputed here; ``augment`` never runs
in a rank process; and with a budget too small for the variants the ranks
read the base form for the rest, counted, without failing.
"""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from collections.abc import Iterator

import numpy as np
from test_readme import fresh_bucket, readme_script

from shardcache.variants import variant_of_epoch, variant_rng

BUCKET = "my-images"
IMAGES = 24
EPOCHS = K = 4
CHUNK = 8  # samples per chunk in the recording script: 3 chunks
SHAPE = (8, 8, 3)


def _images() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(IMAGES)]


def _upload(s3, s3fs_client, images: list[np.ndarray]) -> None:
    fresh_bucket(s3fs_client, BUCKET)
    for i, image in enumerate(images):
        buf = io.BytesIO()
        np.save(buf, image)
        s3fs_client.pipe(f"{BUCKET}/train/{i:03d}.npy", buf.getvalue())
    s3.reset_counts()


def _env(s3) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": s3.storage_options()["client_kwargs"]["endpoint_url"]}


def test_readme_variants_run_as_written_with_no_fallback(user, s3, s3fs_client):
    _upload(s3, s3fs_client, _images())
    code, command = readme_script("augment.py")
    assert command[:4] == [
        "python", "-m", "torch.distributed.run", "--nproc_per_node=2"
    ]  # fmt: skip
    user.write("augment.py", code)
    done = user.torchrun("augment.py", env=_env(s3))
    assert done.returncode == 0, done.stderr[-4000:]
    stats = [
        json.loads(m.replace("'", '"'))
        for m in re.findall(r"^\d (\{.*\})$", done.stdout, re.M)
    ]
    assert len(stats) == 2, done.stdout[-2000:]
    assert sum(s["variant_samples"] for s in stats) == EPOCHS * IMAGES
    assert all(s["base_fallback"] == 0 and s["k"] == K for s in stats)
    assert s3.total_gets == IMAGES  # the variants were built from the cached base


# The user's augmentation; the recording script runs it with a line that
# logs the process it runs in. The test recomputes views with this copy.
AUGMENT = """
def augment(image, rng):
    if rng.random() < 0.5:
        image = image[:, ::-1]
    gain = rng.uniform(0.5, 1.5)
    return np.clip(image * gain, 0, 255).astype(np.uint8)
"""

RECORDING = """
import json, os
import numpy as np
import torch.distributed as dist
from shardcache import DistributedCachedDataset

def logged(image, rng):
    # The process, and which view this is: the sample's bytes and the
    # generator's state (variant_rng(seed, variant, index) is one per view).
    view = f"{image.tobytes().hex()[:16]}:{rng.bit_generator.state['state']['state']}"
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()} {view}\\n")
    return augment(image, rng)

dist.init_process_group("gloo")
ds = DistributedCachedDataset(
    "s3://my-images/train/", augment=logged, variants=4, chunk_samples=CHUNK
)
seen = {}
for epoch in range(4):
    ds.set_epoch(epoch)
    views = seen[epoch] = {}
    for batch in ds.sampler.batches(5):
        for i, x in zip(batch, ds.collated(batch)):
            views[int(i)] = x.numpy().tolist()
rank = dist.get_rank()
with open(f"views-{rank}.json", "w") as f:
    json.dump({"pid": os.getpid(), "seen": seen, "stats": ds.stats()["variants"]}, f)
"""


def _record(user, s3, tag: str, env: dict[str, str] | None = None) -> tuple:
    """Run the recording script; returns (per-rank records, one ``(pid,
    view)`` per call of augment)."""
    log = user.workdir / f"augment-{tag}.log"
    source = f"LOG = {str(log)!r}\nCHUNK = {CHUNK}\nimport numpy as np\n"
    user.write("record.py", source + AUGMENT + RECORDING)
    done = user.torchrun("record.py", env={**_env(s3), **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    records = [
        json.loads((user.workdir / f"views-{r}.json").read_text()) for r in (0, 1)
    ]
    warned = done.stderr.count("cannot hold this epoch's augmented variant")
    # Said once per rank that read a base form instead, never otherwise.
    assert warned == sum(bool(r["stats"]["base_fallback"]) for r in records)
    calls = [
        tuple(line.split())
        for line in (log.read_text() if log.exists() else "").splitlines()
    ]
    return records, calls


def _augment():
    scope: dict = {"np": np}
    exec(AUGMENT, scope)  # the same code the ranks' stores ran
    return scope["augment"]


def _delivered(records: list[dict], images: list[np.ndarray]) -> Iterator[tuple]:
    """``(epoch, sample, what a rank got, the view augment makes of it for
    that epoch)`` for every sample the ranks recorded, after checking that
    each epoch delivered every sample once over both ranks."""
    augment = _augment()
    for epoch in range(EPOCHS):
        seen = [r["seen"][str(epoch)] for r in records]
        assert sorted(int(i) for s in seen for i in s) == list(range(IMAGES))
        variant = variant_of_epoch(epoch, 0, K)
        for s in seen:
            for i, x in s.items():
                i = int(i)
                view = augment(images[i].copy(), variant_rng(0, variant, i))
                yield epoch, i, np.array(x, dtype=np.uint8), view


def test_variants_give_k_views_per_sample_and_no_augment_on_the_ranks(
    user, s3, s3fs_client
):
    images = _images()
    _upload(s3, s3fs_client, images)
    records, calls = _record(user, s3, "views")
    views: dict[int, set[bytes]] = {i: set() for i in range(IMAGES)}
    for epoch, i, got, view in _delivered(records, images):
        assert np.array_equal(got, view), (epoch, i)
        views[i].add(got.tobytes())
    assert all(len(v) == K for v in views.values())  # 4 distinct views each
    # augment ran once per view (K per sample), in build workers, never in a rank.
    builds = Counter(view for _, view in calls)
    assert len(builds) == K * IMAGES
    assert all(n == 1 for n in builds.values()), {
        v: n for v, n in builds.items() if n > 1
    }
    assert not {str(r["pid"]) for r in records} & {pid for pid, _ in calls}
    assert all(r["stats"]["base_fallback"] == 0 for r in records)


def test_variants_beyond_the_budget_are_read_as_the_base_form(
    fresh_user, s3, s3fs_client
):
    # A HOME of its own: the stores must start with this budget, so the
    # module's running head (started with the default) cannot serve it.
    user = fresh_user
    images = _images()
    _upload(s3, s3fs_client, images)
    # Room for the base chunks and about one variant chunk (a chunk of 8
    # samples is 1,554 bytes: 1,536 of pixels, flags and the checksum).
    budget = 3 * 1554 + 1600
    records, calls = _record(
        user, s3, "budget", env={"SHARDCACHE_CACHE_BYTES": str(budget)}
    )
    fallback = 0
    for _, i, got, view in _delivered(records, images):
        base = images[i]
        assert np.array_equal(got, base) or np.array_equal(got, view)
        fallback += np.array_equal(got, base)
    counted = sum(r["stats"]["base_fallback"] for r in records)
    assert counted == fallback and 0 < counted < EPOCHS * IMAGES
    served = sum(r["stats"]["variant_samples"] for r in records)
    assert served + counted == EPOCHS * IMAGES
    assert not {str(r["pid"]) for r in records} & {pid for pid, _ in calls}

"""MixedDataset over real cached datasets (S3 through moto, a local ``.npy``
file), in one process: batches in sequence order from both sources, the
DataLoader path, stats per component, and its bad input."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from shardcache import DistributedCachedDataset
from shardcache.errors import CollateError, ConfigError
from shardcache.mixture import MixedDataset

pytestmark = pytest.mark.slow


def _npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value)
    return buf.getvalue()


@pytest.fixture
def parts(ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, tmp_path):
    s3fs_client.pipe(
        {
            f"{bucket}/web/{i:03d}.npy": _npy(np.array([0, i], np.float32))
            for i in range(12)
        }
    )
    np.save(tmp_path / "books.npy", np.array([[1, i] for i in range(6)], np.float32))
    common = dict(redis_url=redis_url, namespace=namespace, rank=0, world_size=1)
    web = DistributedCachedDataset(
        f"s3://{bucket}/web/", storage_options=s3.storage_options(), revalidate=0.001,
        **common,
    )  # fmt: skip
    books = DistributedCachedDataset(str(tmp_path / "books.npy"), **common)
    return web, books, common


def test_mixture_batches_follow_the_sequence_across_sources(parts):
    web, books, _ = parts
    mix = MixedDataset([web, books], weights=[2, 1], batch_size=3, rank=0, world_size=1)
    assert len(mix) == 18 and mix.names == [web.name, books.name]
    mix.set_epoch(0)
    got = torch.cat(list(mix.loader()))
    order = mix.sampler.order()
    comp = mix.component_of(order)
    assert got[:, 0].tolist() == comp.tolist()  # each sample from its component
    assert got[:, 1].tolist() == (order - mix.sampler.offsets[comp]).tolist()
    assert sorted(map(tuple, got.tolist())) == sorted(
        [(0.0, float(i)) for i in range(12)] + [(1.0, float(i)) for i in range(6)]
    )
    stats = mix.stats()
    assert stats["delivered"] == {web.name: 12, books.name: 6}
    assert stats["weights"][web.name] == pytest.approx(2 / 3)
    # The DataLoader path gives the same samples in the same batches.
    mix.set_epoch(1)
    loader = DataLoader(mix, batch_sampler=mix.sampler.batches())
    batches = list(loader)
    assert [len(b) for b in batches] == [3] * 6
    mix.set_epoch(1)
    assert torch.equal(torch.cat(batches), torch.cat(list(mix.loader())))


def test_mixture_resume_refuses_a_component_listed_anew(parts, s3fs_client, bucket):
    web, books, common = parts
    mix = MixedDataset(
        [web, books], weights=[1, 1], batch_size=2, names=["web", "books"]
    )
    mix.set_epoch(0)
    next(iter(mix.loader()))
    state = mix.state_dict()
    assert state["consumed"] == 2 and state["weights"] == [0.5, 0.5]
    s3fs_client.pipe(f"{bucket}/web/003.npy", _npy(np.array([0, 99], np.float32)))
    relisted = DistributedCachedDataset(
        web.urls, storage_options=web.storage_options, revalidate=0.001, **common
    )
    again = MixedDataset(
        [relisted, books], weights=[1, 1], batch_size=2, names=["web", "books"]
    )
    with pytest.raises(ConfigError, match="component 'web' was listed anew"):
        again.load_state_dict(state)


def test_mixture_bad_input_is_named(parts, tmp_path):
    web, books, common = parts
    with pytest.raises(ConfigError, match="distinct names"):
        MixedDataset([web, books], weights=[1, 1], names=["a", "a"])
    with pytest.raises(ConfigError, match=r"books=-1\.0"):
        MixedDataset([web, books], weights=[1, -1], names=["web", "books"])
    with pytest.raises(ConfigError, match="batch_size"):
        MixedDataset([web, books], weights=[1, 1], batch_size=0)
    np.save(tmp_path / "wide.npy", np.zeros((4, 3), np.float32))
    wide = DistributedCachedDataset(str(tmp_path / "wide.npy"), **common)
    mix = MixedDataset([web, wide], weights=[1, 1], batch_size=4, rank=0, world_size=1)
    mix.set_epoch(0)
    with pytest.raises(CollateError, match="differ in shape"):
        list(mix.loader())


def test_mixture_state_under_dataloader_workers_asks_for_the_count(parts):
    # The workers read the draws, ahead of the loop: the count in this
    # process is 0, and a state saved from it would replay the epoch.
    web, books, _ = parts
    mix = MixedDataset([web, books], weights=[2, 1], batch_size=3, rank=0, world_size=1)
    mix.set_epoch(0)
    loader = DataLoader(
        mix, batch_sampler=mix.sampler.batches(), num_workers=2,
        multiprocessing_context="spawn",
    )  # fmt: skip
    taken = []
    for step, batch in enumerate(loader, start=1):
        taken.append(batch)
        if step == 2:
            break
    with pytest.raises(ConfigError, match=r"consumed=N"):
        mix.state_dict()
    state = mix.state_dict(consumed=6)
    assert state["consumed"] == 6
    again = MixedDataset(
        [web, books], weights=[2, 1], batch_size=3, rank=0, world_size=1
    )
    again.load_state_dict(state)
    rest = list(again.loader())
    got = sorted(map(tuple, torch.cat(taken + rest).tolist()))
    assert got == sorted(
        [(0.0, float(i)) for i in range(12)] + [(1.0, float(i)) for i in range(6)]
    )
    # Read in this process, the count is known and no count is asked for.
    mix.set_epoch(1)
    in_process = DataLoader(mix, batch_sampler=mix.sampler.batches())
    next(iter(in_process))
    assert mix.state_dict()["consumed"] == 3


def test_mixture_resumed_at_a_drop_last_epoch_end_is_not_refused(parts):
    # 18 draws in batches of 4: the tail of 2 is drawn and dropped. Resumed
    # after the last full batch, the process reads nothing this epoch.
    web, books, _ = parts

    def mixture() -> MixedDataset:
        return MixedDataset(
            [web, books], weights=[2, 1], batch_size=4, rank=0, world_size=1
        )

    mix = mixture()
    mix.set_epoch(0)
    assert (
        len(list(DataLoader(mix, batch_sampler=mix.sampler.batches(drop_last=True))))
        == 4
    )
    state = mix.state_dict()
    assert state["consumed"] == 16
    again = mixture()
    again.load_state_dict(state)
    again.set_epoch(again.sampler.epoch)
    assert (
        list(DataLoader(again, batch_sampler=again.sampler.batches(drop_last=True)))
        == []
    )
    assert again.state_dict()["consumed"] == 16

"""DataLoader's default collate gives back a batch the dataset gathered, and
stacks everything else exactly as torch does."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.data._utils import collate as torch_collate

import shardcache.delivery  # noqa: F401  (installs the collate function)
from shardcache import batch_rows


class _Gathered(Dataset):
    """Hands a batch out as marked rows, as shardcache's __getitems__ does."""

    def __len__(self) -> int:
        return 12

    def __getitems__(self, indices):  # noqa: ANN001, ANN204
        batch = torch.tensor([[float(i)] * 3 for i in indices])
        return batch_rows.as_rows(batch)


def test_batch_rows_collate_returns_the_gathered_batch_itself():
    assert (
        torch_collate.default_collate_fn_map[torch.Tensor] is batch_rows.collate_tensors
    )
    batch = torch.arange(12.0).reshape(4, 3).clone()  # owns its memory, as a gather
    rows = batch_rows.as_rows(batch)
    assert default_collate(rows) is batch  # no second copy
    # Tuples of (sample, target) collate per position, each its own batch.
    targets = torch.arange(4)
    pairs = list(zip(rows, batch_rows.as_rows(targets), strict=True))
    x, y = default_collate(pairs)
    assert x is batch and y is targets


def test_batch_rows_anything_else_is_stacked_as_torch_does():
    batch = torch.arange(12.0).reshape(4, 3).clone()
    rows = batch_rows.as_rows(batch)
    others = (
        rows[::-1],
        rows[:3],
        rows[:2] + rows[:2],
        [rows[0], rows[0], rows[2], rows[3]],  # views of the batch, not its rows
        [r.clone() for r in rows],
    )
    for other in others:
        got = default_collate(other)
        assert torch.equal(got, torch.stack(other))
        assert got.data_ptr() != batch.data_ptr()  # a copy, never the batch
    # A user's own tensors, even consecutive rows of one tensor, are copied:
    # the batch must not alias their data.
    mine = torch.zeros(4, 3)
    got = default_collate(list(mine.unbind(0)))
    got.add_(1)
    assert torch.equal(mine, torch.zeros(4, 3))


def test_batch_rows_an_older_batch_than_the_kept_ones_is_stacked():
    """Rows of a batch made more than ROW_IDS_KEPT batches ago collate as
    torch does (a copy, never a wrong batch)."""
    old = torch.arange(6.0).reshape(3, 2).clone()
    old_rows = batch_rows.as_rows(old)
    newer = [torch.zeros(2, 2) for _ in range(batch_rows.ROW_IDS_KEPT)]
    for batch in newer:
        assert default_collate(batch_rows.as_rows(batch)) is batch
    got = default_collate(old_rows)
    assert got is not old and torch.equal(got, old)


def test_batch_rows_readme_loader_in_process_and_in_workers():
    ds = _Gathered()
    for workers in (0, 2):
        loader = DataLoader(ds, batch_size=5, num_workers=workers)
        got = [b[:, 0].tolist() for b in loader]
        assert got == [[0.0, 1, 2, 3, 4], [5.0, 6, 7, 8, 9], [10.0, 11]], workers


def test_batch_rows_a_users_own_collate_registration_is_kept():
    registry = torch_collate.default_collate_fn_map
    mine = lambda batch, *, collate_fn_map=None: "mine"  # noqa: E731
    registry[torch.Tensor] = mine
    try:
        batch_rows.install()
        assert registry[torch.Tensor] is mine
    finally:
        registry[torch.Tensor] = batch_rows.collate_tensors


def test_batch_rows_the_mark_does_not_travel_with_the_batch():
    import io
    import pickle

    batch = torch.zeros(3, 2)
    assert default_collate(batch_rows.as_rows(batch)) is batch
    buf = io.BytesIO()
    torch.save(batch, buf)
    buf.seek(0)
    for copy in (torch.load(buf, weights_only=True), pickle.loads(pickle.dumps(batch))):
        rows = list(copy.unbind(0))
        assert default_collate(rows) is not copy  # stacked: not one of ours
        assert copy.__dict__ == {}

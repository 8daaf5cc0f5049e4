"""A batch handed out as rows, and DataLoader's default collate giving the batch back whole.

``DataLoader(ds, batch_size=B, sampler=ds.sampler)``, the README's loop,
asks the dataset for a batch (``__getitems__``) and stacks what it returns
with ``default_collate``. The dataset has already gathered the batch into
one fresh tensor of its own (:func:`shardcache.delivery.samples`) and hands
it out as rows, so torch's stack would be a second copy of every byte, and
in the main process it runs on torch's intra-op threads: while the stores
build chunks on the same cores (a cold epoch) one stack of a 10 MB batch
was measured at 80 ms instead of 1 ms (BENCHMARKS.md, "Cold epoch on the
README's path").

:func:`as_rows` marks the gathered batch; the collate function installed
here (through ``default_collate_fn_map``, the registry torch documents for
extending ``default_collate``) returns that batch itself when it is given
exactly its rows, in order, and stacks anything else as torch does. The
batch is this call's own copy, never the cache's memory, so an in-place op
on it changes nothing anyone else reads. In a DataLoader worker torch's
own function runs: it stacks into shared memory, which is the copy that
carries the batch to the main process anyway.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data._utils import collate as torch_collate

from shardcache.errors import CollateError

__all__ = ["as_rows", "collate_tensors", "install", "mark_ragged"]

# The batches handed out as rows and still alive, by id. Held weakly, and
# kept here rather than as an attribute of the tensor, which would travel
# with it through pickle and torch.save.
_GATHERED: weakref.WeakValueDictionary[int, torch.Tensor] = (
    weakref.WeakValueDictionary()
)
# The ids of the rows each batch handed out, in order: comparing them is
# ~3 us for 64 rows where reading each row's offset and shape was ~23 (more
# than torch's own stack of 64 rows of 4 KB). Ids, not the rows, which would
# keep the batch's buffer from being reused (buffers.py); the latest
# ROW_IDS_KEPT batches only (a batch is collated right after it is made).
_ROW_IDS: OrderedDict[int, tuple[int, ...]] = OrderedDict()
ROW_IDS_KEPT = 64
# Samples of a batch whose shapes differ, handed out one by one: collated,
# torch's stack would fail with its own RuntimeError; ours says what to do.
_RAGGED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def mark_ragged(sample: torch.Tensor) -> torch.Tensor:
    """``sample``, remembered as one of a batch whose shapes differ."""
    _RAGGED[id(sample)] = sample
    return sample


def as_rows(batch: torch.Tensor) -> list[torch.Tensor]:
    """``batch``'s rows (views), marked so that collating them returns ``batch``.

    Only a tensor that owns its memory (not a view: torch gives a view's
    rows the root tensor as ``_base``) is marked; a view's rows collate as
    torch does.
    """
    rows = list(batch.unbind(0))
    if batch._base is None:
        key = id(batch)
        _GATHERED[key] = batch
        _ROW_IDS[key] = tuple(map(id, rows))
        _ROW_IDS.move_to_end(key)
        if len(_ROW_IDS) > ROW_IDS_KEPT:
            _ROW_IDS.popitem(last=False)
    return rows


def whole(rows: list[Any]) -> torch.Tensor | None:
    """The marked batch ``rows`` are, row for row and in order; else ``None``.

    >>> rows = as_rows(torch.zeros(3, 2))
    >>> whole(rows).shape
    torch.Size([3, 2])
    >>> whole(rows[::-1]) is None, whole(rows[:2]) is None
    (True, True)
    >>> whole(list(torch.zeros(3, 2).unbind(0))) is None  # not marked
    True
    """
    base = getattr(rows[0], "_base", None)
    if base is None or _GATHERED.get(id(base)) is not base:
        return None
    # The very row objects handed out, in order (alive: ``rows`` holds them),
    # each still a view of the batch (never a new tensor at a freed row's id).
    if _ROW_IDS.get(id(base)) != tuple(map(id, rows)):
        return None
    if not all(getattr(row, "_base", None) is base for row in rows):
        return None
    return base


_TORCH_COLLATE: Callable[..., Any] = torch_collate.collate_tensor_fn


def collate_tensors(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
    """``default_collate``'s function for tensors: the gathered batch when
    ``batch`` is its rows (in the process that gathered it), else torch's stack."""
    if torch.utils.data.get_worker_info() is None:
        gathered = whole(batch)
        if gathered is not None:
            return gathered
    first = batch[0]
    if _RAGGED.get(id(first)) is first:
        _check_one_shape(batch)
    return _TORCH_COLLATE(batch, collate_fn_map=collate_fn_map)


def _check_one_shape(batch: list[torch.Tensor]) -> None:
    """CollateError, naming the shapes and the fixes, if ``batch`` has two."""
    shapes = [tuple(t.shape) for t in batch]
    other = next((j for j, shape in enumerate(shapes) if shape != shapes[0]), None)
    if other is None:
        return
    raise CollateError(
        f"samples in one batch have shapes {list(shapes[0])} (sample 0 of the "
        f"batch) and {list(shapes[other])} (sample {other}); a batch tensor needs "
        "one shape. Resize or pad in preprocess, or pass collate_fn=list to the "
        "DataLoader to get each batch as a list of samples."
    )


def install() -> None:
    """Register :func:`collate_tensors` for ``torch.Tensor`` in
    ``default_collate_fn_map``, unless something other than torch's own
    function is registered there (a user's choice is kept)."""
    registry = torch_collate.default_collate_fn_map
    if registry.get(torch.Tensor) is _TORCH_COLLATE:
        registry[torch.Tensor] = collate_tensors

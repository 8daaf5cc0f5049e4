"""The loaders compared by bench/run.py, each as a map-style Dataset factory.

Every system reads the same objects from the same emulated S3 and runs the
same preprocess; only where the bytes come from differs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

Preprocess = Callable[[bytes], np.ndarray]


class PlainS3Dataset(Dataset[Any]):
    """What most people write: read the object through s3fs in __getitem__, every epoch."""

    def __init__(
        self,
        urls: list[str],
        storage_options: dict[str, Any],
        preprocess: Preprocess,
        protocol_prefix: str = "",
    ):
        self.urls, self.storage_options, self.preprocess = (
            urls,
            storage_options,
            preprocess,
        )
        self.prefix = protocol_prefix
        self._fs: Any = None
        self._pid = -1

    def _filesystem(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            import fsspec

            self._fs, _ = fsspec.url_to_fs(
                self.prefix + self.urls[0], **self.storage_options
            )
            self._pid = os.getpid()
        return self._fs

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int) -> torch.Tensor:
        data = self._filesystem().cat_file(self.prefix + self.urls[i])
        return torch.from_numpy(self.preprocess(data).copy())


class SimpleCacheDataset(PlainS3Dataset):
    """fsspec's ``simplecache::`` (whole-file cache on this node's disk)."""

    def __init__(
        self,
        urls: list[str],
        storage_options: dict[str, Any],
        preprocess: Preprocess,
        cache_dir: str,
    ):
        opts = {"s3": storage_options, "simplecache": {"cache_storage": cache_dir}}
        super().__init__(urls, opts, preprocess, protocol_prefix="simplecache::")


class ManagerDictDataset(PlainS3Dataset):
    """The forum recipe: a multiprocessing Manager dict filled during epoch 1."""

    def __init__(
        self,
        urls: list[str],
        storage_options: dict[str, Any],
        preprocess: Preprocess,
        shared: Any,
    ):
        super().__init__(urls, storage_options, preprocess)
        self.shared = shared

    def __getitem__(self, i: int) -> torch.Tensor:
        hit = self.shared.get(i)
        if hit is not None:
            return torch.from_numpy(hit)
        value = self.preprocess(self._filesystem().cat_file(self.urls[i]))
        self.shared[i] = value
        return torch.from_numpy(value)

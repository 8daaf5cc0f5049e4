"""The loaders compared by bench/run.py, each as a map-style Dataset factory.

Every system reads the same objects from the same source (the emulated S3,
or the same files on local disk) and runs the same preprocess; only where
the bytes come from differs. Batches are collated by each system's own
recommended path (DataLoader's default collate here).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

Preprocess = Callable[[bytes], np.ndarray]


class FileDataset(Dataset[Any]):
    """What most people write for local files (or a page-cached shared file
    system): ``open().read()`` in ``__getitem__``, ``DataLoader(num_workers=k)``."""

    def __init__(self, paths: list[str], preprocess: Preprocess):
        self.paths, self.preprocess = paths, preprocess

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.paths[i], "rb") as f:
            return torch.from_numpy(self.preprocess(f.read()))


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
        return torch.from_numpy(self.preprocess(data))


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


def _litdata_item(cfg: dict[str, Any], i: int) -> dict[str, np.ndarray]:
    import fsspec
    from samples import PREPROCESS

    fs, _ = fsspec.url_to_fs(cfg["urls"][i], **cfg["storage_options"])
    return {"x": PREPROCESS[cfg["dataset"]](fs.cat_file(cfg["urls"][i]))}


def litdata_convert(cfg: dict[str, Any], fs: Any) -> str:
    """LitData's ``optimize()``: read + preprocess every object once into chunks,
    then upload them next to the source (S3), or leave them on local disk
    (``--source local``); returns where the chunks are."""
    import functools

    from litdata import optimize

    local = f"{cfg['tmp']}/litdata-out-{cfg['namespace']}"  # per run: starts cold
    optimize(
        # Indices, not URLs: optimize() would try to download URL-looking inputs
        # itself, with its own S3 client that does not know the emulator.
        fn=functools.partial(_litdata_item, cfg),
        inputs=list(range(len(cfg["urls"]))),
        output_dir=local,
        chunk_bytes="8MB",
        num_workers=2,
        verbose=False,
        start_method="fork",
    )
    if fs is None:  # local source: the chunks stay where optimize() wrote them
        return local
    remote = f"bench/litdata-{cfg['namespace']}"
    fs.put(local + "/", remote + "/", recursive=True)
    return f"s3://{remote}"


def litdata_loader(cfg: dict[str, Any], node: int, rank: int) -> Any:
    """LitData's StreamingDataset over the uploaded chunks, cached on the node's disk."""
    from litdata import StreamingDataLoader, StreamingDataset

    _litdata_allow_http()

    opts = cfg["storage_options"]
    if cfg["source"] == "local":
        ds = StreamingDataset(cfg["litdata_prefix"], shuffle=True, seed=0)
        return StreamingDataLoader(
            ds,
            batch_size=cfg["batch_size"],
            num_workers=cfg["workers"],
            persistent_workers=cfg["workers"] > 0,
        )
    ds = StreamingDataset(
        cfg["litdata_prefix"],
        cache_dir=f"{cfg['tmp']}/litdata-cache-{cfg['namespace']}-rank{rank}",
        shuffle=True,
        seed=0,
        # drop_last stays at its distributed default (True): ranks must see
        # equal batch counts to stay in lockstep, so LitData delivers a few
        # fewer samples per epoch (rates count the samples delivered).
        storage_options={
            "endpoint_url": opts["client_kwargs"]["endpoint_url"],
            "aws_access_key_id": opts.get("key", "testing"),
            "aws_secret_access_key": opts.get("secret", "testing"),
        },
    )
    return StreamingDataLoader(
        ds,
        batch_size=cfg["batch_size"],
        num_workers=cfg["workers"],
        worker_init_fn=_litdata_allow_http,
        persistent_workers=cfg["workers"] > 0,
    )


def _litdata_allow_http(_worker_id: int = 0) -> None:
    """The emulator speaks plain HTTP; LitData's obstore client only allows
    HTTPS unless told (real S3 needs no such option). Set in every process."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS = {
        **downloader._OBSTORE_CLIENT_OPTIONS,
        "allow_http": True,
    }

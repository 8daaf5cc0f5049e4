"""shardcache: a cluster-level training-data cache for PyTorch on Ray.

>>> import shardcache
>>> "DistributedCachedDataset" in shardcache.__all__
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardcache.config import ClientConfig
from shardcache.errors import (
    BackendError,
    CacheMiss,
    ChunkFileError,
    ConfigError,
    CorruptChunkError,
    CorruptObjectError,
    EmptyDatasetError,
    EndpointUnavailable,
    IndexUnavailable,
    PreprocessError,
    RemoteFetchError,
    ShardCacheError,
    ShardedTwiceError,
    ShardUnavailable,
    SourceFormatError,
    SourceNotFound,
    StaleVersionError,
    TransformError,
)

if TYPE_CHECKING:
    from shardcache.dataset import DistributedCachedDataset
    from shardcache.transport.direct import CacheClient

__all__ = [
    "BackendError",
    "CacheClient",
    "CacheMiss",
    "ChunkFileError",
    "ClientConfig",
    "ConfigError",
    "CorruptChunkError",
    "CorruptObjectError",
    "DistributedCachedDataset",
    "EmptyDatasetError",
    "EndpointUnavailable",
    "IndexUnavailable",
    "PreprocessError",
    "RemoteFetchError",
    "ShardCacheError",
    "ShardUnavailable",
    "ShardedTwiceError",
    "SourceFormatError",
    "SourceNotFound",
    "StaleVersionError",
    "TransformError",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy so that cache stores, which import shardcache.index, never pay for torch.
    if name == "DistributedCachedDataset":
        from shardcache.dataset import DistributedCachedDataset

        return DistributedCachedDataset
    if name == "CacheClient":
        from shardcache.transport.direct import CacheClient

        return CacheClient
    raise AttributeError(f"module 'shardcache' has no attribute {name!r}")

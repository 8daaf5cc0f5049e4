"""Exception hierarchy:

* ShardCacheError
  + ConfigError(ShardCacheError, ValueError)   bad argument or setting, raised at construction
  + EmptyDatasetError(ConfigError)             the source listing matched no object
  + ShardedTwiceError(ConfigError)             a trainer split the per-rank loader over ranks again
  + CacheMiss(ShardCacheError, KeyError)       key absent and fetch disabled
  + StaleVersionError(ShardCacheError)         object changed upstream during read
  + PreprocessError(ShardCacheError)           the user's preprocess raised or returned a non-array
  + TransformError(ShardCacheError)            the user's per-sample transform raised
  + CollateError(ShardCacheError, ValueError)  a batch's samples cannot form one tensor
  + SampleIndexError(ShardCacheError, IndexError)  a sample index out of range or not an integer
  + ChunkFileError(ShardCacheError)            a chunk file is missing, corrupt or unstorable
  + CorruptChunkError(ShardCacheError)         a cached chunk failed its checksum again after a rebuild
  + SourceFormatError(ShardCacheError, ValueError)  a packed source file is not valid in its format
  + BackendError(ShardCacheError)              wraps redis / botocore / ray errors (see __cause__)
    - IndexUnavailable                         Redis unreachable, wrong password, bad URL
    - RemoteFetchError                         the object source failed after retries
      . SourceNotFound(RemoteFetchError, FileNotFoundError)
      . CorruptObjectError                     size or checksum differs from the listing
    - ShardUnavailable                         a cache store actor is gone or Ray is down
      . EndpointUnavailable                    no node-local endpoint is reachable from this pod

Mixing in the builtin lets callers keep writing ``except KeyError`` or
``except ValueError`` (redis-py does the same with ``LockError``).

Where backends' exceptions become these (each at one boundary, ``raise ...
from exc``): Redis in ``index.map_redis_errors``; Ray in the direct
transport's store calls (``transport/direct.py``); the object source (fsspec,
botocore) in the stores' fetch and listing (``shardcache_server.fetch``,
``shardcache_server.objects``). An error that crossed a process (a store's
result, an endpoint reply, a chunk's failed row) travels as its class name and
message and is raised again through :func:`error_type`.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "CacheMiss",
    "ChunkFileError",
    "CollateError",
    "ConfigError",
    "CorruptChunkError",
    "CorruptObjectError",
    "EmptyDatasetError",
    "EndpointUnavailable",
    "IndexUnavailable",
    "PreprocessError",
    "RemoteFetchError",
    "SampleIndexError",
    "ShardCacheError",
    "ShardUnavailable",
    "ShardedTwiceError",
    "SourceFormatError",
    "SourceNotFound",
    "StaleVersionError",
    "TransformError",
    "error_type",
]


class ShardCacheError(Exception):
    """Base class of every error shardcache raises on purpose."""


class ConfigError(ShardCacheError, ValueError):
    """A bad argument or setting, detected at construction."""


class EmptyDatasetError(ConfigError):
    """The source URL is valid but lists no object."""


class ShardedTwiceError(ConfigError):
    """A trainer split the already per-rank loader over the ranks a second
    time, so each rank would skip part of its shard (the message names the
    trainer setting to change)."""


class CacheMiss(ShardCacheError, KeyError):
    """The key is not cached and fetching was disabled."""


class StaleVersionError(ShardCacheError):
    """The source object changed between listing and read."""


class PreprocessError(ShardCacheError):
    """The preprocess callable failed for one object (named in the message)."""


class TransformError(ShardCacheError):
    """The per-sample transform failed on the rank."""


class CollateError(ShardCacheError, ValueError):
    """Samples of one batch differ in shape, so they cannot be one batch tensor."""


class SampleIndexError(ShardCacheError, IndexError):
    """A sample index out of the dataset's range, or not an integer."""


class ChunkFileError(ShardCacheError):
    """A chunk file cannot be written or read back (named in the message)."""


class CorruptChunkError(ShardCacheError):
    """A cached chunk's contents do not match its checksum, even after it was
    dropped and rebuilt from the source once (named in the message)."""


class SourceFormatError(ShardCacheError, ValueError):
    """A packed source file (tar, Parquet, HDF5, LMDB, .npy) is not valid in its format."""


class BackendError(ShardCacheError):
    """A dependency (Redis, the object source, Ray) failed; see ``__cause__``."""


class IndexUnavailable(BackendError):
    """The Redis index cannot be reached or refused our credentials."""


class RemoteFetchError(BackendError):
    """Reading the source object failed after the retry budget was spent."""


class SourceNotFound(RemoteFetchError, FileNotFoundError):
    """The bucket, prefix or object does not exist."""


class CorruptObjectError(RemoteFetchError):
    """The bytes read do not match the size or checksum from the listing."""


class ShardUnavailable(BackendError):
    """A cache store actor is unreachable or Ray is not running."""


class EndpointUnavailable(ShardUnavailable):
    """No node-local cache endpoint is reachable (the message names the node and mount)."""


def error_type(
    name: str, default: type[ShardCacheError] = BackendError
) -> type[ShardCacheError]:
    """The error class a store, endpoint or chunk reported by ``name``; ``default``
    for a name that is not one of the project's errors (never a builtin).

    >>> error_type("StaleVersionError").__name__, error_type("OSError").__name__
    ('StaleVersionError', 'BackendError')
    """
    cls = _BY_NAME.get(name)
    return cls if cls is not None else default


_BY_NAME: dict[str, type[ShardCacheError]] = {
    name: cls
    for name, cls in globals().items()
    if isinstance(cls, type) and issubclass(cls, ShardCacheError)
}

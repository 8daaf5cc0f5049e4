"""Settings of the cluster side, one model per process (``SHARDCACHE_*`` env)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shardcache.keys import DEFAULT_NAMESPACE, validate_name

__all__ = ["ServiceSettings"]

DEFAULT_CACHE_BYTES = 2 * 2**30  # per store; the chart sizes it from the object store
DEFAULT_FETCH_CONCURRENCY = 32  # in-flight GETs per store; S3 scales per prefix
DEFAULT_FETCH_RETRIES = 4  # attempts after the first, with exponential backoff
DEFAULT_BACKOFF_S = 0.1  # first retry delay; doubles each attempt, full jitter
DEFAULT_BACKOFF_MAX_S = 5.0
DEFAULT_FETCH_TIMEOUT_S = 60.0  # one GET, first byte to last
DEFAULT_STATS_FLUSH_S = 1.0  # one Redis pipeline per store per second
DEFAULT_SOURCE_BURST = 20  # requests a quiet source bucket may take at once
DEFAULT_MAX_RESTARTS = 3  # a crash-looping store stops instead of hammering the source
DEFAULT_RETIRE_GRACE_S = 3600.0  # an invalidated generation stays readable mid-epoch
DEFAULT_DISK_BYTES = 64 * 2**30  # disk tier budget per node, when disk_dir is set


class ServiceSettings(BaseSettings):
    """Everything a cache store needs; the Helm chart sets the same variables.

    What to cache:
        cache_bytes: memory budget of one store (one per node). Defaults to 2 GiB.
        eviction: ``"lru"``, ``"static"`` (keep what fits, never evict) or
            ``"clairvoyant"`` (evict the chunk the ranks' known order needs
            last: Belady's MIN; for datasets larger than the cache with
            shuffled epochs). Defaults to ``"lru"``.
        disk_dir: a directory on the node's local disk for the disk tier:
            chunks are written there as chunk files when cached and stay
            there when evicted from memory, so a memory miss is read from
            disk instead of the source, and a store restarted on the same
            node reloads them. One directory per host (a hostPath).
            ``""`` (the default) turns the tier off.
        disk_bytes: the disk tier's budget; the least recently used files
            beyond it are deleted. Defaults to 64 GiB.
        retire_grace_s: how long the values of an invalidated generation stay
            readable by ranks that snapshotted it at ``set_epoch``. They share
            the budget and are evicted first. ``0`` frees them at once.
            Defaults to one hour.

    How to fetch:
        fetch_concurrency, fetch_retries, backoff_s, backoff_max_s,
        fetch_timeout_s: see the constants above.
        verify_checksum: compare an S3 ETag that is a plain MD5 with the bytes
            read. Defaults to ``True``.
        build_workers: chunks built at once per store, each in a worker
            process of the node (fetch + preprocess). ``0`` (the default)
            uses one per CPU of the node.
        preprocess_workers: threads per store for Redis writes off the loop.

    Where state lives:
        redis_url: the index. namespace: the deployment (key prefix, Ray
        namespace). stats_flush_s: how often counters go to Redis.
        max_restarts: Ray restarts of a crashed store.
        source_rps / source_burst: a cluster-wide request budget per source
            bucket, shared by every store through Redis and halved on 503
            SlowDown. ``0`` (the default) means no limit.
        stream_after_s: a listing that runs longer publishes its first
            whole chunks, and longer prefixes as it goes, so reading can
            start before it ends (``list_stream.py``). Defaults to ``2``.
    """

    model_config = SettingsConfigDict(env_prefix="SHARDCACHE_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = DEFAULT_NAMESPACE
    cache_bytes: int = Field(default=DEFAULT_CACHE_BYTES, gt=0)
    eviction: Literal["lru", "static", "clairvoyant"] = "lru"
    disk_dir: str = ""
    disk_bytes: int = Field(default=DEFAULT_DISK_BYTES, gt=0)
    retire_grace_s: float = Field(default=DEFAULT_RETIRE_GRACE_S, ge=0)
    fetch_concurrency: int = Field(default=DEFAULT_FETCH_CONCURRENCY, ge=1)
    fetch_retries: int = Field(default=DEFAULT_FETCH_RETRIES, ge=0)
    backoff_s: float = Field(default=DEFAULT_BACKOFF_S, ge=0)
    backoff_max_s: float = Field(default=DEFAULT_BACKOFF_MAX_S, ge=0)
    fetch_timeout_s: float = Field(default=DEFAULT_FETCH_TIMEOUT_S, gt=0)
    verify_checksum: bool = True
    build_workers: int = Field(default=0, ge=0)
    preprocess_workers: int = Field(default=2, ge=1)
    stats_flush_s: float = Field(default=DEFAULT_STATS_FLUSH_S, gt=0)
    max_restarts: int = Field(default=DEFAULT_MAX_RESTARTS, ge=-1)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    source_rps: float = Field(default=0.0, ge=0)
    source_burst: int = Field(default=DEFAULT_SOURCE_BURST, ge=1)
    stream_after_s: float = Field(default=2.0, ge=0)

    @field_validator("namespace")
    @classmethod
    def _check_namespace(cls, value: str) -> str:
        return validate_name("namespace", value)

"""Which source URLs shardcache reads, and how one resolves to a filesystem.

Ranks validate a dataset's URLs here before anything is listed; the stores
list them (``shardcache_server.objects.list_source``) and read them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import fsspec

from shardcache.errors import ConfigError, SourceNotFound

__all__ = ["SUPPORTED_PROTOCOLS", "check_local_paths", "open_remote"]

# Schemes whose filesystems we test; others are refused rather than half-working.
SUPPORTED_PROTOCOLS = (
    "s3",
    "s3a",
    "gs",
    "gcs",
    "az",
    "abfs",
    "file",
    "local",
    "memory",
)


def open_remote(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[Any, str]:
    """Resolve ``url`` to ``(filesystem, path)`` with one ``fsspec.url_to_fs`` call.

    Raises:
        ConfigError: unsupported scheme or bad storage options.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(
            f"urls must be a non-empty string or list of strings, got {url!r}."
        )
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in SUPPORTED_PROTOCOLS:
        raise ConfigError(
            f"unsupported URL scheme {protocol!r} in {url!r}; use one of "
            f"{', '.join(SUPPORTED_PROTOCOLS)}."
        )
    if ".." in url.split("://", 1)[-1].split("/"):
        raise ConfigError(
            f"path traversal ('..') is not allowed in source URL {url!r}."
        )
    try:
        return fsspec.url_to_fs(url, **(storage_options or {}))
    except (TypeError, ValueError, ImportError) as exc:
        raise ConfigError(
            f"cannot open {url!r} with storage_options keys "
            f"{sorted(storage_options or {})}: {exc}"
        ) from exc


def _local_root(url: str) -> str:
    """The part of a local URL that must exist: the path before its first
    glob character's directory, or the whole path."""
    path = url.split("://", 1)[-1]
    magic = min((i for i in map(path.find, "*?[") if i >= 0), default=-1)
    if magic < 0:
        return path
    return os.path.dirname(path[:magic]) or "."  # "*.npy": the working directory


def check_local_paths(urls: str | Sequence[str]) -> None:
    """Each local URL's root exists on this machine.

    Only for a cache whose stores all run here (the embedded head): elsewhere
    a store may see files this process does not, and its listing decides.

    >>> check_local_paths(["/", "/no/such/dir/*.npy"])
    Traceback (most recent call last):
    ...
    shardcache.errors.SourceNotFound: local path '/no/such/dir' (of '/no/such/dir/*.npy') does not exist on this machine, where the embedded cache reads it. Check the path.
    """
    for url in [urls] if isinstance(urls, str) else urls:
        if "://" in url and not url.startswith(("file://", "local://")):
            continue
        root = _local_root(url)
        if not os.path.exists(root):
            of = "" if root == url else f" (of {url!r})"
            raise SourceNotFound(
                f"local path {root!r}{of} does not exist on this machine, where "
                "the embedded cache reads it. Check the path."
            )

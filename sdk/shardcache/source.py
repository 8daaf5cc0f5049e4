"""Which source URLs shardcache reads, and how one resolves to a filesystem.

Ranks validate a dataset's URLs here before anything is listed; the stores
list them (``shardcache_server.objects.list_source``) and read them.
"""

from __future__ import annotations

from typing import Any

import fsspec

from shardcache.errors import ConfigError

__all__ = ["SUPPORTED_PROTOCOLS", "open_remote"]

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

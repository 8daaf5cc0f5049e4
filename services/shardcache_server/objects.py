"""Turn an fsspec URL (prefix, glob, or list) into an ordered manifest of objects.

One listing call per distinct prefix gives every object's size and version
(the ETag on S3, ``fs.ukey`` elsewhere); there is never one HEAD per object.
The result is a compact :class:`~shardcache.manifest.Manifest` (arrays).
Only stores list: a dataset is listed once per cluster and published.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Any

from shardcache.errors import (
    ConfigError,
    EmptyDatasetError,
    RemoteFetchError,
    SourceNotFound,
)
from shardcache.manifest import Manifest
from shardcache.source import open_remote

__all__ = ["list_source"]

_GLOB_CHARS = "*?["


def _version_of(fs: Any, info: dict[str, Any]) -> str:
    # S3 gives the ETag in the listing itself; other filesystems get fs.ukey's
    # idea of a version computed from the same listing entry (mtime/size).
    for field in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified"):
        if info.get(field) is not None:
            return str(info[field]).strip('"')
    return f"size-{info.get('size')}"


def _list_one(fs: Any, path: str, url: str) -> dict[str, dict[str, Any]]:
    try:
        if any(c in path for c in _GLOB_CHARS):
            found = fs.glob(path, detail=True)
        else:
            found = fs.find(path, detail=True)
            if not found and fs.isfile(path):
                found = {path: fs.info(path)}
            elif not found and not fs.exists(path):
                raise FileNotFoundError(path)
    except FileNotFoundError as exc:
        raise SourceNotFound(
            f"source {url!r} does not exist (bucket or prefix not found). "
            "Check the URL and storage_options (endpoint, credentials)."
        ) from exc
    except PermissionError as exc:
        raise RemoteFetchError(
            f"permission denied listing {url!r}; check the credentials in storage_options."
        ) from exc
    except OSError as exc:
        raise RemoteFetchError(f"listing {url!r} failed: {exc}") from exc
    except Exception as exc:  # botocore/aiohttp errors s3fs did not map
        if type(exc).__module__.split(".")[0] not in (
            "botocore",
            "aiobotocore",
            "aiohttp",
        ):
            raise
        raise RemoteFetchError(
            f"listing {url!r} failed: {type(exc).__name__}: {exc}. Check the "
            "credentials and endpoint in storage_options."
        ) from exc
    return {p: i for p, i in found.items() if i.get("type", "file") == "file"}


def list_source(
    urls: str | Sequence[str], storage_options: dict[str, Any] | None = None
) -> Manifest:
    """List ``urls`` into a deterministic, sorted :class:`Manifest`.

    Args:
        urls: a prefix (``s3://bucket/train/``), a glob (``s3://b/*.jpg``) or a
            list of object URLs. A list is served by listing each distinct
            parent prefix once.
        storage_options: passed to fsspec, e.g. ``{"client_kwargs":
            {"endpoint_url": ...}}``.

    Raises:
        ConfigError: bad URL or scheme.
        SourceNotFound: the bucket or prefix does not exist.
        EmptyDatasetError: nothing matched.
        RemoteFetchError: the listing call failed.
    """
    url_list = [urls] if isinstance(urls, str) else list(urls)
    if not url_list:
        raise ConfigError(
            "urls is an empty list; pass a prefix, a glob or object URLs."
        )
    fs, _ = open_remote(url_list[0], storage_options)
    protocol = url_list[0].split("://", 1)[0] if "://" in url_list[0] else "file"
    objects: dict[str, tuple[int, str]] = {}
    if isinstance(urls, str):
        _, path = open_remote(urls, storage_options)
        for p, info in _list_one(fs, path, urls).items():
            objects[p] = (int(info["size"]), _version_of(fs, info))
    else:
        wanted: dict[str, list[str]] = {}
        for url in url_list:
            _, path = open_remote(url, storage_options)
            wanted.setdefault(posixpath.dirname(path), []).append(path)
        for parent, paths in wanted.items():
            listed = _list_one(fs, parent, parent)
            missing = [p for p in paths if p not in listed]
            if missing:
                raise SourceNotFound(
                    f"{len(missing)} listed object(s) do not exist, e.g. "
                    f"{_to_url(protocol, missing[0])!r}. Remove them from urls."
                )
            for p in paths:
                info = listed[p]
                objects[p] = (int(info["size"]), _version_of(fs, info))
    if not objects:
        raise EmptyDatasetError(
            f"source {url_list[0]!r} lists no objects. Check the prefix or glob; "
            "a prefix must end with the directory name, e.g. s3://bucket/train/."
        )
    ordered = sorted(objects)
    return Manifest.from_entries(
        protocol,
        [_to_url(protocol, p) for p in ordered],
        [objects[p][0] for p in ordered],
        [objects[p][1] for p in ordered],
    )


def _to_url(protocol: str, path: str) -> str:
    if protocol in ("file", "local"):
        return path
    return f"{protocol}://{path}"

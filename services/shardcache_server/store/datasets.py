"""What a job registered for one dataset, and the shapes the store passes around.

Ownership rule: a :class:`Dataset` is immutable once registered; the store
keeps one per name and replaces it whole when a job registers again (a
request that reads another listing works on a copy, never on the stored one).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shardcache.manifest import Manifest
from shardcache.variants import VariantSpec
from shardcache_server.builder import BuildRequest
from shardcache_server.variants import VariantRequest

__all__ = ["Builder", "Dataset", "Item", "Result"]

Item = tuple[str, str, int]  # (chunk key, chunk version, source bytes)
# (Status.HIT|FETCHED|REMOTE_HIT|UNCACHED|DISK_READ, ref), (Status.DISK, path)
# or (Status.ERROR, class, message)
# or (Status.UNINSTALLED,) when the store lost the dataset's preprocess (restart).
Result = tuple[Any, ...]
Builder = Callable[
    [BuildRequest | VariantRequest], Awaitable[tuple[Any, dict[str, Any]]]
]


@dataclass
class Dataset:
    name: str
    protocol: str
    fingerprint: str
    preprocess: Callable[[bytes], Any]
    storage_options: dict[str, Any]
    manifest: Manifest
    digest: str
    target: Callable[[str], Any] | None = None
    urls: Any = ""  # the source (prefix, glob or list), to list it again
    source: Any = None  # a user's map-style Dataset (``from_dataset``), via Ray
    spec: dict[str, Any] | None = None  # as registered (``warm --like`` copies it)
    variants: VariantSpec | None = None  # augmented variants (``variants=K``)

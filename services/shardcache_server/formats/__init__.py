"""Source formats for packed datasets: one module per format, a dict registry.

A user adds a format by subclassing
:class:`~shardcache_server.formats.base.SourceFormat` and registering it::

    FORMATS["myformat"] = MyFormat()
"""

from __future__ import annotations

from shardcache.errors import ConfigError
from shardcache_server.formats.base import SourceFile, SourceFormat, UnitRequest
from shardcache_server.formats.hdf5 import Hdf5Format
from shardcache_server.formats.lmdb import LmdbFormat
from shardcache_server.formats.npy import NpyFormat
from shardcache_server.formats.parquet import ParquetFormat
from shardcache_server.formats.tar import TarFormat

__all__ = [
    "FORMATS",
    "SourceFile",
    "SourceFormat",
    "UnitRequest",
    "get_format",
]

FORMATS: dict[str, SourceFormat] = {
    f.name: f
    for f in (TarFormat(), ParquetFormat(), Hdf5Format(), LmdbFormat(), NpyFormat())
}


def get_format(name: str) -> SourceFormat:
    """The registered format ``name``; ConfigError lists the valid names."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(
            f"unknown format {name!r}; choose one of {', '.join(sorted(FORMATS))} "
            "or register one in shardcache_server.formats.FORMATS."
        ) from None

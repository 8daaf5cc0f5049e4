"""Every Redis key and channel name shardcache uses, and nothing else.

All keys share the prefix ``shardcache:{namespace}:`` so that two deployments
(tenants) on one Redis never see or invalidate each other's datasets, and so
that ``SCAN MATCH shardcache:{ns}:*`` finds exactly one deployment's state.

Schema (see docs/architecture.md for who writes what):

=========================================  ======  ===========================================
key                                        type    content
=========================================  ======  ===========================================
``{p}:datasets``                           set     dataset names
``{p}:ds:{ds}``                            hash    source, fingerprint, generation, timestamps
``{p}:entries:{ds}:v{gen}``                hash    object path -> JSON entry (etag, size, ...)
``{p}:owners:{ds}:v{gen}``                 hash    object path -> ``node_id/incarnation``
``{p}:stats:{ds}``                         hash    cumulative counters
``{p}:stats:{ds}:node:{node}``             hash    counters of one node
``{p}:stats:{ds}:gen:{gen}``               hash    counters of one generation (version cost)
``{p}:stats:{ds}:ts:{bucket}``             hash    counters of one time bucket (expire)
``{p}:ranks:{ds}``                         hash    ``job/rank`` -> JSON wait percentiles
``{p}:stores``                             hash    node_id -> JSON store heartbeat
``{p}:events``                             list    JSON events, newest first, capped
``{p}:invalidate``                         pubsub  JSON invalidation messages
``{p}:budget:{source}``                    hash    request token bucket (services/budget.py)
=========================================  ======  ===========================================
"""

from __future__ import annotations

import re

__all__ = [
    "DEFAULT_NAMESPACE",
    "budget_key",
    "dataset_key",
    "datasets_key",
    "entries_key",
    "events_key",
    "invalidation_channel",
    "owners_key",
    "prefix",
    "ranks_key",
    "stats_key",
    "stats_generation_key",
    "stats_node_key",
    "stats_series_key",
    "stores_key",
    "validate_name",
]

DEFAULT_NAMESPACE = "default"  # one deployment per Redis unless told otherwise
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def validate_name(kind: str, value: str) -> str:
    """Return ``value`` if it is safe inside a Redis key, else raise ConfigError.

    Names become key segments and Ray actor names, so ``:``, ``*``, ``/`` and
    whitespace are refused rather than escaped.
    """
    from shardcache.errors import ConfigError

    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(
            f"{kind} must be 1-128 characters of letters, digits, '_', '.', '-' "
            f"starting with a letter or digit, got {value!r}."
        )
    return value


def prefix(ns: str) -> str:
    return f"shardcache:{ns}"


def datasets_key(ns: str) -> str:
    return f"{prefix(ns)}:datasets"


def dataset_key(ns: str, ds: str) -> str:
    return f"{prefix(ns)}:ds:{ds}"


def entries_key(ns: str, ds: str, generation: int) -> str:
    return f"{prefix(ns)}:entries:{ds}:v{generation}"


def owners_key(ns: str, ds: str, generation: int) -> str:
    return f"{prefix(ns)}:owners:{ds}:v{generation}"


def stats_key(ns: str, ds: str) -> str:
    return f"{prefix(ns)}:stats:{ds}"


def stats_node_key(ns: str, ds: str, node_id: str) -> str:
    return f"{prefix(ns)}:stats:{ds}:node:{node_id}"


def stats_generation_key(ns: str, ds: str, generation: int) -> str:
    return f"{prefix(ns)}:stats:{ds}:gen:{generation}"


def stats_series_key(ns: str, ds: str, bucket_s: int) -> str:
    return f"{prefix(ns)}:stats:{ds}:ts:{bucket_s}"


def ranks_key(ns: str, ds: str) -> str:
    return f"{prefix(ns)}:ranks:{ds}"


def stores_key(ns: str) -> str:
    return f"{prefix(ns)}:stores"


def events_key(ns: str) -> str:
    return f"{prefix(ns)}:events"


def budget_key(ns: str, source: str) -> str:
    return f"{prefix(ns)}:budget:{source}"


def invalidation_channel(ns: str) -> str:
    return f"{prefix(ns)}:invalidate"

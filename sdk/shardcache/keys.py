"""Every Redis key and channel name shardcache uses, and the name of a chunk.

All keys share the prefix ``shardcache:{namespace}:`` so that two deployments
(tenants) on one Redis never see or invalidate each other's datasets, and so
that ``SCAN MATCH shardcache:{ns}:*`` finds exactly one deployment's state.

Schema (see docs/architecture.md for who writes what):

=========================================  ======  ===========================================
key                                        type    content
=========================================  ======  ===========================================
``{p}:datasets``                           set     dataset names
``{p}:ds:{ds}``                            hash    source, fingerprint, generation, timestamps
``{p}:entries:{ds}:v{gen}``                hash    chunk key -> JSON entry (version, size, ...)
``{p}:owners:{ds}:v{gen}``                 hash    chunk key -> ``node_id/incarnation``
``{p}:manifest:{ds}``                      hash    who holds the published listing, its digest
``{p}:stats:{ds}``                         hash    cumulative counters
``{p}:stats:{ds}:node:{node}``             hash    counters of one node
``{p}:stats:{ds}:gen:{gen}``               hash    counters of one generation (version cost)
``{p}:stats:{ds}:ts:{bucket}``             hash    counters of one time bucket (expire)
``{p}:ranks:{ds}``                         hash    ``job/rank`` -> JSON wait percentiles
``{p}:stores``                             hash    node_id -> JSON store heartbeat
``{p}:events``                             list    JSON events, newest first, capped
``{p}:invalidate``                         pubsub  JSON invalidation messages
``{p}:invalidated:{ds}:{call}``            string  the generation one job's call made (expires)
``{p}:budget:{source}``                    hash    request token bucket (services/budget.py)
``{p}:usage:{ds}[:job:{job}][:ts:{b}]``    hash    samples the ranks delivered, per origin
``{p}:usage:{ds}:jobs``, ``:ranks``        zset    jobs / ``job/rank`` by last report time
``{p}:usage:{ds}:rank:{job}/{rank}``       hash    one rank's totals and waits per epoch
``{p}:usage:{ds}:seq:{reporter}``          string  last applied flush of one reporter
=========================================  ======  ===========================================

A chunk key is ``c<n>``, chunk ``n`` of a listing (:func:`chunk_key`,
:func:`parse_chunk_key`): the field of the entries and owners hashes, and the
name a store, the disk tier and a rank's request use. An augmented variant of
a chunk (``variants=K``, ``shardcache.variants``) is ``c<n>.v<k>``
(:func:`chunk_key` with ``variant``, :func:`parse_variant_key`): only a
store's table and a rank's request name it; it is never an index field, a
claim or a disk-tier file (variants are node-local, derived from the base).
"""

from __future__ import annotations

import re

from shardcache.errors import ConfigError

__all__ = [
    "DEFAULT_NAMESPACE",
    "budget_key",
    "chunk_key",
    "dataset_key",
    "datasets_key",
    "entries_key",
    "events_key",
    "invalidated_key",
    "invalidation_channel",
    "manifest_key",
    "owners_key",
    "is_variant_key",
    "parse_chunk_key",
    "parse_variant_key",
    "prefix",
    "ranks_key",
    "stats_key",
    "stats_generation_key",
    "stats_node_key",
    "stats_series_key",
    "stores_key",
    "usage_job_key",
    "usage_job_series_key",
    "usage_jobs_key",
    "usage_key",
    "usage_prefix",
    "usage_rank_key",
    "usage_ranks_key",
    "usage_seq_key",
    "usage_series_key",
    "validate_name",
]

DEFAULT_NAMESPACE = "default"  # one deployment per Redis unless told otherwise
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def validate_name(kind: str, value: str) -> str:
    """Return ``value`` if it is safe inside a Redis key, else raise ConfigError.

    Names become key segments and Ray actor names, so ``:``, ``*``, ``/`` and
    whitespace are refused rather than escaped.
    """
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(
            f"{kind} must be 1-128 characters of letters, digits, '_', '.', '-' "
            f"starting with a letter or digit, got {value!r}."
        )
    return value


def chunk_key(chunk: int, variant: int | None = None) -> str:
    """The name of chunk ``chunk`` of a listing, the one form everything uses: index
    entries and owner claims, store tables, disk-tier files, requests; with
    ``variant``, the name of that augmented variant of the chunk.

    >>> chunk_key(7), parse_chunk_key("c7"), chunk_key(7, 2), parse_variant_key("c7.v2")
    ('c7', 7, 'c7.v2', (7, 2))
    """
    if variant is None:
        return f"c{int(chunk)}"
    return f"c{int(chunk)}.v{int(variant)}"


def _number(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() else None


def parse_chunk_key(key: str) -> int:
    """The chunk number in ``key``, the inverse of :func:`chunk_key` for a base
    chunk. A variant key is refused: code that reads base chunks (claims,
    disk files, builds, eviction plans) must never take a variant for one.

    Raises:
        ConfigError: ``key`` is not ``"c<n>"``.
    """
    if isinstance(key, str) and key[:1] == "c":
        number = _number(key[1:])
        if number is not None:
            return number
    raise ConfigError(
        f"a chunk key is 'c' and the chunk's number (c0, c1, ...), got {key!r}; "
        "the rank and the store run different shardcache versions?"
    )


def is_variant_key(key: str) -> bool:
    """Whether ``key`` names an augmented variant (``c<n>.v<k>``).

    >>> is_variant_key("c7.v0"), is_variant_key("c7")
    (True, False)
    """
    return isinstance(key, str) and ".v" in key


def parse_variant_key(key: str) -> tuple[int, int | None]:
    """``(chunk, variant)`` of a chunk key, ``variant`` ``None`` for a base key.

    Raises:
        ConfigError: ``key`` is neither ``"c<n>"`` nor ``"c<n>.v<k>"``.
    """
    base, sep, variant = key.partition(".v") if isinstance(key, str) else ("", "", "")
    if not sep:
        return parse_chunk_key(key), None
    number = _number(variant)
    if number is None:
        raise ConfigError(
            f"a variant chunk key is 'c<n>.v<k>' (c7.v0, c7.v1, ...), got {key!r}; "
            "the rank and the store run different shardcache versions?"
        )
    return parse_chunk_key(base), number


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


def manifest_key(ns: str, ds: str) -> str:
    return f"{prefix(ns)}:manifest:{ds}"


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


def invalidated_key(ns: str, ds: str, call: str) -> str:
    """The generation that ``call`` (``job/restart/epoch/n``: a job's n-th
    ``ds.invalidate()`` of an epoch) made, for its other ranks."""
    return f"{prefix(ns)}:invalidated:{ds}:{call}"


# -- usage: the samples ranks delivered, as the ranks report them (usage.py) ------


def usage_key(ns: str, ds: str) -> str:
    return f"{prefix(ns)}:usage:{ds}"


def usage_series_key(ns: str, ds: str, bucket_s: int) -> str:
    return f"{prefix(ns)}:usage:{ds}:ts:{bucket_s}"


def usage_jobs_key(ns: str, ds: str) -> str:
    return f"{prefix(ns)}:usage:{ds}:jobs"


def usage_job_key(ns: str, ds: str, job: str) -> str:
    return f"{prefix(ns)}:usage:{ds}:job:{job}"


def usage_job_series_key(ns: str, ds: str, job: str, bucket_s: int) -> str:
    return f"{prefix(ns)}:usage:{ds}:job:{job}:ts:{bucket_s}"


def usage_ranks_key(ns: str, ds: str) -> str:
    return f"{prefix(ns)}:usage:{ds}:ranks"


def usage_rank_key(ns: str, ds: str, member: str) -> str:
    """``member`` is ``job/rank`` as listed in :func:`usage_ranks_key`."""
    return f"{prefix(ns)}:usage:{ds}:rank:{member}"


def usage_prefix(ns: str) -> str:
    """The start of every usage key: what a rank may touch through an endpoint."""
    return f"{prefix(ns)}:usage:"


def usage_seq_key(ns: str, ds: str, reporter: str) -> str:
    return f"{prefix(ns)}:usage:{ds}:seq:{reporter}"

"""DatasetSpec: what a dataset reads (source, naming, preprocessing, chunking, where the cache is), validated once before any I/O but the URL check.

Every argument of ``DistributedCachedDataset`` except how ranks split the
data (the sampler checks those) and the job id (``shardcache.job``) is
checked here, so a bad one fails at construction with a ``ConfigError``
naming it, and the rest of the dataset reads settled values.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from shardcache.config import ClientConfig
from shardcache.decoders import as_arrays, raw_bytes
from shardcache.errors import ConfigError
from shardcache.fingerprint import dataset_fingerprint
from shardcache.keys import validate_name
from shardcache.manifest import Manifest
from shardcache.packed_manifest import format_of, objects_preprocess
from shardcache.picklability import check_picklable
from shardcache.source import open_remote
from shardcache.variants import VariantSpec

__all__ = [
    "CONSISTENCY_MODES",
    "ON_ERROR_MODES",
    "REVALIDATE_MODES",
    "DatasetSpec",
    "check_source_dataset",
    "default_name",
    "source_summary",
]

CONSISTENCY_MODES = ("epoch", "batch")  # when a rank picks up a new generation
REVALIDATE_MODES = ("job", "never")  # or a number: seconds a listing stays fresh
ON_ERROR_MODES = ("raise", "skip")  # a sample whose object cannot be read or built
PROBE_OBJECTS = 64  # listed objects whose extension picks the default preprocess


def default_name(urls: str | Sequence[str]) -> str:
    """A readable, stable dataset name derived from the URL(s).

    >>> default_name("s3://bucket/train/")
    'bucket-train-365e5c26'
    """
    first = urls if isinstance(urls, str) else "|".join(urls)
    stem = urls if isinstance(urls, str) else urls[0]
    words = (
        re.sub(r"[^A-Za-z0-9]+", "-", stem.split("://", 1)[-1]).strip("-")[:60]
        or "data"
    )
    return f"{words}-{hashlib.sha256(first.encode()).hexdigest()[:8]}"


def source_summary(urls: str | Sequence[str]) -> str:
    """The source as error messages name it: never a whole URL list (millions
    of lines), never a presigned URL's query (its signature).

    >>> source_summary(["s3://b/a.npy?X-Amz-Signature=s", "s3://b/c.npy"])
    's3://b/a.npy and 1 more'
    """
    first = urls if isinstance(urls, str) else (list(urls) or [""])[0]
    first = first.split("?", 1)[0]
    more = 0 if isinstance(urls, str) else len(urls) - 1
    return f"{first} and {more} more" if more else first


def open_token(revalidate: str | float, job: str) -> str:
    """The listing token a new dataset sends (``listing.py``): one listing per
    job, none at all, or one no older than N seconds.

    >>> open_token("job", "abc"), open_token("never", "abc"), open_token(600, "x")
    ('open/abc', '', 'max-age/600.0')

    Raises:
        ConfigError: ``revalidate`` is none of those.
    """
    if revalidate == "job":
        return f"open/{job}"
    if revalidate == "never":
        return ""
    if (
        isinstance(revalidate, int | float)
        and not isinstance(revalidate, bool)
        and revalidate > 0
    ):
        return f"max-age/{float(revalidate)}"
    raise ConfigError(
        f"revalidate must be 'job', 'never' or a number of seconds > 0, got "
        f"{revalidate!r}."
    )


def _check_urls(urls: Any) -> None:
    """``urls`` is a string or a non-empty list of non-empty strings.

    >>> _check_urls(["s3://b/a", 5])
    Traceback (most recent call last):
    ...
    shardcache.errors.ConfigError: urls[1] is an int (5); every entry must be a URL string.
    """
    if isinstance(urls, str):
        if not urls:
            raise ConfigError("urls is an empty string; pass a prefix, a glob or URLs.")
        return
    if isinstance(urls, (bytes, Mapping)) or not hasattr(urls, "__iter__"):
        raise ConfigError(
            f"urls must be a URL string or a list of them, got "
            f"{type(urls).__name__} {urls!r}."
        )
    urls = list(urls)
    if not urls:
        raise ConfigError(
            "urls is an empty list; pass a prefix, a glob or object URLs."
        )
    for i, url in enumerate(urls):
        if not isinstance(url, str) or not url:
            raise ConfigError(
                f"urls[{i}] is {'an' if type(url).__name__[0] in 'aeiou' else 'a'} "
                f"{type(url).__name__} ({url!r}); every entry must be a URL string."
            )


def _protocol(urls: str | Sequence[str], storage_options: dict[str, Any]) -> str:
    """The scheme of the source (``urls`` passed :func:`_check_urls`), validated
    (no listing)."""
    first = urls if isinstance(urls, str) else list(urls)[0]
    open_remote(first, storage_options)
    return first.split("://", 1)[0] if "://" in first else "file"


def _one_of(label: str, value: Any, modes: tuple[str, ...]) -> str:
    if value not in modes:
        raise ConfigError(
            f"{label} must be one of {', '.join(map(repr, modes))}, got {value!r}."
        )
    return value


def _client_config(**overrides: Any) -> ClientConfig:
    """Where the cache is: explicit arguments over ``SHARDCACHE_*`` env."""
    try:
        return ClientConfig(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        # Each field and what is wrong, without pydantic's echo of the input
        # (a redis_url's password) or its links.
        raise ConfigError(
            "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors(include_url=False, include_input=False)
            )
        ) from None
    except ValueError as exc:  # a setting pydantic-settings could not parse
        raise ConfigError(str(exc)) from None


def check_source_dataset(dataset: Any) -> None:
    """``from_dataset``'s argument: a map-style Dataset that can travel to the
    cache workers.

    Raises:
        ConfigError: no ``__getitem__``/``__len__``, or it cannot be pickled.
    """
    from ray import cloudpickle

    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"from_dataset needs a map-style Dataset with __getitem__ and __len__, "
            f"got {type(dataset).__name__}."
        )
    try:
        cloudpickle.dumps(dataset)
    except Exception as exc:  # whatever pickling raises names the culprit
        raise ConfigError(
            f"{type(dataset).__name__} cannot be pickled ({type(exc).__name__}: "
            f"{exc}), so it cannot be sent to the cache workers. Open files, "
            "sockets or database handles lazily inside __getitem__ instead of "
            "in __init__ (or drop them in __getstate__)."
        ) from exc


@dataclass(frozen=True, eq=False)
class DatasetSpec:
    """What a dataset reads, validated: made by :meth:`validate`, completed
    once the listing is known by :meth:`settle` (the default preprocess of
    plain objects, the fingerprint). Immutable; it pickles to DataLoader
    workers as it is. The arguments are those of ``DistributedCachedDataset``.
    """

    urls: str | list[str]
    name: str
    protocol: str  # the URL scheme; "dataset" for from_dataset
    storage_options: dict[str, Any]
    format: str | None
    format_options: dict[str, Any]
    chunk_bytes: int
    chunk_samples: int
    preprocess: Callable[..., Any]
    preprocess_given: bool
    transform: Callable[[Any], Any] | None
    target: Callable[[str], Any] | None
    version: str | None
    source_dataset: Any
    source_version: str
    revalidate: str | float
    on_error: str
    consistency: str
    config: ClientConfig
    fingerprint: str = ""  # set by settle()
    variants: VariantSpec | None = None  # augmented variants (variants=K)

    @classmethod
    def validate(
        cls,
        urls: str | Sequence[str],
        preprocess: Callable[..., Any] | None,
        transform: Callable[[Any], Any] | None,
        *,
        storage_options: dict[str, Any] | None,
        name: str | None,
        target: Callable[[str], Any] | None,
        chunk_bytes: int,
        chunk_samples: int,
        format: str | None,  # noqa: A002 (the word users know)
        format_options: dict[str, Any] | None,
        source_dataset: Any,
        source_version: str | None,
        version: str | None,
        revalidate: str | float,
        on_error: str,
        consistency: str,
        redis_url: str | None,
        ray_address: str | None,
        namespace: str | None,
        prefetch_batches: int | None,
        allow_remote: bool | None,
        augment: Callable[..., Any] | None = None,
        variants: int = 1,
        seed: int = 0,
    ) -> DatasetSpec:
        """Check every argument (the dataset's, whose signature holds the
        defaults); the only I/O is resolving the URL's filesystem.

        Raises:
            ConfigError: the argument that is wrong, its value and the fix.
        """
        if source_dataset is None:
            _check_urls(urls)
        for label, mapping in (
            ("storage_options", storage_options),
            ("format_options", format_options),
        ):
            if mapping is not None and not isinstance(mapping, Mapping):
                raise ConfigError(
                    f"{label} must be a dict or None, got {type(mapping).__name__}."
                )
        if version is not None and not isinstance(version, str):
            raise ConfigError(
                f"version must be a string or None, got {type(version).__name__} "
                f"{version!r}; e.g. version='v2'."
            )
        for label, fn in (
            ("preprocess", preprocess),
            ("target", target),
            ("transform", transform),
        ):
            if fn is not None and not callable(fn):
                raise ConfigError(
                    f"{label} must be callable or None, got {type(fn).__name__}."
                )
            check_picklable(fn, label)
        variant_spec = VariantSpec.validate(augment, variants, seed)
        _one_of("on_error", on_error, ON_ERROR_MODES)
        _one_of("consistency", consistency, CONSISTENCY_MODES)
        for label, value in (
            ("chunk_bytes", chunk_bytes),
            ("chunk_samples", chunk_samples),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{label} must be an integer >= 1, got {value!r}.")
        config = _client_config(
            redis_url=redis_url,
            ray_address=ray_address,
            namespace=namespace,
            prefetch_batches=prefetch_batches,
            allow_remote=allow_remote,
        )
        open_token(revalidate, "")  # validated before any I/O
        storage_options = dict(storage_options or {})
        packed = format or (None if source_dataset is not None else format_of(urls))
        if format_options and not packed:
            raise ConfigError(
                f"format_options={dict(format_options)!r} given, but "
                f"{source_summary(urls) if source_dataset is None else 'a wrapped Dataset'} "
                "is read one object per sample (no packed format), where they "
                "mean nothing. Pass format= (tar, parquet, hdf5, lmdb, npy) for "
                "a packed source, or drop format_options and decode each "
                "object with preprocess=."
            )
        return cls(
            urls=urls if isinstance(urls, str) else list(urls),
            name=validate_name("name", name)
            if name is not None
            else default_name(urls),
            protocol="dataset"
            if source_dataset is not None
            else _protocol(urls, storage_options),
            storage_options=storage_options,
            format=packed,
            format_options=dict(format_options or {}),
            chunk_bytes=chunk_bytes,
            chunk_samples=chunk_samples,
            preprocess=preprocess or (as_arrays if packed else raw_bytes),
            preprocess_given=preprocess is not None,
            transform=transform,
            target=target,
            version=version,
            source_dataset=source_dataset,
            source_version=source_version or "",
            revalidate=revalidate,
            on_error=on_error,
            consistency=consistency,
            config=config,
            variants=variant_spec,
        )

    def settle(self, manifest: Manifest) -> DatasetSpec:
        """This spec with what the listing decides: plain objects with no
        preprocess given get the one their extension names (one reading
        whether they came from a prefix, a glob or a list), and the
        fingerprint that versions the cache is taken."""
        preprocess = self.preprocess
        if (
            self.format is None
            and not self.preprocess_given
            and self.source_dataset is None
        ):
            n = min(PROBE_OBJECTS, len(manifest))
            probe = [manifest.url(i) for i in range(n)]
            preprocess = objects_preprocess(probe, self.urls) or raw_bytes
        return replace(
            self,
            preprocess=preprocess,
            fingerprint=dataset_fingerprint(preprocess, self.target, self.version),
        )

    def open_token(self, job: str) -> str:
        """The listing token this job's ranks send when they construct it."""
        return open_token(self.revalidate, job)

    @property
    def source(self) -> str:
        """The source as the index records it (a list is counted, not stored)."""
        return self.urls if isinstance(self.urls, str) else f"{len(self.urls)} urls"

    @property
    def summary(self) -> str:
        """The source as error messages name it (:func:`source_summary`)."""
        return source_summary(self.urls)

    def listing(self) -> dict[str, Any]:
        """What the stores list and build from (``client.manifest``)."""
        out: dict[str, Any] = {
            "name": self.name,
            "urls": self.urls,
            "protocol": self.protocol,
            "storage_options": self.storage_options,
            "chunk_bytes": self.chunk_bytes,
            "chunk_samples": self.chunk_samples,
        }
        if self.format:
            out.update(format=self.format, format_options=self.format_options)
        if self.source_dataset is not None:
            out.update(
                format="dataset",
                source_object=self.source_dataset,
                source_version=self.source_version,
            )
        return out

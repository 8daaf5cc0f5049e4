"""Turn an fsspec URL (prefix, glob, or list) into an ordered manifest of objects.

A listing streams: objects arrive page by page (S3 ListObjectsV2 pages of
1,000, a local directory at a time) and are appended to compact columns
(:class:`~shardcache.manifest.ManifestWriter`), never held as a list of
dicts. The prefix is listed one level down with delimiter ``/`` and each
sub-prefix is listed concurrently (a bounded pool); the parts are joined
in byte order of their names, so the manifest's order (the keys sorted)
never depends on which part finished first. Sizes and versions come from
the listing itself (the ETag on S3, the mtime on local files), never one
HEAD per object. Only stores list: a dataset is listed once per cluster.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import random
import re
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from shardcache.errors import (
    ConfigError,
    EmptyDatasetError,
    RemoteFetchError,
    SourceNotFound,
    StaleVersionError,
)
from shardcache.manifest import Manifest, ManifestWriter
from shardcache.source import open_remote
from shardcache_server.list_pages import fast_pages, page_objects
from shardcache_server.list_stream import STREAM_AFTER_S, LeadingPrefix, OnPrefix

__all__ = [
    "LIST_CONCURRENCY",
    "LIST_PAGE_KEYS",
    "LIST_RETRIES",
    "Accept",
    "list_prefixes",
    "list_source",
    "LISTED_ON",
    "listed_here",
    "local_changed",
    "local_version",
]

_GLOB_CHARS = "*?["
LIST_CONCURRENCY = 16  # sub-prefixes listed at once (each one request in flight)
LIST_RETRIES = 8  # a page answered 503/5xx is asked again this often, then fails
_BACKOFF_S, _BACKOFF_MAX_S = 0.05, 5.0  # doubling, with full jitter
LIST_PAGE_KEYS = 1000  # keys per ListObjectsV2 page (S3's maximum)
_S3 = ("s3", "s3a")
_RETRYABLE_STATUS = (500, 502, 503, 504)

Accept = Callable[[str], bool]  # a path filter (glob, wanted set)


def _version_of(fs: Any, info: dict[str, Any]) -> str:
    # S3 gives the ETag in the listing itself; other filesystems get fs.ukey's
    # idea of a version computed from the same listing entry (mtime/size).
    for field in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified"):
        if info.get(field) is not None:
            return str(info[field]).strip('"')
    return f"size-{info.get('size')}"


def _not_found(url: str) -> SourceNotFound:
    if "://" not in url or url.startswith(("file://", "local://")):
        return SourceNotFound(
            f"local path {url!r} does not exist on the node that lists it "
            f"({socket.gethostname()}). Check the path; local files must be at "
            "the same path on every node of the cache."
        )
    return SourceNotFound(
        f"source {url!r} does not exist (bucket or prefix not found). "
        "Check the URL and storage_options (endpoint, credentials)."
    )


# The stores list and read, each with its own Ray node's environment: the
# training script's AWS_* variables reach them only in the embedded mode,
# where the script's machine is the node.
CREDENTIALS_HINT = (
    "The cache's stores list and read the source with storage_options= and the "
    "environment of their own Ray node, not the training script's AWS_* "
    "variables: pass key, secret (and endpoint_url) in storage_options, or set "
    "them on the Ray nodes (the chart's s3 values). The embedded cache keeps "
    "the environment of the script that started it: after setting AWS_* "
    "variables, run `shardcache local stop` and start the script again."
)
_NO_CREDENTIALS = frozenset(
    {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
)


def is_missing_credentials(exc: BaseException) -> bool:
    """botocore found no (or half the) credentials: no retry will find them."""
    return type(exc).__name__ in _NO_CREDENTIALS


def no_credentials(action: str, url: str, exc: BaseException) -> RemoteFetchError:
    """The error for ``action`` (listing, reading) ``url`` without credentials."""
    return RemoteFetchError(
        f"{action} {url!r} found no credentials ({type(exc).__name__}). "
        f"{CREDENTIALS_HINT}"
    )


def _failed(url: str, exc: BaseException) -> RemoteFetchError:
    if isinstance(exc, PermissionError):
        return RemoteFetchError(
            f"permission denied listing {url!r}; check the credentials in "
            f"storage_options. {CREDENTIALS_HINT}"
        )
    if is_missing_credentials(exc):
        return no_credentials("listing", url, exc)
    return RemoteFetchError(
        f"listing {url!r} failed: {type(exc).__name__}: {exc}. Check the "
        "credentials and endpoint in storage_options."
    )


def _is_backend_error(exc: BaseException) -> bool:
    root = type(exc).__module__.split(".")[0]
    return root in ("botocore", "aiobotocore", "aiohttp")


# -- the order: names sorted as bytes, a sub-prefix where its name + "/" sorts ------
def _dir_key(name: str) -> bytes:
    # "a/x" sorts after "a.txt" ("." < "/"): a directory takes its place as
    # "a/", so walking sorted levels gives exactly the keys sorted as bytes.
    return name.encode(errors="surrogateescape") + b"/"


class _Parts:
    """The parts of one level in their final order: runs of objects listed at
    this level and, between them, the sub-prefixes (listed later, maybe
    concurrently) whose writers fill their slots."""

    def __init__(self) -> None:
        self.slots: list[ManifestWriter] = [ManifestWriter()]
        self.prefixes: list[tuple[str, int]] = []  # (sub-prefix, its slot)
        self.done: set[int] = set()  # slots listed in full (list_stream.py)

    @property
    def here(self) -> ManifestWriter:
        return self.slots[-1]

    def prefix(self, path: str) -> None:
        self.done.add(len(self.slots) - 1)  # this level's run before it ends
        self.prefixes.append((path, len(self.slots)))
        self.slots += [ManifestWriter(), ManifestWriter()]


# -- local files: os.scandir, one directory at a time ------------------------------
def _scan(path: str) -> list[bytes]:
    """One directory's names, sorted as the keys sort (a directory's name
    ends in ``/``). Only the names are held, ~60 B each: a level of 10,000
    files is ~0.6 MB while it is walked, whatever the dataset's size."""
    with os.scandir(path) as it:
        level = [_dir_key(e.name) if e.is_dir() else os.fsencode(e.name) for e in it]
    level.sort()
    return level


# The manifest column naming the host that listed it: a local file's version
# (its mtime) is checked against the file only there. Another node's copy of
# the same path may carry other mtimes (copied without -t) that are not
# another version: its reads are checked by size, as before (a review).
LISTED_ON = "listed_on"
_HOST = np.frombuffer(socket.gethostname().encode(), np.uint8)


def listed_here(columns: Any) -> bool:
    """Whether this host made the listing ``columns`` belong to (``False`` for a
    listing made before the column existed: no version check, as then)."""
    raw = columns.get(LISTED_ON)
    return raw is not None and bytes(raw) == socket.gethostname().encode()


def local_version(st: os.stat_result) -> str:
    """A local file's version: ``str(st_mtime)``, as fsspec's ``info()`` gives
    it (``_version_of``). Not ctime, which a rewrite cannot keep: Kubernetes
    sets a volume's group on every file at each mount (``fsGroup``), which
    moves every ctime and would re-read a whole dataset per pod."""
    return str(st.st_mtime)


_MTIME_VERSION = re.compile(r"^\d+(\.\d+)?(e[+-]?\d+)?$")


def local_changed(url: str, etag: str, st: os.stat_result) -> StaleVersionError | None:
    """The error for a local file read that is not the listed version, if so.

    ``st``: the open file's status taken *after* its bytes were read. A file rewritten in place with the same size passes a size check
    and has no checksum to compare: a README trial (2026-12-02) saw a job
    deliver the new bytes under its old listing, silently. A write that began
    before the stat has already moved the mtime (opening for writing
    truncates), so the bytes are the listed version's whenever it matches.
    A rewrite that keeps the mtime (``cp -p``, ``rsync -t``) is not seen
    (README, "Local files"). Asked on the host that listed the file only
    (``listed_here``).

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     st = os.stat(f.name)
    ...     local_changed("file://x", local_version(st), st) is None
    ...     print(local_changed("file://x", "1.5", st))
    True
    object 'file://x' changed since it was listed (version 1.5 -> ...
    """
    if not _MTIME_VERSION.match(etag):
        return None  # not a version this lister gave (a packed unit's, a fallback)
    now = local_version(st)
    if now == etag:
        return None
    return StaleVersionError(
        f"object {url!r} changed since it was listed (version {etag} -> {now}). "
        "Call DistributedCachedDataset.refresh() on every rank, or start a new "
        "job (it lists the source again), to read the new version."
    )


def _add_local(out: ManifestWriter, path: str, accept: Accept) -> None:
    if not accept(path):
        return
    st = os.stat(path)
    out.add_bytes(os.fsencode(path), st.st_size, local_version(st).encode())


def _walk_local(path: str, out: ManifestWriter, accept: Accept) -> None:
    stack = [(path, iter(_scan(path)))]
    while stack:
        here, names = stack[-1]
        for name in names:
            child = os.path.join(here, os.fsdecode(name.rstrip(b"/")))
            if name.endswith(b"/"):
                stack.append((child, iter(_scan(child))))
                break
            _add_local(out, child, accept)
        else:
            stack.pop()


def _list_local(root: str, accept: Accept, url: str) -> list[ManifestWriter]:
    if os.path.isfile(root):
        out = ManifestWriter()
        _add_local(out, root, accept)
        return [out]
    if not os.path.isdir(root):
        raise _not_found(url)
    parts = _Parts()
    try:
        for name in _scan(root):
            child = os.path.join(root, os.fsdecode(name.rstrip(b"/")))
            if name.endswith(b"/"):
                parts.prefix(child)
            else:
                _add_local(parts.here, child, accept)
        with ThreadPoolExecutor(min(LIST_CONCURRENCY, 8)) as pool:
            list(
                pool.map(
                    lambda ps: _walk_local(ps[0], parts.slots[ps[1]], accept),
                    parts.prefixes,
                )
            )
    except OSError as exc:
        raise _failed(url, exc) from exc
    return parts.slots


# -- any other fsspec filesystem: ls one level at a time ---------------------------
def _list_generic(fs: Any, root: str, accept: Accept, url: str) -> list[ManifestWriter]:
    protocol = url.split("://", 1)[0] if "://" in url else "file"

    def level(path: str) -> list[tuple[bytes, dict[str, Any]]]:
        found = fs.ls(path, detail=True)
        keyed = [
            (
                _dir_key(posixpath.basename(i["name"].rstrip("/")))
                if i.get("type") == "directory"
                else posixpath.basename(i["name"]).encode(),
                i,
            )
            for i in found
        ]
        return sorted(keyed, key=lambda e: e[0])

    def add(info: dict[str, Any]) -> None:
        if accept(info["name"]):
            url = _to_url(protocol, info["name"])
            out.add(url, int(info["size"]), _version_of(fs, info))

    def walk(path: str) -> None:
        for _, info in level(path):
            if info.get("type") == "directory":
                walk(info["name"])
            else:
                add(info)

    out = ManifestWriter()
    try:
        if fs.isfile(root):
            add(fs.info(root))
        elif not fs.exists(root):
            raise _not_found(url)
        else:
            walk(root)
    except FileNotFoundError as exc:
        raise _not_found(url) from exc
    except OSError as exc:
        raise _failed(url, exc) from exc
    return [out]


# -- S3: ListObjectsV2 pages, continuation tokens, sub-prefixes in parallel ---------
async def _pages(
    client: Any,
    bucket: str,
    prefix: str,
    url: str,
    budget: Any,
    delimiter: bool = False,
) -> AsyncIterator[dict[str, Any]]:
    """The ListObjectsV2 pages of ``prefix``, one request each. Every request
    takes a token of the source's budget (shared with the GETs); a page
    answered 503 SlowDown (or another 5xx, or a dropped connection) is asked
    again with the same continuation token after a backoff, so the listing
    continues where it stopped instead of starting over."""
    from botocore.exceptions import ClientError

    token, failures = None, 0
    while True:
        kw: dict[str, Any] = {
            "Bucket": bucket,
            "Prefix": prefix,
            "MaxKeys": LIST_PAGE_KEYS,
        }
        if delimiter:
            kw["Delimiter"] = "/"
        if token:
            kw["ContinuationToken"] = token
        if budget is not None:
            await budget.acquire(url)
        try:
            page = await client.list_objects_v2(**kw)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error.get("Code") in ("NoSuchBucket", "NoSuchKey") or status == 404:
                raise _not_found(url) from exc
            if status in (401, 403) or error.get("Code") == "AccessDenied":
                raise _failed(url, PermissionError(str(exc))) from exc
            if status not in _RETRYABLE_STATUS or failures >= LIST_RETRIES:
                raise _failed(url, exc) from exc
            if budget is not None:
                await budget.throttled(url)
            failures += 1
            await asyncio.sleep(_backoff_s(failures))
            continue
        except Exception as exc:  # dropped connections, timeouts (aiohttp/botocore)
            if not (_is_backend_error(exc) or isinstance(exc, OSError)):
                raise
            if failures >= LIST_RETRIES:
                raise _failed(url, exc) from exc
            failures += 1
            await asyncio.sleep(_backoff_s(failures))
            continue
        failures = 0
        yield page
        if not page.get("IsTruncated"):
            return
        token = page["NextContinuationToken"]


def _backoff_s(failures: int) -> float:
    return random.uniform(0, min(_BACKOFF_MAX_S, _BACKOFF_S * 2**failures))


def _add_s3(
    out: ManifestWriter,
    head: bytes,
    obj: tuple[str, int, str],
    accept: Accept,
    bucket: str,
) -> None:
    key, size, etag = obj
    if key.endswith("/") or not accept(f"{bucket}/{key}"):
        return  # a "directory" marker object, or filtered out
    out.add_bytes(head + key.encode(), size, (etag or f"size-{size}").encode())


def _unparsed(value: str) -> str:
    return value


def _skip_timestamps(session: Any) -> None:
    """Leave the pages' ``LastModified`` as the text S3 sent.

    botocore parses every key's timestamp with dateutil: py-spy put ~65% of
    a 100k-key listing's CPU there (`bench/listing.py`), and the listing
    never reads it (the ETag is the version). The parser factory is this
    listing's own session's (``skip_instance_cache``), and botocore makes a
    parser from it for each response, so no other client sees strings.
    """
    factory = session.get_component("response_parser_factory")
    factory.set_parser_defaults(timestamp_parser=_unparsed)


def single_attempt(options: dict[str, Any]) -> dict[str, Any]:
    """S3 storage options whose botocore client sends each request once.

    One retry policy, ours, with jittered backoff that feeds the shared
    request budget: botocore would otherwise send a 503 again underneath,
    unseen by it. A caller's own ``retries`` config is kept.

    >>> single_attempt({"anon": True})["config_kwargs"]["retries"]["total_max_attempts"]
    1
    """
    options = dict(options)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    options["config_kwargs"] = config
    return options


def ranged_options(url: str, options: dict[str, Any], budget: Any) -> dict[str, Any]:
    """The storage options a packed file's ranged reads of ``url`` open
    with: under a request budget on S3, :func:`single_attempt` (each attempt
    takes a token, ``fetch._s3_ranges``); else ``options`` as given.

    >>> ranged_options("file:///d/x.h5", {}, object())
    {}
    """
    if budget is not None and url.split("://", 1)[0] in ("s3", "s3a"):
        return single_attempt(options)
    return options


async def _open_s3(options: dict[str, Any]) -> tuple[Any, Any]:
    """This listing's own s3fs filesystem and client (private session)."""
    import s3fs

    fs = s3fs.S3FileSystem(
        asynchronous=True, skip_instance_cache=True, **single_attempt(options)
    )
    client = await fs.set_session()
    _skip_timestamps(fs.session)
    fast_pages(client)
    return fs, client


async def _list_prefix(
    client: Any,
    bucket: str,
    sub: str,
    out: ManifestWriter,
    accept: Accept,
    url: str,
    budget: Any,
) -> int:
    """Every key under ``sub`` into ``out``; returns the keys seen (filtered or not)."""
    head = f"{url.split('://', 1)[0]}://{bucket}/".encode()
    seen = 0
    async for page in _pages(client, bucket, sub, url, budget):
        objects = page_objects(page)
        seen += len(objects)
        for obj in objects:
            _add_s3(out, head, obj, accept, bucket)
    return seen


def list_prefixes(
    options: dict[str, Any],
    bucket: str,
    subs: list[str],
    accept: Accept,
    url: str,
    budget: Any,
) -> tuple[list[ManifestWriter], int]:
    """List each of ``subs`` into a writer of its own (at most
    ``LIST_CONCURRENCY`` pages in flight), in another process: a group of
    sub-prefixes sent out by :class:`list_fanout.FanOut`. Returns the
    writers and the keys seen."""
    from fsspec.asyn import get_loop, sync

    async def run() -> tuple[list[ManifestWriter], int]:
        fs, client = await _open_s3(options)
        try:
            sem = asyncio.Semaphore(LIST_CONCURRENCY)
            outs = [ManifestWriter() for _ in subs]

            async def one(sub: str, out: ManifestWriter) -> int:
                async with sem:
                    return await _list_prefix(
                        client, bucket, sub, out, accept, url, budget
                    )

            seen = await asyncio.gather(
                *(one(s, o) for s, o in zip(subs, outs, strict=True))
            )
            return outs, sum(seen)
        finally:
            await fs._s3creator.__aexit__(None, None, None)

    return sync(get_loop(), run)


async def _list_s3_async(
    options: dict[str, Any],
    protocol: str,
    root: str,
    accept: Accept,
    url: str,
    budget: Any,
    fan_out: Any,
    lead: LeadingPrefix | None = None,
) -> list[ManifestWriter]:
    bucket, _, key = root.partition("/")
    head = f"{protocol}://{bucket}/".encode()
    fs, client = await _open_s3(options)
    parts = _Parts()
    # Publishes the listed prefix while the rest is listed (list_stream.py).
    watching = asyncio.ensure_future(lead.watch(parts)) if lead else None
    try:
        prefix = key.rstrip("/") + "/" if key else ""
        sem = asyncio.Semaphore(LIST_CONCURRENCY)

        listed = [0]  # keys seen, filtered or not (nothing at all: not found)

        async def one_prefix(sub: str, slot: int) -> None:
            async with sem:
                listed[0] += await _list_prefix(
                    client, bucket, sub, parts.slots[slot], accept, url, budget
                )
            parts.done.add(slot)

        async def elsewhere(group: list[tuple[str, int]]) -> None:
            # A group listed by another process: its CPU is not this one's.
            subs = [sub for sub, _ in group]
            outs, seen = await fan_out.list(bucket, subs, accept, url)
            for (_, slot), out in zip(group, outs, strict=True):
                parts.slots[slot] = out
                parts.done.add(slot)
            listed[0] += seen

        tasks, group = [], []
        async for page in _pages(client, bucket, prefix, url, budget, True):
            # A page's keys and sub-prefixes are each sorted; interleave them
            # by name so each sub-prefix's slot sits where its keys sort.
            objects = page_objects(page)
            listed[0] += len(objects)
            entries: list[tuple[bytes, Any]] = [(o[0].encode(), o) for o in objects]
            entries += [
                (p["Prefix"].encode(), None) for p in page.get("CommonPrefixes", ())
            ]
            entries.sort(key=lambda e: e[0])
            for name, obj in entries:
                if obj is None:
                    parts.prefix(name.decode())
                    group.append(parts.prefixes[-1])
                    if fan_out is None:
                        sub, slot = group.pop()
                        tasks.append(asyncio.ensure_future(one_prefix(sub, slot)))
                    elif len(parts.prefixes) >= 2 * fan_out.group:
                        while len(group) >= fan_out.group:
                            sent, group = (
                                group[: fan_out.group],
                                group[fan_out.group :],
                            )
                            tasks.append(asyncio.ensure_future(elsewhere(sent)))
                else:
                    _add_s3(parts.here, head, obj, accept, bucket)
        if group and len(parts.prefixes) < 2 * fan_out.group:
            # Too few sub-prefixes to pay for other processes: listed here.
            tasks += [
                asyncio.ensure_future(one_prefix(sub, slot)) for sub, slot in group
            ]
        elif group:
            tasks.append(asyncio.ensure_future(elsewhere(group)))
        parts.done.add(len(parts.slots) - 1)  # this level's last run
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        if key and not any(len(s) for s in parts.slots) and not listed[0]:
            # Nothing under "key/": the URL may name one object.
            async for page in _pages(client, bucket, key, url, budget):
                for obj in page_objects(page):
                    if obj[0] == key:
                        listed[0] += 1
                        _add_s3(parts.here, head, obj, accept, bucket)
                break
            if not listed[0]:
                raise _not_found(url)
        return parts.slots
    finally:
        if watching is not None:
            watching.cancel()
        # The session's sockets closed now, not by a finaliser on another loop.
        await fs._s3creator.__aexit__(None, None, None)


def _list_s3(
    fs: Any,
    root: str,
    accept: Accept,
    url: str,
    options: dict[str, Any],
    budget: Any,
    fan_out: Any = None,
    lead: LeadingPrefix | None = None,
) -> list[ManifestWriter]:
    from fsspec.asyn import get_loop, sync

    protocol = url.split("://", 1)[0]
    try:
        return sync(
            get_loop(),
            _list_s3_async,
            options,
            protocol,
            root,
            accept,
            url,
            budget,
            fan_out,
            lead,
        )
    except (SourceNotFound, RemoteFetchError, ConfigError):
        raise
    except Exception as exc:
        if not (_is_backend_error(exc) or isinstance(exc, OSError)):
            raise
        raise _failed(url, exc) from exc


# -- one URL: prefix, glob or object -----------------------------------------------
def _glob_root(path: str) -> tuple[str, Accept]:
    from fsspec.utils import glob_translate

    first = min(path.index(c) for c in _GLOB_CHARS if c in path)
    root = path[: path.rfind("/", 0, first) + 1] or "/"
    pattern = re.compile(glob_translate(path))
    return root, lambda p: pattern.match(p) is not None


def _list_one(
    fs: Any,
    path: str,
    url: str,
    protocol: str,
    options: dict[str, Any],
    budget: Any,
    accept: Accept | None = None,
    fan_out: Any = None,
    lead: LeadingPrefix | None = None,
) -> list[ManifestWriter]:
    if any(c in path for c in _GLOB_CHARS):
        path, accept = _glob_root(path)
    keep: Accept = accept or (lambda _p: True)
    if protocol in _S3:
        return _list_s3(fs, path, keep, url, options, budget, fan_out, lead)
    if protocol in ("file", "local"):
        return _list_local(os.path.normpath(path) if path != "/" else path, keep, url)
    return _list_generic(fs, path, keep, url)


def list_source(
    urls: str | Sequence[str],
    storage_options: dict[str, Any] | None = None,
    budget: Any = None,
    fan_out: Any = None,
    on_prefix: OnPrefix | None = None,
    stream_after_s: float | None = None,
) -> Manifest:
    """List ``urls`` into a deterministic, sorted :class:`Manifest`.

    Args:
        urls: a prefix (``s3://bucket/train/``), a glob (``s3://b/*.jpg``) or a
            list of object URLs, prefixes and globs (their objects joined in
            key order). A list's object URLs are served by listing each
            distinct parent prefix once.
        storage_options: passed to fsspec, e.g. ``{"client_kwargs":
            {"endpoint_url": ...}}``.
        budget: the source's shared request budget
            (:class:`~shardcache_server.budget.RequestBudget`): every LIST
            request takes a token, as GETs do. Defaults to ``None``: no limit.
        fan_out: lists groups of an S3 prefix's sub-prefixes in other
            processes (:class:`~shardcache_server.list_fanout.FanOut`), so
            the parsing of a large listing uses more than one core.
            Defaults to ``None``: all in this process.
        on_prefix: receives growing prefixes of the listing (its first
            ``n`` objects) while the rest is listed, from a listing that runs
            longer than ``stream_after_s`` (``list_stream.py``). One S3
            prefix or glob only; other listings publish only their whole.
            Defaults to ``None``: none.

    Raises:
        ConfigError: bad URL or scheme.
        SourceNotFound: the bucket or prefix does not exist.
        EmptyDatasetError: nothing matched.
        RemoteFetchError: the listing failed (after retrying 5xx pages).
    """
    url_list = [urls] if isinstance(urls, str) else list(urls)
    if not url_list:
        raise ConfigError(
            "urls is an empty list; pass a prefix, a glob or object URLs."
        )
    options = dict(storage_options or {})
    fs, _ = open_remote(url_list[0], options)
    protocol = url_list[0].split("://", 1)[0] if "://" in url_list[0] else "file"
    if isinstance(urls, str):
        _, path = open_remote(urls, options)
        lead = None
        if on_prefix is not None:

            def hand_out(prefix: Manifest) -> None:
                prefix.columns[LISTED_ON] = _HOST
                on_prefix(prefix)

            after_s = STREAM_AFTER_S if stream_after_s is None else stream_after_s
            lead = LeadingPrefix(protocol, hand_out, after_s)
        parts = _list_one(
            fs, path, urls, protocol, options, budget, None, fan_out, lead
        )
        manifest = Manifest.concat(protocol, parts)
    else:
        manifest = _list_urls(fs, url_list, protocol, options, budget)
    manifest.columns[LISTED_ON] = _HOST
    if not len(manifest):
        if protocol in ("file", "local") and isinstance(urls, str):
            local = urls.split("://", 1)[-1]
            if os.path.isdir(local):  # the hint below would point at nothing
                raise EmptyDatasetError(
                    f"source {urls!r}: the directory exists but holds no files "
                    "(none in its subdirectories either). Check that the data "
                    "was copied there on this node, or point at another folder."
                )
        raise EmptyDatasetError(
            f"source {url_list[0]!r} lists no objects. Check the prefix or glob; "
            "a prefix must end with the directory name, e.g. s3://bucket/train/."
        )
    return manifest


def _list_urls(
    fs: Any, url_list: list[str], protocol: str, options: dict[str, Any], budget: Any
) -> Manifest:
    """A list: object URLs, each distinct parent listed once and filtered to
    the wanted ones (the caller already holds their names), and prefixes or
    globs, each listed whole. Their objects are joined in key order, one
    named twice listed once; held per object while listed, so a prefix of
    millions is better passed alone, as a string (it then streams)."""
    wanted: dict[str, set[str]] = {}
    found: dict[str, tuple[int, str]] = {}
    for url in url_list:
        _, path = open_remote(url, options)
        if not _names_many(url, path, protocol):
            wanted.setdefault(posixpath.dirname(path), set()).add(path)
            continue
        parts = _list_one(fs, path, url, protocol, options, budget)
        listed = Manifest.concat(protocol, parts)
        if not len(listed):
            raise EmptyDatasetError(
                f"{url!r} in urls lists no objects. Check the prefix or glob, "
                "or remove it from the list."
            )
        for i in range(len(listed)):
            found[_path_of(protocol, listed.url(i))] = (listed.size(i), listed.etag(i))
    for parent, paths in wanted.items():
        for part in _list_one(
            fs, parent, parent, protocol, options, budget, paths.__contains__
        ):
            listed = Manifest.concat(protocol, [part])
            for i in range(len(listed)):
                found[_path_of(protocol, listed.url(i))] = (
                    listed.size(i),
                    listed.etag(i),
                )
        missing = sorted(p for p in paths if p not in found)
        if missing:
            raise SourceNotFound(
                f"{len(missing)} listed object(s) do not exist, e.g. "
                f"{_to_url(protocol, missing[0])!r}. Remove them from urls (a "
                "prefix in a list ends with '/')."
            )
    out = ManifestWriter()
    for path in sorted(found, key=lambda p: p.encode(errors="surrogateescape")):
        out.add(_to_url(protocol, path), *found[path])
    return Manifest.concat(protocol, [out])


def _names_many(url: str, path: str, protocol: str) -> bool:
    """An entry of a list that is listed whole: a prefix (ending with ``/``),
    a glob, or a local folder; any other entry names one object."""
    return (
        url.endswith("/")
        or any(c in path for c in _GLOB_CHARS)
        or (protocol in ("file", "local") and os.path.isdir(path))
    )


def _to_url(protocol: str, path: str) -> str:
    if protocol in ("file", "local"):
        return path
    return f"{protocol}://{path}"


def _path_of(protocol: str, url: str) -> str:
    return url if protocol in ("file", "local") else url.split("://", 1)[1]

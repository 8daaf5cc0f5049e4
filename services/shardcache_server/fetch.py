"""Read remote objects at the version the listing saw: whole objects through
fsspec's async API with retries and checks (:class:`Fetcher`), and byte ranges
of a packed file (:func:`read_ranges`), each range one GET, never through a
read-ahead cache."""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import random
import re
from typing import Any

import fsspec

from shardcache.errors import (
    CorruptObjectError,
    RemoteFetchError,
    SourceFormatError,
    SourceNotFound,
    StaleVersionError,
)
from shardcache.source import open_remote
from shardcache_server.objects import (
    CREDENTIALS_HINT,
    _version_of,
    is_missing_credentials,
    no_credentials,
    single_attempt,
)

__all__ = ["Fetcher", "read_ranges"]

_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
_THROTTLE_CODES = ("SlowDown", "ServiceUnavailable", "503", "Throttling")
_SINGLE_GET_MAX_BYTES = 32 * 2**20  # larger objects use s3fs's concurrent ranged GETs
_RANGES_IN_FLIGHT = 8  # ranged GETs of one unit at once (a unit asks for a few)
_S3_PROTOCOLS = ("s3", "s3a")
_CLIENT_MODULES = ("botocore", "aiobotocore", "aiohttp")  # errors s3fs may pass on
_RANGE_ATTEMPTS = 4  # GETs of one range before its unit fails (s3fs retries 5xx too)
_RANGE_BACKOFF_S = 0.05  # first backoff of a ranged GET; doubles, full jitter
_RANGE_BACKOFF_MAX_S = 2.0
# With a request budget a 503 is paced here, not by s3fs underneath (about
# 1.9 s of sleeps over 5 tries): up to this many, backing off to 2 s each
# (about 5 s in all), before the unit fails.
_THROTTLED_ATTEMPTS = 10


class Fetcher:
    """Fetches objects of one filesystem with bounded concurrency and retries.

    Args:
        protocol: fsspec protocol of the dataset (``"s3"``, ``"file"``, ...).
        storage_options: passed to the filesystem.
        concurrency: GETs in flight at once.
        retries: attempts after the first. backoff_s / backoff_max_s: the
            exponential backoff with full jitter between attempts.
        timeout_s: limit for one attempt. verify_checksum: check MD5 ETags.
    """

    def __init__(
        self,
        protocol: str,
        storage_options: dict[str, Any],
        *,
        concurrency: int,
        retries: int,
        backoff_s: float,
        backoff_max_s: float,
        timeout_s: float,
        verify_checksum: bool = True,
        budget: Any = None,
    ):
        self.protocol = protocol
        self.storage_options = dict(storage_options)
        self.retries, self.backoff_s, self.backoff_max_s = (
            retries,
            backoff_s,
            backoff_max_s,
        )
        self.timeout_s, self.verify_checksum = timeout_s, verify_checksum
        self._concurrency = concurrency
        self.budget = budget  # a shared RequestBudget, or None for no limit
        self._sem: asyncio.Semaphore | None = None
        self._fs: Any = None

    async def _filesystem(self) -> Any:
        if self._fs is None:
            cls = fsspec.get_filesystem_class(self.protocol)
            if getattr(cls, "async_impl", False):
                # A private instance bound to this event loop: the store's loop
                # drives every GET, no thread hop per object.
                options = dict(self.storage_options)
                if self.protocol in ("s3", "s3a"):
                    # s3fs and botocore would otherwise retry SlowDown
                    # silently underneath (5 x 3 attempts).
                    options = single_attempt(options)
                    # botocore pools 10 connections unless told: GETs beyond
                    # that waited for a connection, and a store held ~10 in
                    # flight, not the ``concurrency`` it was given.
                    config = dict(options["config_kwargs"])
                    config.setdefault("max_pool_connections", self._concurrency)
                    options["config_kwargs"] = config
                fs = cls(asynchronous=True, skip_instance_cache=True, **options)
                if self.protocol in ("s3", "s3a"):
                    fs.retries = 1
                if hasattr(fs, "set_session"):
                    await fs.set_session()
            else:
                fs, _ = open_remote(f"{self.protocol}://", self.storage_options)
            self._fs = fs
        return self._fs

    async def fetch(self, url: str, size: int, etag: str) -> bytes:
        """Return the object's bytes, checked against the listing's size and ETag.

        Raises:
            SourceNotFound: the object is gone (not retried).
            StaleVersionError: the object changed upstream since it was listed.
            CorruptObjectError: size or checksum mismatch on every attempt.
            RemoteFetchError: transient failures outlasted the retry budget.
        """
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._concurrency)
        fs = await self._filesystem()
        path = fs._strip_protocol(url)
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(random.uniform(0, delay))
            try:
                if self.budget is not None:
                    await self.budget.acquire(url)
                async with self._sem:
                    data = await asyncio.wait_for(
                        self._read(fs, path, size), self.timeout_s
                    )
                self._check(url, data, size, etag)
                return data
            except FileNotFoundError as exc:
                raise SourceNotFound(
                    f"object {url!r} no longer exists at the source. Re-list the dataset "
                    "(DistributedCachedDataset.refresh()) or restore the object."
                ) from exc
            except PermissionError as exc:
                raise RemoteFetchError(
                    f"permission denied reading {url!r}; check the store's "
                    f"credentials. {CREDENTIALS_HINT}"
                ) from exc
            except CorruptObjectError as exc:
                last = exc
                await self._raise_if_changed(fs, path, url, etag)
            except (OSError, TimeoutError) as exc:
                last = exc
                await self._note_throttle(url, exc)
            except Exception as exc:  # botocore/aiohttp errors that s3fs did not map
                if type(exc).__module__.split(".")[0] not in (
                    "botocore",
                    "aiobotocore",
                    "aiohttp",
                ):
                    raise
                if is_missing_credentials(exc):  # not the source's fault: no retry
                    raise no_credentials("reading", url, exc) from exc
                last = exc
                await self._note_throttle(url, exc)
                if "Checksum" in type(exc).__name__:
                    last = CorruptObjectError(
                        f"object {url!r} failed the transfer checksum ({exc}): corrupted or "
                        "truncated in transit. Not cached."
                    )
                    last.__cause__ = exc
        if isinstance(last, CorruptObjectError):
            raise last
        raise RemoteFetchError(
            f"reading {url!r} failed after {self.retries + 1} attempts: "
            f"{type(last).__name__}: {last}. The source may be throttling or down."
        ) from last

    async def _raise_if_changed(self, fs: Any, path: str, url: str, etag: str) -> None:
        """A mismatch is either corruption or a newer version: one HEAD tells which."""
        try:
            info = (
                await fs._info(path, refresh=True)
                if getattr(fs, "async_impl", False)
                else await asyncio.to_thread(fs.info, path)
            )
        except Exception:  # cannot tell; keep treating it as corruption
            return
        current = str(info.get("ETag") or info.get("etag") or "").strip('"')
        if current and current != etag:
            raise StaleVersionError(
                f"object {url!r} changed upstream since it was listed (ETag {etag} -> "
                f"{current}). Call DistributedCachedDataset.refresh() on every rank, "
                "or build a new dataset, to read the new version."
            )

    async def _note_throttle(self, url: str, exc: BaseException) -> None:
        # The ranged GETs' rule: what botocore parsed, on the error or the
        # ClientError s3fs chains to its OSError. Not the text: a dropped
        # connection names its URL, and a "503" in a key, bucket or port
        # would halve the rate of every store sharing the budget.
        if self.budget is not None and _is_throttle(exc):
            await self.budget.throttled(url)

    async def _read(self, fs: Any, path: str, size: int) -> bytes:
        if self.protocol in ("s3", "s3a") and size <= _SINGLE_GET_MAX_BYTES:
            # We know the size from the listing: skip s3fs's HEAD-then-ranged-GETs
            # path, so each object costs exactly one GET request.
            return await fs._cat_file(path, max_concurrency=1)
        if getattr(fs, "async_impl", False):
            return await fs._cat_file(path)
        return await asyncio.to_thread(fs.cat_file, path)

    def _check(self, url: str, data: bytes, size: int, etag: str) -> None:
        if len(data) != size:
            raise CorruptObjectError(
                f"object {url!r} read {len(data)} bytes but the listing said {size}: "
                "truncated, or changed upstream since listing. Not cached."
            )
        if self.verify_checksum and _MD5_ETAG.match(etag):
            digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
            if digest != etag:
                raise CorruptObjectError(
                    f"object {url!r} has MD5 {digest} but its ETag is {etag}: corrupted "
                    "in transit or changed upstream. Not cached."
                )


def _s3_answered(exc: BaseException, codes: tuple[str, ...], status: int) -> bool:
    """Whether S3 answered one of ``codes`` or HTTP ``status``: told by what
    botocore parsed, on ``exc`` or the errors it was raised from (s3fs wraps
    the ClientError in an OSError), never by text a key or offset may hold."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = str((response.get("Error") or {}).get("Code", ""))
            answered = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in codes or answered == status:
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_throttle(exc: BaseException) -> bool:
    """The source asked to slow down (503, SlowDown): the one rule for the
    per-object GETs (:class:`Fetcher`) and a packed file's ranged GETs. s3fs
    gives the ClientError only as the cause of the OSError it raises, whose
    text ("Please reduce your request rate.") holds no code.

    >>> from botocore.exceptions import ClientError
    >>> from s3fs.errors import translate_boto_error
    >>> answer = {"Error": {"Code": "SlowDown", "Message": "Please reduce your "
    ...           "request rate."}, "ResponseMetadata": {"HTTPStatusCode": 503}}
    >>> _is_throttle(translate_boto_error(ClientError(answer, "GetObject")))
    True
    >>> _is_throttle(OSError("cut at bytes 1503-2000"))
    False
    >>> _is_throttle(OSError('closed before a response from "http://h/b/part-00503"'))
    False
    """
    return _s3_answered(exc, _THROTTLE_CODES, 503)


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with touching or overlapping ones merged: one GET each.
    Ranges with a gap between them stay apart, so no byte outside them is read.

    >>> _coalesce([(10, 20), (0, 10), (30, 40), (35, 50)])
    [(0, 20), (30, 50)]
    """
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _stale(url: str, etag: str, now: str) -> StaleVersionError:
    return StaleVersionError(
        f"{url!r} was rewritten since it was listed (version {etag} -> {now}); "
        "its units are not read from two versions. Call "
        "DistributedCachedDataset.refresh() to list the new file."
    )


def _is_precondition_failed(exc: BaseException) -> bool:
    """Whether S3 answered 412 (the ``If-Match`` ETag is not the object's)."""
    return _s3_answered(exc, ("PreconditionFailed", "412"), 412)


class _ShortBody(OSError):
    """A GET answered fewer bytes than its range asked (a cut connection)."""


def _is_transient(exc: BaseException) -> bool:
    """Worth another GET: a dropped or cut connection, a timeout, a 5xx. Not
    a missing object, a denied one, a 412 (another version: final), or no
    credentials (botocore's ``NoCredentialsError``: asking again finds none)."""
    if isinstance(exc, FileNotFoundError | PermissionError):
        return False
    if is_missing_credentials(exc):
        return False
    if _is_precondition_failed(exc):
        return False
    if isinstance(exc, OSError | TimeoutError):
        return True
    return type(exc).__module__.split(".")[0] in _CLIENT_MODULES


async def _s3_ranges(
    fs: Any,
    path: str,
    ranges: list[tuple[int, int]],
    etag: str,
    url: str,
    budget: Any = None,
) -> list[bytes]:
    """One GET per range, each ``If-Match`` the listed ETag: S3 answers 412
    instead of bytes of another version, so a unit never mixes two, and
    the check costs no request (a HEAD per unit would). A GET whose body
    fails or comes short is sent again (``_RANGE_ATTEMPTS`` in all, with
    jittered backoff); when one range fails for good, its siblings still
    in flight are cancelled (a TaskGroup) rather than left running. Each
    GET, a retry too, takes a token of the source's ``budget`` (the one
    the LISTs and the per-object GETs take), and a 503 SlowDown halves it."""
    bucket, key, _ = fs.split_path(path)
    match = {"IfMatch": f'"{etag}"'} if etag and not etag.startswith("size-") else {}
    gate = asyncio.Semaphore(_RANGES_IN_FLIGHT)

    async def get(lo: int, hi: int) -> bytes:
        request = {"Bucket": bucket, "Key": key, "Range": f"bytes={lo}-{hi - 1}"}
        if budget is None:
            resp = await fs._call_s3("get_object", **request, **match)
        else:
            # One attempt per token: s3fs would send a SlowDown again
            # underneath (5 times), unseen by the budget. Its wrapper still
            # maps the error as _call_s3's does.
            from s3fs.core import _error_wrapper

            await fs.set_session()
            client = await fs.get_s3(bucket)
            kwargs = fs._get_s3_method_kwargs(client.get_object, **request, **match)
            resp = await _error_wrapper(client.get_object, kwargs=kwargs, retries=1)
        try:
            data = await resp["Body"].read()
        finally:
            resp["Body"].close()
        if len(data) != hi - lo:
            raise _ShortBody(f"{len(data)} of the {hi - lo} bytes at {lo}-{hi}")
        return data

    async def one(lo: int, hi: int) -> bytes:
        async with gate:
            failed = throttled = 0  # attempts that failed, and those throttled
            while True:
                if failed:
                    delay = min(_RANGE_BACKOFF_MAX_S, _RANGE_BACKOFF_S * 2**failed)
                    await asyncio.sleep(random.uniform(0, delay))
                if budget is not None:
                    await budget.acquire(url)
                try:
                    return await get(lo, hi)
                except Exception as exc:
                    failed += 1
                    if budget is not None and _is_throttle(exc):
                        throttled += 1
                        await budget.throttled(url)
                    limit = _THROTTLED_ATTEMPTS if throttled else _RANGE_ATTEMPTS
                    if failed >= limit or not _is_transient(exc):
                        raise

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(lo, hi)) for lo, hi in ranges]
    except BaseExceptionGroup as failed:
        # The first failure, as a plain exception: the caller maps it. Not
        # "from None", which would drop the ClientError s3fs chained to it.
        raise failed.exceptions[0]  # noqa: B904
    return [t.result() for t in tasks]


def _slices(
    ranges: list[tuple[int, int]],
    merged: list[tuple[int, int]],
    parts: list[bytes],
) -> dict[tuple[int, int], bytes]:
    """Each asked range cut out of the merged read holding it: one binary
    search each (merged ranges are sorted and apart), not a scan of all.

    >>> _slices([(2, 4), (0, 1), (3, 3)], [(0, 1), (2, 5)], [b"a", b"bcd"])
    {(3, 3): b'', (2, 4): b'bc', (0, 1): b'a'}
    """
    starts = [lo for lo, _ in merged]
    out: dict[tuple[int, int], bytes] = {r: b"" for r in ranges if r[1] <= r[0]}
    for a, b in ranges:
        if (a, b) in out:
            continue
        j = bisect.bisect_right(starts, a) - 1
        lo, hi = merged[j]
        assert lo <= a and b <= hi, "every asked range lies in one merged read"
        out[(a, b)] = bytes(memoryview(parts[j])[a - lo : b - lo])
    return out


def read_ranges(
    fs: Any,
    path: str,
    ranges: list[tuple[int, int]],
    *,
    url: str,
    etag: str,
    size: int,
    budget: Any = None,
) -> dict[tuple[int, int], bytes]:
    """The bytes of each ``[lo, hi)`` of one file, at the version listed.

    Touching ranges are read with one GET; nothing else of the file is read
    (no read-ahead, no block cache). Each GET from a remote source takes a
    token of its request ``budget`` (``source_rps``; ``None``: no budget;
    local files never do). On S3 every GET carries ``If-Match`` with the
    listed ETag; elsewhere the file's version is compared after the reads
    (one ``info`` call), so either way the bytes returned all come from
    the listed version.

    Raises:
        SourceFormatError: a range ends past the listed size (the layout the
            listing kept does not fit the file).
        StaleVersionError: the file was rewritten since the listing.
        SourceNotFound: the file is gone.
        RemoteFetchError: the store failed the reads, or sent fewer bytes
            than asked, on every attempt.

    >>> import fsspec
    >>> fs = fsspec.filesystem("memory")
    >>> fs.pipe("/doc/f.bin", bytes(range(10)))
    >>> etag = _version_of(fs, fs.info("/doc/f.bin"))
    >>> read_ranges(fs, "/doc/f.bin", [(2, 4), (4, 5)], url="memory://doc/f.bin",
    ...             etag=etag, size=10)
    {(2, 4): b'\\x02\\x03', (4, 5): b'\\x04'}
    """
    past = [(lo, hi) for lo, hi in ranges if hi > lo and (lo < 0 or hi > size)]
    if past:
        raise SourceFormatError(
            f"{url!r}: the listing's layout asks for bytes {past[0][0]}-{past[0][1]} "
            f"of a {size}-byte file (version {etag}); the layout does not fit the "
            "file. Call DistributedCachedDataset.refresh() to list it again, or "
            "report the file if it persists."
        )
    merged = _coalesce([(lo, hi) for lo, hi in ranges if hi > lo])
    try:
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        if set(protocols) & set(_S3_PROTOCOLS):
            from fsspec.asyn import sync

            parts = sync(fs.loop, _s3_ranges, fs, path, merged, etag, url, budget)
        else:
            local = set(protocols) & {"file", "local"}  # not a source to pace
            for _ in merged if budget is not None and not local else ():
                budget.acquire_blocking(url)
            parts = fs.cat_ranges(
                [path] * len(merged), [lo for lo, _ in merged], [hi for _, hi in merged]
            )
            info = fs.info(path)
            now = _version_of(fs, info)
            if now != etag or int(info.get("size") or 0) != size:
                raise _stale(url, etag, now)
    except FileNotFoundError as exc:
        raise SourceNotFound(
            f"{url!r} no longer exists at the source. Call refresh() or restore it."
        ) from exc
    except PermissionError as exc:
        raise RemoteFetchError(
            f"permission denied reading {url!r}; check the store's credentials. "
            f"{CREDENTIALS_HINT}"
        ) from exc
    except Exception as exc:
        if _is_precondition_failed(exc):
            raise _stale(url, etag, "a newer one") from exc
        if is_missing_credentials(exc):
            raise no_credentials("reading", url, exc) from exc
        if not isinstance(exc, OSError | TimeoutError) and (
            type(exc).__module__.split(".")[0] not in _CLIENT_MODULES
        ):
            raise
        raise RemoteFetchError(
            f"reading {url!r} failed after {_RANGE_ATTEMPTS} attempts: "
            f"{type(exc).__name__}: {exc}. The source may be throttling or down."
        ) from exc
    for (lo, hi), data in zip(merged, parts, strict=True):
        if isinstance(data, BaseException):
            raise RemoteFetchError(f"reading {url!r} failed: {data}") from data
        if len(data) != hi - lo:
            raise RemoteFetchError(
                f"reading {url!r} returned {len(data)} of the {hi - lo} bytes at "
                f"{lo}-{hi}: the store cut the read short. Retry the build."
            )
    return _slices(ranges, merged, parts)

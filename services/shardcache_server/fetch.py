"""Read one remote object through fsspec's async API, with retries and checks."""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
from typing import Any

import fsspec

from shardcache.errors import (
    CorruptObjectError,
    RemoteFetchError,
    SourceNotFound,
    StaleVersionError,
)
from shardcache.source import open_remote

__all__ = ["Fetcher"]

_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
_THROTTLE_SIGNS = ("SlowDown", "reduce your request rate", "503")  # as s3fs matches
_SINGLE_GET_MAX_BYTES = 32 * 2**20  # larger objects use s3fs's concurrent ranged GETs


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
                    # One retry policy, ours: backoff with jitter that also feeds
                    # the shared request budget. s3fs and botocore would otherwise
                    # retry SlowDown silently underneath (5 x 3 attempts).
                    config = dict(options.get("config_kwargs") or {})
                    config.setdefault(
                        "retries", {"total_max_attempts": 1, "mode": "standard"}
                    )
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
                    f"permission denied reading {url!r}; check the store's credentials."
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
        text = str(exc)
        if self.budget is not None and any(p in text for p in _THROTTLE_SIGNS):
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

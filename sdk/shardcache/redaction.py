"""Keep secrets out of messages and logs."""

from __future__ import annotations

import re

__all__ = ["redact_url"]

_USERINFO = re.compile(
    r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:@/]*):[^@/]*@"
)


# redis-py also takes the password as a query parameter (``?password=``), and
# other URLs carry tokens and keys there.
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&](?:pass(?:word|wd)?|pwd|[A-Za-z_]*token|[A-Za-z_]*secret"
    r"[A-Za-z_]*|[A-Za-z_]*_key)=)[^&#]*",
    re.IGNORECASE,
)


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (never raises).

    >>> redact_url("redis://:s3cret@10.0.0.1:6379/0")
    'redis://:***@10.0.0.1:6379/0'
    >>> redact_url("rediss://app:pw@host:bad/0")
    'rediss://app:***@host:bad/0'
    >>> redact_url("redis://127.0.0.1:6379")
    'redis://127.0.0.1:6379'
    >>> redact_url("redis://127.0.0.1:1/0?password=s3cret&socket_timeout=5")
    'redis://127.0.0.1:1/0?password=***&socket_timeout=5'
    >>> redact_url("redis://h/0?db=1&PASSWORD=s3cret#x")
    'redis://h/0?db=1&PASSWORD=***#x'
    """
    text = _USERINFO.sub(r"\g<scheme>\g<user>:***@", str(url), count=1)
    return _SECRET_PARAM.sub(r"\g<name>***", text)

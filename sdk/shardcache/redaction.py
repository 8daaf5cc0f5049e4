"""Keep secrets out of messages and logs."""

from __future__ import annotations

import re

__all__ = ["redact_url"]

_USERINFO = re.compile(
    r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:@/]*):[^@/]*@"
)


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (never raises).

    >>> redact_url("redis://:s3cret@10.0.0.1:6379/0")
    'redis://:***@10.0.0.1:6379/0'
    >>> redact_url("rediss://app:pw@host:bad/0")
    'rediss://app:***@host:bad/0'
    >>> redact_url("redis://127.0.0.1:6379")
    'redis://127.0.0.1:6379'
    """
    return _USERINFO.sub(r"\g<scheme>\g<user>:***@", str(url), count=1)

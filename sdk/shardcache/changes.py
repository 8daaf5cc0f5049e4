"""What changed between two listings of one source, in words a user can act on.

Used where a saved position cannot be applied to today's listing (a resume
across jobs after objects changed): the error names the objects, not a digest.
"""

from __future__ import annotations

from typing import Any

from shardcache.packed_manifest import PackedManifest

__all__ = ["describe_changes"]

NAMED = 5  # objects named in a message; the rest are counted


def describe_changes(old: Any, new: Any) -> str:
    """``"3 objects changed: s3://b/a.npy, ..."``, added and removed objects
    apart (a README trial read "1 object changed" for an object added).

    >>> from shardcache.manifest import Manifest
    >>> a = Manifest.from_entries("s3", ["s3://b/0", "s3://b/1"], [1, 1], ["e0", "e1"])
    >>> b = Manifest.from_entries("s3", ["s3://b/0", "s3://b/1"], [1, 1], ["e0", "e2"])
    >>> describe_changes(a, b)
    '1 object changed: s3://b/1'
    >>> c = Manifest.from_entries("s3", ["s3://b/1", "s3://b/2"], [1, 1], ["e2", "e3"])
    >>> describe_changes(a, c)
    '1 object added: s3://b/2; 1 object removed: s3://b/0; 1 object changed: s3://b/1'
    >>> d = Manifest.from_entries("s3", ["s3://b/0", "s3://b/1"], [1, 2], ["e0", "e1"])
    >>> describe_changes(a, d)  # the same version, another size
    '1 object changed: s3://b/1'
    """
    if isinstance(old, PackedManifest) and isinstance(new, PackedManifest):
        return _named(new.changed_files(old), "changed")
    # (version, size): a local file rewritten to another size with its mtime
    # kept changes the listing by its size alone.
    before = {old.url(i): (old.etag(i), old.size(i)) for i in range(len(old))}
    now = {new.url(i): (new.etag(i), new.size(i)) for i in range(len(new))}
    kinds = (
        (sorted(now.keys() - before.keys()), "added"),
        (sorted(before.keys() - now.keys()), "removed"),
        (
            sorted(u for u in before.keys() & now.keys() if before[u] != now[u]),
            "changed",
        ),
    )
    said = [_named(urls, how) for urls, how in kinds if urls]
    return "; ".join(said) or _named([], "changed")


def _named(urls: list[str], how: str) -> str:
    shown = ", ".join(urls[:NAMED]) + (
        f" and {len(urls) - NAMED} more" if len(urls) > NAMED else ""
    )
    return f"{len(urls)} object{'s' if len(urls) != 1 else ''} {how}: {shown}"

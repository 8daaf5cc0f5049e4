"""ListObjectsV2 pages read without botocore's walk of every key.

botocore turns each ``<Contents>`` element into a dict through its shape
model: ~64 us per key on this project's 2-core machine after timestamps
were left unparsed (BENCHMARKS.md, "Listing"), so a 1 M-object listing
costs a minute of CPU before the first batch. A listing needs three fields
of each object (key, size, ETag), so the listing's own client takes them
out of the page's bytes itself (one regular expression), and
hands botocore the page without its ``<Contents>`` elements (the token,
``IsTruncated`` and ``CommonPrefixes`` still parsed by botocore, errors
untouched).

Only what this module can read exactly is taken: a page with an element it
does not expect in an object (no key or no size, a count that does not add
up) is left to botocore whole, so a store that writes its XML differently
costs time, never a wrong key.
"""

from __future__ import annotations

import html
import re
from typing import Any
from urllib.parse import unquote_plus

__all__ = ["fast_pages", "page_objects"]

OBJECTS = "ShardcacheObjects"  # where a page's objects go instead of "Contents"

_OPEN, _CLOSE = "<Contents>", "</Contents>"
# One object as S3 (and moto, MinIO...) writes it: Key, then the elements S3
# documents, in its order, with or without whitespace between them, and the
# whitespace after it. Only the key, ETag and size are kept; Owner and
# RestoreStatus hold elements of their own. The ETag's quotes (S3 writes
# them as &quot;) are left outside its group, so the common page needs no
# entity decoding at all; an ETag with any other entity does not match and
# its page goes to botocore. The outer group is the whole match, whose
# lengths prove the matches cover the page's objects without a gap.
_OBJECT = re.compile(
    r"(<Contents>\s*<Key>([^<]*)</Key>\s*"
    r"(?:<LastModified>[^<]*</LastModified>\s*)?"
    r'(?:<ETag>(?:&quot;|")?([^<&"]*)(?:&quot;|")?</ETag>\s*)?'
    r"(?:<Checksum(?:Algorithm|Type)>[^<]*</Checksum(?:Algorithm|Type)>\s*)*"
    r"<Size>\s*(\d+)\s*</Size>\s*"
    r"(?:<(StorageClass|Owner|RestoreStatus)>.*?</\5>\s*)*"
    r"</Contents>\s*)",
    re.S,
)


def _take_objects(
    response_dict: dict[str, Any], customized_response_dict: dict[str, Any], **_: Any
) -> None:
    """``before-parse`` handler: move a 200 page's objects out of its XML.

    One pass of one regular expression over the page, decoded once (~4 us
    per key with the tuples built; a lazy ``<Contents>(.*?)</Contents>`` and
    a search per field cost ~18). The page is taken only if its objects are
    one run of elements that all match, which is how S3 writes them;
    anything else goes to botocore.
    """
    body = response_dict.get("body")
    if response_dict.get("status_code") != 200 or not isinstance(body, bytes):
        return
    try:
        page = body.decode()
    except UnicodeDecodeError:
        return  # not XML this reader can vouch for: botocore's to judge
    first, last = page.find(_OPEN), page.rfind(_CLOSE)
    if first < 0:
        return  # no objects: nothing to take
    end = last + len(_CLOSE)
    found = _OBJECT.findall(page, first, end)
    if len(found) != page.count(_OPEN) or sum(len(f[0]) for f in found) != end - first:
        return  # another layout (or markup in a key): botocore parses the page
    customized_response_dict[OBJECTS] = [
        (html.unescape(key) if "&" in key else key, int(size), tag)
        for _whole, key, tag, size, _rest in found
    ]
    response_dict["body"] = (page[:first] + page[end:]).encode()


def fast_pages(client: Any) -> None:
    """Read this client's ListObjectsV2 pages with :func:`_take_objects`.

    botocore's own first ``before-parse`` handler for S3 (a 200 answer may
    carry an error) parses every page whole as XML only to look at its root:
    ~9 ms of a 1,000-key page, as much as the rest of this reader. On this
    client only (botocore gives each client its own copy of the events) it
    runs after the objects are taken out, on what is left of the page, which
    keeps its root element and so its answer.
    """
    from botocore import handlers

    events = client.meta.events
    check = getattr(handlers, "_handle_200_error", None)
    if check is not None:
        events.unregister("before-parse.s3.*", check)

    def before_parse(operation_model: Any, **kwargs: Any) -> None:
        if operation_model.name == "ListObjectsV2":
            _take_objects(**kwargs)
        if check is not None:
            check(operation_model=operation_model, **kwargs)

    events.register_first("before-parse.s3.*", before_parse)


def _unquote(key: str) -> str:
    """A key as S3 sends it with ``EncodingType=url`` (botocore asks for that
    and decodes the ``Contents`` it parsed itself, as this does; these it did
    not see)."""
    return unquote_plus(key) if "%" in key or "+" in key else key


def page_objects(page: dict[str, Any]) -> list[tuple[str, int, str]]:
    """``(key, size, ETag)`` of every object of a parsed page, either way it was
    read. The ETag loses its quotes; it is ``""`` where the store sent none.

    >>> page_objects({"Contents": [{"Key": "a b", "Size": 3, "ETag": '"e1"'}]})
    [('a b', 3, 'e1')]
    >>> page_objects({OBJECTS: [("a+b%C3%A9", 3, "e1")], "EncodingType": "url"})
    [('a bé', 3, 'e1')]
    """
    if OBJECTS in page:
        objects = page[OBJECTS]
        if page.get("EncodingType") == "url":
            return [(_unquote(k), size, tag) for k, size, tag in objects]
        return objects
    return [
        (o["Key"], int(o["Size"]), str(o.get("ETag", "")).strip('"'))
        for o in page.get("Contents", ())
    ]

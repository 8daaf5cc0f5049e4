"""ListObjectsV2 pages read without botocore's per-key walk: the same objects
botocore reads from the emulator's real pages, and botocore's own parse of
anything this reader does not model."""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any
from urllib.parse import unquote_plus, urlencode

import pytest

from shardcache_server import list_pages
from shardcache_server.list_pages import OBJECTS, page_objects
from shardcache_server.objects import list_source

# XML's five escapes, URL escapes, unicode, a long key
NAMES = ["a&b<c>d\"e'f.bin", "x y+z%41.bin", "ünï/☃.bin", "k" * 900 + ".bin", "n/1"]


def _raw_page(s3: Any, bucket: str, prefix: str, encoding: bool) -> bytes:
    query = {"list-type": "2", "prefix": prefix}
    if encoding:
        query["encoding-type"] = "url"
    with urllib.request.urlopen(f"{s3.endpoint_url}/{bucket}?{urlencode(query)}") as r:
        return r.read()


def _botocore(body: bytes) -> dict[str, Any]:
    import botocore.session
    from botocore.parsers import RestXMLParser

    model = botocore.session.get_session().get_service_model("s3")
    shape = model.operation_model("ListObjectsV2").output_shape
    return RestXMLParser().parse(
        {"body": body, "headers": {}, "status_code": 200}, shape
    )


def _take(body: bytes) -> tuple[dict[str, Any], bytes]:
    """What the reader takes out of a 200 page, and the page it leaves."""
    response = {"body": body, "headers": {}, "status_code": 200}
    taken: dict[str, Any] = {}
    list_pages._take_objects(response, taken)
    return taken, response["body"]


@pytest.mark.parametrize("encoding", [False, True], ids=["xml-escaped", "url-encoded"])
def test_real_pages_read_the_same_objects_as_botocore(
    s3, s3fs_client, bucket, encoding
):
    s3fs_client.pipe({f"{bucket}/p/{n}": b"x" * (i + 1) for i, n in enumerate(NAMES)})
    body = _raw_page(s3, bucket, "p/", encoding)
    whole = _botocore(body)
    if encoding:  # what botocore's after-call handler does to the keys it parsed
        for obj in whole["Contents"]:
            obj["Key"] = unquote_plus(obj["Key"])
    taken, left = _take(body)
    assert len(taken[OBJECTS]) == len(NAMES)
    rest = _botocore(left)
    assert "Contents" not in rest and rest["KeyCount"] == whole["KeyCount"]
    rest.update(taken)
    assert page_objects(rest) == page_objects(whole)
    assert sorted(k for k, _, _ in page_objects(rest)) == sorted(
        f"p/{n}" for n in NAMES
    )


def test_every_page_of_a_listing_is_read_by_the_fast_reader(
    s3, s3fs_client, bucket, monkeypatch
):
    # 2,500 keys over 3 pages and a sub-prefix: each page's objects came out of
    # its bytes (none left to botocore), and the manifest is what s3fs sees.
    s3fs_client.pipe(
        {f"{bucket}/f/{i:05d} é.bin": b"x" * (i % 7 + 1) for i in range(2500)}
    )
    s3fs_client.pipe({f"{bucket}/f/sub/{n}": b"yy" for n in NAMES})
    pages: list[int] = []
    take = list_pages._take_objects

    def spy(
        response_dict: dict[str, Any], customized_response_dict: dict[str, Any], **kw
    ):
        take(response_dict, customized_response_dict, **kw)
        pages.append(len(customized_response_dict.get(OBJECTS, [-1])))

    monkeypatch.setattr(list_pages, "_take_objects", spy)
    manifest = list_source(f"s3://{bucket}/f/", s3.storage_options())
    assert -1 not in pages and sum(pages) == 2500 + len(NAMES)
    found = s3fs_client.find(f"{bucket}/f/", detail=True)
    assert [manifest.url(i) for i in range(len(manifest))] == [
        f"s3://{p}" for p in sorted(found)
    ]
    assert [manifest.etag(i) for i in range(len(manifest))] == [
        found[p]["ETag"].strip('"') for p in sorted(found)
    ]
    assert [manifest.size(i) for i in range(len(manifest))] == [
        found[p]["size"] for p in sorted(found)
    ]


def test_a_page_it_does_not_model_is_left_to_botocore_whole():
    # CDATA in a key: valid XML that this reader does not decode, so the page
    # goes to botocore untouched (no real store is known to write it).
    body = (
        b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
        b"<Contents><Key><![CDATA[a<b.bin]]></Key><ETag>&quot;e&quot;</ETag>"
        b"<Size>3</Size></Contents><IsTruncated>false</IsTruncated></ListBucketResult>"
    )
    taken, rest = _take(body)
    assert taken == {} and rest is body
    assert page_objects(_botocore(body)) == [("a<b.bin", 3, "e")]


@pytest.mark.parametrize(
    "between, etag",
    [
        (b"<Marker>x</Marker>", b"&quot;e&quot;"),  # an element between two objects
        (b"", b"&quot;e&amp;f&quot;"),  # an ETag with an entity besides its quotes
    ],
)
def test_a_page_with_more_than_its_objects_is_left_to_botocore(between, etag):
    # Every object matches alone, yet the page holds something the reader does
    # not take: the matches must cover the objects' run without a gap.
    body = (
        b"<ListBucketResult><Contents><Key>a</Key><ETag>&quot;e&quot;</ETag>"
        b"<Size>1</Size></Contents>"
        + between
        + b"<Contents><Key>b</Key><ETag>"
        + etag
        + b"</ETag><Size>2</Size></Contents></ListBucketResult>"
    )
    taken, rest = _take(body)
    assert taken == {} and rest is body


def test_a_page_in_s3s_layout_is_taken_with_whitespace_and_entities():
    body = (
        b"<ListBucketResult>\n  <Contents>\n    <Key>a &amp; b</Key>\n"
        b"    <ETag>&quot;e1&quot;</ETag>\n    <Size>3</Size>\n"
        b"    <StorageClass>STANDARD</StorageClass>\n  </Contents>\n"
        b'  <Contents><Key>c\xc3\xa9</Key><ETag>"e2"</ETag><Size>4</Size></Contents>\n'
        b"<IsTruncated>false</IsTruncated></ListBucketResult>"
    )
    taken, rest = _take(body)
    assert taken[OBJECTS] == [("a & b", 3, "e1"), ("cé", 4, "e2")]
    assert b"<Contents>" not in rest and b"IsTruncated" in rest


@pytest.mark.parametrize("operation", ["ListObjectsV2", "HeadObject"])
def test_the_listing_client_still_turns_a_200_error_page_into_a_retry(s3, operation):
    # S3 may answer 200 with an <Error> body; botocore's check (run after the
    # objects are taken, on this client only) must still see it, and other
    # operations keep their own handling.
    import s3fs

    from shardcache_server.list_pages import fast_pages

    async def emit() -> tuple[dict[str, Any], dict[str, Any]]:
        fs = s3fs.S3FileSystem(
            asynchronous=True, skip_instance_cache=True, **s3.storage_options()
        )
        client = await fs.set_session()
        fast_pages(client)
        model = client.meta.service_model.operation_model(operation)
        error = {
            "status_code": 200,
            "headers": {},
            "body": b"<Error><Code>SlowDown</Code></Error>",
        }
        page = {"status_code": 200, "headers": {}, "body": _PAGE}
        taken: dict[str, Any] = {}
        for response, custom in ((error, {}), (page, taken)):
            await client.meta.events.emit(
                f"before-parse.s3.{operation}",
                operation_model=model,
                response_dict=response,
                customized_response_dict=custom,
            )
        await fs._s3creator.__aexit__(None, None, None)
        return error, taken

    error, taken = asyncio.run(emit())
    assert error["status_code"] == 500
    assert (OBJECTS in taken) == (operation == "ListObjectsV2")


_PAGE = (
    b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><IsTruncated>false'
    b"</IsTruncated><Contents><Key>a</Key><ETag>&quot;e&quot;</ETag><Size>1</Size>"
    b"</Contents></ListBucketResult>"
)

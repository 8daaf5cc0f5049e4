from __future__ import annotations

import json
import uuid

import pytest

from shardcache import keys
from shardcache.errors import ConfigError, IndexUnavailable
from shardcache.index import RedisIndex, connect_redis


@pytest.fixture
def index(redis_url):
    return RedisIndex.from_url(redis_url, f"t{uuid.uuid4().hex[:8]}")


def test_index_register_new_fingerprint_starts_new_generation(index):
    assert index.register("ds", "s3://b/", "fp1", 3, 30) == 1
    assert index.register("ds", "s3://b/", "fp1", 3, 30) == 1
    assert index.register("ds", "s3://b/", "fp2", 3, 30) == 2
    record = index.dataset("ds")
    assert (
        record.fingerprint == "fp2" and record.generation == 2 and record.invalidated_at
    )
    assert index.events()[0]["reason"] == "preprocess fingerprint changed"


def test_index_skips_malformed_entries_written_by_others(index, redis):
    redis.hset(
        keys.entries_key(index.ns, "ds", 1),
        mapping={"good": json.dumps({"etag": "e"}), "bad": "{not json", "list": "[1]"},
    )
    assert index.entries("ds", 1) == {"good": {"etag": "e"}}


def test_connect_redis_wrong_password_is_index_unavailable_without_secret(redis_url):
    bad = redis_url.replace("://:", "://:wrong-pass-", 1)
    with pytest.raises(IndexUnavailable, match="password|credentials") as info:
        connect_redis(bad)
    assert "wrong-pass" not in str(info.value)


def test_connect_redis_no_password_is_index_unavailable(redis_url):
    no_pass = "redis://" + redis_url.split("@", 1)[1]
    with pytest.raises(IndexUnavailable, match="password"):
        connect_redis(no_pass)


def test_connect_redis_unreachable_names_url_and_fix():
    with pytest.raises(IndexUnavailable, match="SHARDCACHE_REDIS_URL"):
        connect_redis("redis://:pw@127.0.0.1:1/0", timeout_s=0.5)


@pytest.mark.parametrize("where", ["unreachable", "wrong"])
def test_a_password_given_as_a_query_parameter_is_never_shown(where, redis_url):
    # redis-py takes ?password= as well as redis://:PASSWORD@.
    host = "127.0.0.1:1/0" if where == "unreachable" else redis_url.split("@", 1)[1]
    with pytest.raises(IndexUnavailable) as info:
        connect_redis(f"redis://{host}?password=s3cretPW-query", timeout_s=0.5)
    assert "s3cretPW" not in str(info.value) and "password=***" in str(info.value)


def test_connect_redis_bad_url_is_config_error():
    with pytest.raises(ConfigError):
        connect_redis("redis://:pw@127.0.0.1:notaport/0")


def test_validate_name_refuses_key_injection():
    with pytest.raises(ConfigError):
        keys.validate_name("namespace", "a:b*")

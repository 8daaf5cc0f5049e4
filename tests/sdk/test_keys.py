"""Chunk keys: one form written and read everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from shardcache.errors import ConfigError
from shardcache.keys import (
    chunk_key,
    is_variant_key,
    parse_chunk_key,
    parse_variant_key,
)


def test_keys_chunk_key_round_trips_python_and_numpy_ints():
    for chunk in (0, 7, 10**9, np.int64(41), np.intp(3)):
        key = chunk_key(chunk)
        assert key == f"c{int(chunk)}" and parse_chunk_key(key) == int(chunk)


@pytest.mark.parametrize("bad", ["c", "7", "x7", "c-1", "c7a", "c\u00b2", "C7", 7, None])
def test_keys_parse_chunk_key_refuses_what_chunk_key_never_writes(bad):
    with pytest.raises(ConfigError, match="chunk key") as err:
        parse_chunk_key(bad)
    assert repr(bad) in str(err.value)


def test_keys_variant_keys_round_trip_and_never_pass_for_a_base_chunk():
    assert chunk_key(7, 0) == "c7.v0" and chunk_key(7) == "c7"
    assert parse_variant_key("c7.v3") == (7, 3)
    assert parse_variant_key("c7") == (7, None)
    assert is_variant_key("c7.v3") and not is_variant_key("c7")
    # Code that reads base chunks (claims, disk files, builds) refuses a variant.
    with pytest.raises(ConfigError, match="c7.v3"):
        parse_chunk_key("c7.v3")
    with pytest.raises(ConfigError, match="c<n>.v<k>"):
        parse_variant_key("c7.vx")

"""Chunk keys: one form written and read everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from shardcache.errors import ConfigError
from shardcache.keys import chunk_key, parse_chunk_key


def test_keys_chunk_key_round_trips_python_and_numpy_ints():
    for chunk in (0, 7, 10**9, np.int64(41), np.intp(3)):
        key = chunk_key(chunk)
        assert key == f"c{int(chunk)}" and parse_chunk_key(key) == int(chunk)


@pytest.mark.parametrize("bad", ["c", "7", "x7", "c-1", "c7a", "c\u00b2", "C7", 7, None])
def test_keys_parse_chunk_key_refuses_what_chunk_key_never_writes(bad):
    with pytest.raises(ConfigError, match="chunk key") as err:
        parse_chunk_key(bad)
    assert repr(bad) in str(err.value)

from __future__ import annotations

import pytest

from shardcache.errors import ConfigError
from shardcache_server.eviction import make_policy


def test_lru_evicts_least_recently_used():
    p = make_policy("lru", 30)
    for k in "abc":
        assert p.admit(k, 10) == (True, [])
    p.touch("a")
    assert p.admit("d", 10) == (True, ["b"])
    assert p.used_bytes == 30 and "a" in p and "b" not in p


def test_static_keeps_first_entries_and_refuses_rest():
    p = make_policy("static", 20)
    assert p.admit("a", 10)[0] and p.admit("b", 10)[0]
    assert p.admit("c", 10) == (False, [])
    assert "a" in p and "c" not in p


@pytest.mark.parametrize("name", ["lru", "static"])
def test_policy_refuses_object_larger_than_budget(name):
    assert make_policy(name, 10).admit("big", 11) == (False, [])


def test_make_policy_unknown_lists_choices():
    with pytest.raises(ConfigError, match="lru, static"):
        make_policy("fifo", 10)

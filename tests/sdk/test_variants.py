"""The pure parts of augmented variants: keys, generators, the variant of an
epoch, validation and versions (``shardcache.variants``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shardcache import DistributedCachedDataset
from shardcache.errors import ConfigError
from shardcache.sampler import ShardSampler
from shardcache.variants import (
    VariantSpec,
    base_item,
    variant_of_epoch,
    variant_rng,
    version_fingerprint,
)


def _flip(x, rng):
    return x[::-1].copy() if rng.random() < 0.5 else x


def _jitter(x, rng):
    return (x * rng.uniform(0.5, 1.5)).astype(x.dtype)


def test_variant_rng_is_a_pure_function_of_seed_variant_and_index():
    draws = {
        (s, v, i): variant_rng(s, v, i).random(4).tobytes()
        for s in (0, 1)
        for v in range(3)
        for i in (0, 1, 1000)
    }
    assert len(set(draws.values())) == len(draws)  # all distinct
    assert variant_rng(1, 2, 1000).random(4).tobytes() == draws[(1, 2, 1000)]
    assert variant_rng(-3, 0, 0).random() == variant_rng(-3, 0, 0).random()


def test_variant_of_epoch_cycles_through_k_views_offset_by_the_seed():
    for seed in (0, 1, 5):
        views = [variant_of_epoch(e, seed, 4) for e in range(8)]
        assert sorted(views[:4]) == [0, 1, 2, 3]  # K epochs see K views
        assert views[4:] == views[:4]  # then they repeat
        assert views[0] == seed % 4


def test_a_resumed_epoch_reads_the_variant_of_the_saved_epoch():
    spec = VariantSpec.validate(_flip, 4, seed=3)
    assert spec is not None
    saved = ShardSampler(np.array([4, 4]), 0, 1, seed=3)
    saved.set_epoch(2)
    resumed = ShardSampler(np.array([4, 4]), 0, 1, seed=3)
    resumed.load_state_dict({**saved.state(), "yielded": 2})
    assert spec.of_epoch(resumed.epoch) == spec.of_epoch(saved.epoch) == (2 + 3) % 4


@pytest.mark.parametrize(
    ("augment", "variants", "match"),
    [
        (_flip, 0, "variants must be an integer >= 1"),
        (_flip, "4", "variants must be an integer >= 1"),
        (_flip, True, "variants must be an integer >= 1"),
        (None, 4, "variants=4 needs augment=fn"),
        (_flip, 1, "augment= needs variants=K with K >= 2"),
        ("flip", 4, "augment must be callable"),
    ],
)
def test_variant_spec_names_the_argument_and_the_fix(augment, variants, match):
    with pytest.raises(ConfigError, match=match):
        VariantSpec.validate(augment, variants, 0)


def test_an_augment_that_cannot_travel_is_refused_at_construction():
    lock = threading.Lock()

    def locked(x, rng):
        with lock:
            return x

    with pytest.raises(ConfigError, match="augment cannot be pickled.*'lock'"):
        VariantSpec.validate(locked, 4, 0)
    # As the user meets it: before any listing or I/O.
    with pytest.raises(ConfigError, match="variants=4 needs augment"):
        DistributedCachedDataset("s3://no-such-bucket/x/", variants=4)


def test_no_variants_asked_is_none():
    assert VariantSpec.validate(None, 1, 0) is None


def test_variant_versions_change_with_augment_and_seed_not_with_k():
    four = VariantSpec.validate(_flip, 4, 0)
    eight = VariantSpec.validate(_flip, 8, 0)
    other_seed = VariantSpec.validate(_flip, 4, 1)
    other_fn = VariantSpec.validate(_jitter, 4, 0)
    assert four and eight and other_seed and other_fn
    # Variant v is the same view whatever K is: raising K keeps the built ones.
    assert four.fingerprint == eight.fingerprint
    assert len({four.fingerprint, other_seed.fingerprint, other_fn.fingerprint}) == 3
    item = ("c3", "12345", 99)
    asked = four.item(item, 2)
    assert asked[0] == "c3.v2" and asked[2] == 99
    assert version_fingerprint(asked[1]) == four.fingerprint
    assert base_item(asked) == item and base_item(item) == item
    assert other_fn.item(item, 2)[1] != asked[1]  # a new augment: a new version


def test_variant_spec_survives_the_trip_to_the_stores():
    spec = VariantSpec.validate(_jitter, 3, 7)
    assert spec is not None
    assert VariantSpec.from_install(spec.install()) == spec
    assert VariantSpec.from_install(None) is None


def test_an_augment_the_fingerprint_cannot_see_into_is_named_once(caplog):
    handle = object()  # a repr with only an address, and no state

    def opaque(x, rng):
        return x if handle else x

    with caplog.at_level("WARNING", logger="shardcache"):
        VariantSpec.validate(opaque, 4, 0)
    assert "augment" in caplog.text and "change seed=" in caplog.text

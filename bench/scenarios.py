"""Which systems and scenarios the benchmark runs, and each run's settings.

A *system* is a loader users would pick (plain PyTorch, a Manager dict,
fsspec simplecache, Ray Data, LitData, Mosaic, shardcache); a *scenario* is
shardcache under a condition (a cache of half the data, 1% changed upstream).
:func:`run_config` turns one (rep, source, dataset, system, layout) into the
dict every rank of that run reads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from samples import VALUE_BYTES

SYSTEMS = (
    "plain",
    "manager_dict",
    "simplecache",
    "ray_data",
    "litdata",
    "mosaic",
    "shardcache",
    "shardcache_tar",
)
QUICK_SYSTEMS = ("plain", "ray_data", "shardcache")
# Caching a local file on local disk measures nothing.
REMOTE_ONLY = ("simplecache",)
# shardcache under a cache holding half the dataset, and with 1% changed
# upstream; run on the s3 source, where GETs are counted.
SCENARIOS = (
    "shardcache_lru50",
    "shardcache_static50",
    "shardcache_clairvoyant50",
    "shardcache_changed1",
)
HALF_CACHE = {  # scenario -> eviction policy, each at half of the node's share
    "shardcache_lru50": "lru",
    "shardcache_static50": "static",
    "shardcache_clairvoyant50": "clairvoyant",
}
# A real dataset is thousands of chunks; at the default 4,096 samples the 20,000
# blobs are 5, and a half-share budget would hold one. The half-cache scenarios
# cut the data in smaller chunks (~30-40 per node) so a policy has choices,
# and shuffle in blocks of about two chunks (shuffle_block): with the whole
# shard shuffled, every batch touches most of a rank's chunks and a cache of
# half of them rebuilds chunks in every batch whatever the policy (measured:
# 21 GETs per object by the second epoch of lru50 on the images).
HALF_CACHE_CHUNK_SAMPLES = {"blobs": 256, "images": 64}
HALF_CACHE_SHUFFLE_BLOCK = {"blobs": 512, "images": 128}
# The same datasets as WebDataset tar shards, read in place by format="tar".
PACKED = {"shardcache_tar": "tar"}
RAY_SYSTEMS = ("ray_data", "shardcache", *PACKED, *SCENARIOS)
DATASETS = ("images", "blobs")


def run_config(
    args: argparse.Namespace,
    rep: int,
    source: str,
    dataset: str,
    system: str,
    rpn: int,
    tmp: str,
    redis_url: str,
    emulator: Any,
    fs: Any,
    local_root: Path,
) -> dict[str, Any] | None:
    """One system run's settings, or None when it does not apply to this source."""
    if source == "local" and (system in REMOTE_ONLY or system in SCENARIOS):
        return None  # caching local files locally; scenarios count GETs (s3 only)
    if system == "shardcache_changed1" and dataset != "blobs":
        return None  # rewriting a JPEG's bytes would not decode
    folder = f"tar-{dataset}" if system in PACKED else dataset
    if source == "s3":
        prefix = f"s3://bench/{folder}/"
        urls = sorted(f"s3://{p}" for p in fs.find(prefix))
        storage_options, endpoint = emulator.storage_options(), emulator.endpoint_url
    else:
        prefix = f"{local_root / folder}/"
        urls = sorted(str(p) for p in (local_root / folder).iterdir())
        storage_options, endpoint = {}, None
    layout = f"{args.nodes}x{rpn}"
    cfg: dict[str, Any] = {
        "source": source,
        "dataset": dataset,
        "prefix": prefix,
        "urls": urls,
        "samples": args.images if dataset == "images" else args.blobs,
        "chunk_samples": (
            HALF_CACHE_CHUNK_SAMPLES.get(dataset) if system in HALF_CACHE else None
        ),
        "shuffle_block": (
            HALF_CACHE_SHUFFLE_BLOCK[dataset] if system in HALF_CACHE else None
        ),
        "format": PACKED.get(system),
        "storage_options": storage_options,
        "endpoint": endpoint,
        "redis_url": redis_url,
        # A fresh cache per run: every run starts cold.
        "namespace": f"b{rep}{source[0]}{dataset[0]}{layout.replace('x', '')}"
        f"{system.replace('_', '')}",
        "store_env": _scenario_env(
            system, dataset, VALUE_BYTES[dataset] * len(urls), args.nodes
        ),
        "epochs": args.epochs,
        "world": args.nodes * rpn,
        "ranks_per_node": rpn,
        "layout": layout,
        "batch_size": args.batch_images if dataset == "images" else args.batch_blobs,
        "value_bytes": VALUE_BYTES[dataset],
        "workers": args.workers,
        "epoch_cap_s": args.epoch_cap_s,
        "shardcache_path": args.shardcache_path,
        "step_ms": 2.0,
        "tmp": tmp,
    }
    if system == "shardcache_changed1":
        count = max(1, len(urls) // 100)
        cfg["change_urls"] = urls[:: max(1, len(urls) // count)][:count]
        cfg["change_before_epoch"] = args.epochs - 1
    return cfg


def _scenario_env(
    system: str, dataset: str, values_bytes: int, nodes: int
) -> dict[str, Any]:
    """Store settings of a scenario: a per-node budget of half its share of values.

    The rank holds at most the working set of its shuffle blocks (four chunks):
    holding nothing, a chunk the store does not keep would be rebuilt for every
    batch that touches it; holding more, the rank would be a second cache.
    """
    if system in HALF_CACHE:
        chunk_bytes = HALF_CACHE_CHUNK_SAMPLES[dataset] * VALUE_BYTES[dataset]
        return {
            "cache_bytes": values_bytes // (2 * nodes),
            "eviction": HALF_CACHE[system],
            "hold_bytes": 4 * chunk_bytes,
        }
    return {}

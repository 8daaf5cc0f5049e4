"""Content checksums end to end: a chunk corrupted in place in the Ray object
store is named by ``shardcache verify``, never served by a checked read, and
rebuilt from the source once (by the read, or by ``verify --repair``)."""

from __future__ import annotations

import asyncio
import ctypes
import uuid

from typer.testing import CliRunner

from shardcache import DistributedCachedDataset
from shardcache.checksum import is_intact
from shardcache_server.cli import app
from shardcache_server.settings import ServiceSettings

from helpers import local_shard, register_dataset

OBJECT_BYTES = 96 * 2**10  # two per chunk: 192 KiB, far above Ray's 100 KiB inlining
OBJECTS = 4


def _source(s3fs_client, bucket):
    s3fs_client.pipe(
        {
            f"{bucket}/d/{i:03d}.bin": bytes([i + 1]) * OBJECT_BYTES
            for i in range(OBJECTS)
        }
    )
    return f"s3://{bucket}/d/"


def _dataset(url, s3, redis_url, namespace):
    return DistributedCachedDataset(
        url,
        storage_options=s3.storage_options(),
        redis_url=redis_url,
        namespace=namespace,
        name="integ",
        chunk_samples=2,
        shuffle=False,
        rank=0,
        world_size=1,
        prefetch_batches=0,
    )


def _corrupt_chunk_zero(ds) -> None:
    """Write into the object store's pages of chunk 0, as a rank that mutates a
    zero-copy view in place would (the array is read-only only by its flag)."""
    ds[0]  # maps chunk 0
    column = ds._session.reader._held[0].columns["_"]
    assert not column.flags.writeable
    ctypes.memset(column.ctypes.data, 0xEE, 1000)


def _verify(ray_cluster, redis_url, namespace, *extra):
    return CliRunner().invoke(
        app,
        ["verify", "integ", *extra, "--ray-address", ray_cluster.address,
         "--redis-url", redis_url, "--namespace", namespace],
    )  # fmt: skip


def test_verify_names_chunk_corrupted_in_object_store_and_checked_read_rebuilds_once(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace, monkeypatch
):
    url = _source(s3fs_client, bucket)
    ds = _dataset(url, s3, redis_url, namespace)
    assert bytes(ds[0][:3].numpy()) == b"\x01\x01\x01"
    clean = _verify(ray_cluster, redis_url, namespace)
    assert clean.exit_code == 0, clean.output
    assert "0 corrupt chunk(s)" in clean.output

    _corrupt_chunk_zero(ds)
    found = _verify(ray_cluster, redis_url, namespace)
    assert found.exit_code == 1, found.output
    assert "chunk c0: contents fail their checksum" in found.output
    assert "chunk c1" not in found.output  # a node id may hold "c1"

    monkeypatch.setenv("SHARDCACHE_VERIFY_READS", "1.0")
    gets = s3.total_gets
    reader = _dataset(url, s3, redis_url, namespace)
    assert reader.config.verify_reads == 1.0
    assert bytes(reader[0][:1000].numpy()) == b"\x01" * 1000  # never the 0xEE bytes
    assert bytes(reader[1][:3].numpy()) == b"\x02\x02\x02"
    assert s3.total_gets - gets == 2  # chunk 0's two objects, read once more
    reader[0], reader[1]
    assert s3.total_gets - gets == 2  # rebuilt once, then held
    after = _verify(ray_cluster, redis_url, namespace)
    assert after.exit_code == 0, after.output


def test_verify_repair_rebuilds_corrupt_chunk_from_source(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    url = _source(s3fs_client, bucket)
    ds = _dataset(url, s3, redis_url, namespace)
    _corrupt_chunk_zero(ds)
    gets = s3.total_gets
    repaired = _verify(ray_cluster, redis_url, namespace, "--repair")
    assert repaired.exit_code == 0, repaired.output
    assert "repaired:" in repaired.output and "chunk c0" in repaired.output
    assert s3.total_gets - gets == 2
    again = _verify(ray_cluster, redis_url, namespace)
    assert again.exit_code == 0 and "0 corrupt chunk(s)" in again.output, again.output
    fresh = _dataset(url, s3, redis_url, namespace)
    assert bytes(fresh[0][:1000].numpy()) == b"\x01" * 1000


def _plain_shard(s3, s3fs_client, bucket, redis_url, **settings):
    from shardcache.decoders import raw_bytes

    s3fs_client.pipe({f"{bucket}/d/{i:03d}.bin": bytes([i + 1]) * 64 for i in range(4)})
    ns = f"t{uuid.uuid4().hex[:8]}"
    cfg = ServiceSettings(
        redis_url=redis_url, namespace=ns, stats_flush_s=0.05, **settings
    )
    _, spec, items = register_dataset(s3, f"s3://{bucket}/d/", redis_url, ns, raw_bytes)
    return local_shard(cfg), spec, items


def test_shard_verify_contents_finds_and_repairs_corruption_in_memory(
    s3, s3fs_client, bucket, redis_url
):
    from shardcache.decoders import raw_bytes

    shard, spec, items = _plain_shard(s3, s3fs_client, bucket, redis_url)

    async def scenario():
        await shard.install(spec, raw_bytes)
        refs = [r[1] for r in await shard.get("ds", 1, items)]
        clean = await shard.verify_contents("ds")
        ctypes.memset(refs[0]["_"].ctypes.data, 0xEE, 8)
        found = await shard.verify_contents("ds")
        gets = s3.total_gets
        fixed = await shard.verify_contents("ds", repair=True)
        refetched = s3.total_gets - gets
        after = await shard.verify_contents("ds")
        await shard.close()
        return clean, found, fixed, after, refetched

    clean, found, fixed, after, refetched = asyncio.run(scenario())
    assert clean["bad"] == [] and clean["checked"] == len(items)
    assert found["bad"] == [items[0][0]]
    assert fixed["repaired"] == [items[0][0]] and fixed["still_bad"] == []
    assert after["bad"] == [] and refetched == 1


def test_shard_chunk_spilled_to_disk_verifies_and_corrupt_file_is_rebuilt(
    s3, s3fs_client, bucket, redis_url, tmp_path
):
    from shardcache.decoders import raw_bytes

    shard, spec, items = _plain_shard(
        s3, s3fs_client, bucket, redis_url, disk_dir=str(tmp_path), disk_bytes=2**20
    )
    chunk = items[0][0]

    async def scenario():
        await shard.install(spec, raw_bytes)
        await shard.get("ds", 1, items)
        await shard.flush_disk()
        shard._table.evict(("ds", chunk))  # only its file is left
        (loaded,) = await shard.get("ds", 1, items[:1])
        spilled_ok = loaded[0] == "hit" and is_intact(loaded[1])
        shard._table.evict(("ds", chunk))
        path = shard._spill.disk.path("ds", chunk)
        raw = path.read_bytes()
        path.write_bytes(raw.replace(b"\x01" * 64, b"\xee" * 64))
        found = await shard.verify_contents("ds")
        gets = s3.total_gets
        (rebuilt,) = await shard.get("ds", 1, items[:1])
        refetched = s3.total_gets - gets
        await shard.close()
        return spilled_ok, found, rebuilt, refetched

    spilled_ok, found, rebuilt, refetched = asyncio.run(scenario())
    assert spilled_ok
    assert found["bad"] == [f"{chunk} (disk)"]
    assert rebuilt[0] == "fetched" and bytes(rebuilt[1]["_"][0]) == b"\x01" * 64
    assert refetched == 1

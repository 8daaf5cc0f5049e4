"""Training-pod side of tests/services/test_endpoint.py: run inside a mount (and
network) namespace that has no Ray session directory and no route to Redis or
S3; the only way to the cache is the node-local endpoint's socket (or, for
``remote``, the Flight port). Writes its findings as JSON under the hostPath.

Usage: python endpoint_job.py ranks|remote|remote-workers|nomount|restart CONFIG_JSON
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def _expected(url: str, changed: bool) -> bytes:
    i = int(url.rsplit("/", 1)[1].split(".")[0])
    return bytes([200 if changed else i]) * (64 + i)


def _server_imported() -> bool:
    """Whether the cluster side was loaded: a pod reads through the sdk alone."""
    return any(m.split(".")[0] == "shardcache_server" for m in sys.modules)


def _mapping_of(ptr: int) -> tuple[str, str]:
    """(permissions, path) of the mapping of this process that holds ``ptr``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return parts[1], parts[5] if len(parts) > 5 else ""
    return "", ""


def _epoch(ds, epoch: int, changed_url: str | None) -> dict:
    ds.set_epoch(epoch)
    bad, seen, mapped = 0, [], 0
    order = list(ds.sampler)
    for b in range(0, len(order), 4):  # what DataLoader(batch_size=4) asks
        batch = order[b : b + 4]
        for i, t in zip(batch, ds.__getitems__(batch), strict=True):
            url = ds.manifest.url(i)
            if bytes(t.numpy()) != _expected(url, url == changed_url):
                bad += 1
            # The chunk the rank holds is a read-only shared mapping of a
            # chunk file the endpoint handed over; the sample it received is
            # a copy of its own (never a view a write could go through).
            reader = ds._session.reader
            c = int(reader.layout.chunk_of(np.array([i]))[0])
            chunk = reader._kept(c)
            perms, path = "", ""
            if chunk is not None:  # SHARDCACHE_HOLD_BYTES=0 keeps none
                view = chunk.field("_", i - int(reader.layout.starts[c]))
                perms, path = _mapping_of(view.ctypes.data)
            own_perms, own_path = _mapping_of(t.untyped_storage().data_ptr())
            mapped += int(
                perms.startswith("r-")
                and perms.endswith("s")
                and ".chunk" in path
                and ".chunk" not in own_path
            )
            seen.append(i)
    return {"bad": bad, "seen": seen, "mapped": mapped}


def _rank(rank: int, cfg: dict) -> None:
    import torch.distributed as dist

    from shardcache import DistributedCachedDataset

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=2
    )
    out = Path(cfg["shared"])
    ds = DistributedCachedDataset(
        cfg["url"],
        storage_options=cfg["storage_options"],
        name=cfg["name"],
        chunk_samples=2,
        seed=3,
    )
    result = {"ray_imported": "ray" in sys.modules, "epochs": []}
    result["server_imported"] = _server_imported()
    for epoch in (0, 1):
        result["epochs"].append(_epoch(ds, epoch, None))
    dist.barrier()
    if rank == 0:
        (out / "read-twice").write_text("")
    while not (out / "changed").exists():  # the test rewrites one object meanwhile
        time.sleep(0.1)
    result["refreshed"] = ds.refresh()
    result["epochs"].append(_epoch(ds, 2, cfg["changed_url"]))
    ds.close()
    dist.barrier()  # every rank flushed its usage: the cluster totals are final
    stats = ds.stats()
    result["stats"] = {k: stats[k] for k in ("hits", "misses", "served", "cluster")}
    result["ray_imported"] = result["ray_imported"] or "ray" in sys.modules
    result["server_imported"] = result["server_imported"] or _server_imported()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _one_rank(cfg: dict, **kwargs):
    """The dataset of a job of one rank (no process group)."""
    from shardcache import DistributedCachedDataset

    return DistributedCachedDataset(
        cfg["url"],
        storage_options=cfg["storage_options"],
        name=cfg["name"],
        chunk_samples=2,
        rank=0,
        world_size=1,
        **kwargs,
    )


def _as_list(batch: list) -> list:
    return batch  # the samples differ in size: no stacking


def _through_workers(ds, cfg: dict) -> int:
    """One epoch through ``DataLoader(num_workers=2)`` (forked workers, each
    with its own connection); the samples that differ from the source."""
    from torch.utils.data import DataLoader

    order = list(ds.sampler)
    loader = DataLoader(
        ds, batch_size=4, sampler=ds.sampler, num_workers=2, collate_fn=_as_list
    )
    got = [t for batch in loader for t in batch]
    assert len(got) == len(order), (len(got), len(order))
    bad = 0
    for i, t in zip(order, got, strict=True):
        url = ds.manifest.url(i)
        bad += bytes(t.numpy()) != _expected(url, url == cfg.get("changed_url"))
    return bad


def _across_restart(cfg: dict) -> dict:
    """One epoch, then wait while the test restarts the cache worker, then one
    more epoch through the new one."""
    ds = _one_rank(cfg)
    epochs = [_epoch(ds, 0, None)]
    out = Path(cfg["shared"])
    (out / "read-once").write_text("")
    while not (out / "restarted").exists():
        time.sleep(0.1)
    epochs.append(_epoch(ds, 1, None))
    ds.close()
    return {"epochs": epochs}


def main() -> None:
    mode, cfg = sys.argv[1], json.loads(sys.argv[2])
    if mode == "restart":
        print(json.dumps(_across_restart(cfg)))
        return
    if mode == "ranks":
        import torch.multiprocessing as mp

        mp.spawn(_rank, args=(cfg,), nprocs=2, join=True)
        return
    try:
        ds = _one_rank(cfg, allow_remote=mode.startswith("remote"))
    except Exception as exc:  # reported to the test, which checks the type
        print(
            json.dumps(
                {
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "server_imported": _server_imported(),
                }
            )
        )
        return
    ds.set_epoch(0)
    bad = 0
    if mode == "remote-workers":
        bad += _through_workers(ds, cfg)
    for i in range(len(ds)):
        url = ds.manifest.url(i)
        bad += bytes(ds[i].numpy()) != _expected(url, url == cfg.get("changed_url"))
    # What the flusher thread sends when the rank is quiet for a while (a long
    # step): the endpoint must take it, the rank raises if it is refused.
    ds._slot.here().usage.heartbeat()
    ds.close()
    stats = ds.stats()
    print(
        json.dumps(
            {
                "bad": bad,
                "read": len(ds),
                "served": stats["served"],
                "ray_imported": "ray" in sys.modules,
                "server_imported": _server_imported(),
                "env_ray": os.path.exists("/tmp/ray"),
            }
        )
    )


if __name__ == "__main__":
    main()

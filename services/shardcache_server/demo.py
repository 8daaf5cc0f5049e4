"""``shardcache demo``: embedded Redis, local Ray, an S3 emulator with generated
images, and a DDP training of a small CNN through DistributedCachedDataset."""

from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["run_demo"]

DEMO_OBJECT_STORE_BYTES = 256 * 2**20  # 2,000 decoded 32x32 images are ~25 MiB


def label_from_url(url: str) -> int:
    """Generated images carry their class in the name: ``img-000123-c7.png``."""
    return int(url.rsplit("-c", 1)[1].split(".", 1)[0])


def decode_shard_image(sample: dict[str, Any]) -> Any:
    """A WebDataset sample ``{"png": bytes, "cls": bytes}`` -> CHW float32 image."""
    from shardcache.decoders import decode_image_chw

    return decode_image_chw(sample["png"])


def _emulator_gets(endpoint: str | None) -> int | None:
    if endpoint is None:
        return None
    with urllib.request.urlopen(f"{endpoint}/_emulator/stats", timeout=10) as resp:
        return int(json.loads(resp.read())["total_gets"])


def _rank_main(rank: int, world: int, port: int, cfg: dict[str, Any], out: Any) -> None:
    import ray
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from shardcache import DistributedCachedDataset
    from shardcache.decoders import decode_image_chw

    torch.set_num_threads(1)
    ray.init(address=cfg["ray_address"], log_to_driver=False, logging_level="ERROR")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    # Epoch 1's GETs include the listing's (made at construction): a tar
    # shard's listing reads it whole and keeps its units for the builds.
    listing_gets = _emulator_gets(cfg["endpoint"]) if rank == 0 else None
    dist.barrier()
    ds = DistributedCachedDataset(
        cfg["url"],
        preprocess=decode_shard_image if cfg["format"] == "tar" else decode_image_chw,
        format=cfg["format"],
        target=label_from_url if cfg["labels"] else None,
        storage_options=cfg["storage_options"],
        redis_url=cfg["redis_url"],
        name=f"demo-images-{cfg['format']}" if cfg["format"] else "demo-images",
        job="demo",
    )
    # Collated batches gathered straight from the cached chunks (the fast
    # path; DataLoader(ds, sampler=ds.sampler) works too).
    loader = ds.loader(cfg["batch_size"])
    model = DistributedDataParallel(
        nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(cfg["epochs"]):
        ds.set_epoch(epoch)
        dist.barrier()
        gets_before = _emulator_gets(cfg["endpoint"]) if rank == 0 else None
        if epoch == 0 and listing_gets is not None:
            gets_before = listing_gets
        before = ds.stats()
        started, loss_sum, n = time.perf_counter(), 0.0, 0
        for batch in loader:
            x, y = (
                batch
                if cfg["labels"]
                else (batch, torch.zeros(len(batch), dtype=torch.long))
            )
            if isinstance(x, dict):
                x = next(iter(x.values()))
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum, n = loss_sum + loss.item() * len(y), n + len(y)
        elapsed = time.perf_counter() - started
        after = ds.stats()
        dist.barrier()
        row = {
            "rank": rank,
            "epoch": epoch + 1,
            "samples": n,
            "seconds": elapsed,
            "hits": after["hits"] - before["hits"],
            "misses": after["misses"] - before["misses"],
            "remote_reads": after["remote_reads"] - before["remote_reads"],
            "p50": after["wait_p50_ms"],
            "p99": after["wait_p99_ms"],
            "loss": loss_sum / max(n, 1),
        }
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            gets_after = _emulator_gets(cfg["endpoint"])
            s3_gets = None if gets_after is None else gets_after - (gets_before or 0)
            out.put({"epoch": epoch + 1, "rows": rows, "s3_gets": s3_gets})
    ds.close()
    dist.destroy_process_group()
    ray.shutdown()


def _start_dashboard(redis_url: str) -> str:
    """Serve the dashboard on loopback in a daemon thread; it ends with the demo."""
    import threading

    import uvicorn

    from shardcache_server.dashboard import create_app

    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(redis_url), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    threading.Thread(target=server.run, daemon=True).start()
    return f"http://127.0.0.1:{port}/"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_demo(
    *,
    source: str | None,
    images: int,
    epochs: int,
    ranks: int,
    batch_size: int,
    console: Console,
    fmt: str | None = None,
) -> bool:
    """Run the demo end to end; True when warm epochs made zero remote reads."""
    if source is None and fmt not in (None, "tar"):
        from shardcache.errors import ConfigError

        raise ConfigError(
            f"--format {fmt} needs --source: the generated images can be packed as "
            "'tar' shards only."
        )
    # Loopback only: Ray otherwise advertises the host's interface address.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    import torch.multiprocessing as mp

    from shardcache.embedded import start_redis_server
    from shardcache.local_ray import use_token_file, write_token
    from shardcache.redaction import redact_url
    from shardcache_server.cluster import kill_stores
    from shardcache_server.datagen import upload_image_shards, upload_images
    from shardcache_server.emulator import S3Emulator

    with tempfile.TemporaryDirectory(prefix="shardcache-demo-") as tmp:
        redis_proc, redis_url = start_redis_server(
            Path(tmp), password=secrets.token_urlsafe(16)
        )
        emulator = None
        try:
            if source is None:
                import s3fs

                emulator = S3Emulator().start()
                fs = s3fs.S3FileSystem(
                    skip_instance_cache=True, **emulator.storage_options()
                )
                fs.mkdir("demo")
                packing = " as WebDataset tar shards" if fmt == "tar" else ""
                with console.status(
                    f"generating {images} PNG images{packing} in the S3 emulator"
                ):
                    if fmt == "tar":
                        upload_image_shards(fs, "demo/shards", images)
                    else:
                        upload_images(fs, "demo/train", images)
                url = "s3://demo/shards/" if fmt == "tar" else "s3://demo/train/"
                storage_options = emulator.storage_options()
                console.print(
                    f"S3 emulator at {emulator.endpoint_url} holds {images} "
                    f"images{packing}"
                )
            else:
                url, storage_options = source, {}
            # Token auth with a token of the demo's own: no warning, and the
            # user's ~/.ray is left as it was (Ray would write auth_token there).
            use_token_file(write_token(Path(tmp) / "ray_token"))
            ray.init(
                address="local",  # always a private cluster, never a running one
                num_cpus=max(2, ranks),
                object_store_memory=DEMO_OBJECT_STORE_BYTES,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
            )
            console.print(
                f"Ray {ray.__version__} local cluster, Redis on loopback (password set)"
            )
            dashboard_url = _start_dashboard(redis_url)
            console.print(
                f"dashboard (while the demo runs): {dashboard_url}  "
                f"[dim](Redis {redact_url(redis_url)})[/]"
            )
            cfg = {
                "ray_address": ray.get_runtime_context().gcs_address,
                "url": url,
                "storage_options": storage_options,
                "redis_url": redis_url,
                "epochs": epochs,
                "batch_size": batch_size,
                "endpoint": emulator.endpoint_url if emulator else None,
                "labels": source is None,
                "format": fmt,
            }
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            port = _free_port()
            procs = [
                ctx.Process(target=_rank_main, args=(r, ranks, port, cfg, out))
                for r in range(ranks)
            ]
            for p in procs:
                p.start()
            results = []
            for _ in range(epochs):
                results.append(out.get(timeout=900))
                _print_epoch(console, results[-1])
            for p in procs:
                p.join(timeout=120)
            warm_reads = [
                r["s3_gets"]
                if r["s3_gets"] is not None
                else sum(row["remote_reads"] for row in r["rows"])
                for r in results[1:]
            ]
            ok = all(p.exitcode == 0 for p in procs) and all(w == 0 for w in warm_reads)
            if ok:
                console.print(
                    f"[bold green]epochs 2..{epochs} made zero remote reads[/]: "
                    "every sample came from the rank's own node cache."
                )
            else:
                console.print(
                    f"[bold red]unexpected remote reads in warm epochs: {warm_reads}[/]"
                )
            return ok
        finally:
            if ray.is_initialized():
                kill_stores("default")
                ray.shutdown()
            if emulator is not None:
                emulator.stop()
            redis_proc.terminate()
            redis_proc.wait(timeout=10)


def _print_epoch(console: Console, result: dict[str, Any]) -> None:
    rows = result["rows"]
    total = sum(r["samples"] for r in rows)
    seconds = max(r["seconds"] for r in rows)
    hits, misses = sum(r["hits"] for r in rows), sum(r["misses"] for r in rows)
    gets = (
        result["s3_gets"]
        if result["s3_gets"] is not None
        else sum(r["remote_reads"] for r in rows)
    )
    table = Table(
        title=f"epoch {result['epoch']}: {total / seconds:,.0f} samples/s, "
        f"hit rate {hits / max(hits + misses, 1):.1%}, S3 GETs {gets}"
    )
    for col in (
        "rank",
        "samples",
        "samples/s",
        "hits",
        "misses",
        "wait p50 ms",
        "wait p99 ms",
        "loss",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["rank"]),
            str(r["samples"]),
            f"{r['samples'] / r['seconds']:,.0f}",
            str(r["hits"]),
            str(r["misses"]),
            f"{r['p50']:.2f}",
            f"{r['p99']:.2f}",
            f"{r['loss']:.3f}",
        )
    console.print(table)

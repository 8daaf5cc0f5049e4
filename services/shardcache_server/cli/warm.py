"""``shardcache warm``: pre-fill the cache for a dataset, whole or a job's first steps."""

from __future__ import annotations

from typing import Any

import typer

from shardcache_server.cli.options import (
    NamespaceOpt,
    RedisOpt,
    console,
    friendly_errors,
)

__all__ = ["warm"]


def _storage_options(endpoint_url: str | None, options: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep:
            raise typer.BadParameter(f"--storage-option must be KEY=VALUE, got {opt!r}")
        out[key] = value
    if endpoint_url:
        out.setdefault("client_kwargs", {})["endpoint_url"] = endpoint_url
    return out


def _format_options(options: list[str]) -> dict[str, Any]:
    import json

    out: dict[str, Any] = {}
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep:
            raise typer.BadParameter(f"--format-option must be KEY=VALUE, got {opt!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value  # a plain string
    return out


def warm(
    url: str = typer.Argument(
        None, help="fsspec prefix, glob or object URL (or --like NAME)"
    ),
    preprocess: str = typer.Option(
        None,
        help="the job's preprocess: raw, decode_image, decode_image_chw, or "
        "module:function; default: the job's default for the URL",
    ),
    target: str = typer.Option(None, help="the job's target, as module:function"),
    format: str = typer.Option(  # noqa: A002
        None, "--format", help="the job's format= (tar, parquet, hdf5, lmdb, npy)"
    ),
    format_option: list[str] = typer.Option(
        [], "--format-option", help="KEY=VALUE (JSON value) of the job's format_options"
    ),
    like: str = typer.Option(
        None, "--like", help="copy the spec a job registered dataset NAME with"
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="start a new generation if the spec differs from the cached one",
    ),
    name: str = typer.Option(None, help="dataset name; default derived from URL"),
    endpoint_url: str = typer.Option(None, help="S3 endpoint (e.g. a local emulator)"),
    storage_option: list[str] = typer.Option(
        [], "--storage-option", "-o", help="KEY=VALUE for fsspec"
    ),
    batch: int = typer.Option(8, min=1, help="chunks per store request"),
    chunk_samples: int = typer.Option(
        4096, min=1, help="objects per chunk (the first listing of a dataset fixes it)"
    ),
    steps: int = typer.Option(
        None,
        min=1,
        help="warm only the chunks of every rank's first STEPS batches",
    ),
    world_size: int = typer.Option(1, min=1, help="ranks of the job (with --steps)"),
    batch_size: int = typer.Option(1, min=1, help="per-rank batch (with --steps)"),
    seed: int = typer.Option(0, help="the job's dataset seed (with --steps)"),
    epoch: int = typer.Option(0, min=0, help="the epoch to warm (with --steps)"),
    shuffle: str = typer.Option(
        "shard", help="the job's shuffle: shard, global or none (with --steps)"
    ),
    rank_node: list[str] = typer.Option(
        [],
        "--rank-node",
        help="Ray node id of rank 0, 1, ... in order (default: sorted alive "
        "nodes in contiguous blocks of ranks)",
    ),
    redis_url: str = RedisOpt,
    namespace: str = NamespaceOpt,
    ray_address: str = typer.Option(None, envvar="RAY_ADDRESS"),
) -> None:
    """Pre-fill the cache: every chunk built once, spread over the nodes; with
    --steps K, exactly the chunks of each rank's first K batches, on its node."""
    from shardcache_server.warm import warm_dataset

    modes: dict[str, bool | str] = {"shard": True, "global": "global", "none": False}
    if shuffle not in modes:
        raise typer.BadParameter(
            f"--shuffle must be one of {list(modes)}, got {shuffle!r}"
        )
    with friendly_errors():
        summary = warm_dataset(
            url,
            preprocess=preprocess,
            name=name,
            storage_options=_storage_options(endpoint_url, storage_option),
            redis_url=redis_url,
            namespace=namespace,
            ray_address=ray_address,
            batch=batch,
            chunk_samples=chunk_samples,
            console=console,
            steps=steps,
            world_size=world_size,
            batch_size=batch_size,
            seed=seed,
            epoch=epoch,
            shuffle=modes[shuffle],
            rank_nodes=rank_node or None,
            target=target,
            fmt=format,
            format_options=_format_options(format_option),
            like=like,
            force=force,
        )
    if steps is not None:
        console.print(
            f"first {steps} steps of {world_size} ranks: {summary['warmed_chunks']} "
            f"of {summary['chunks']} chunks ({summary['warmed_samples']} samples); "
            "rank nodes: "
            + ", ".join(f"{r}:{n[:8]}" for r, n in enumerate(summary["rank_nodes"]))
        )
    console.print(
        f"[green]warmed[/] {summary['dataset']}: {summary['objects']} objects, "
        f"{summary['fetched']} fetched, {summary['already_cached']} already cached, "
        f"{summary['bytes'] / 2**20:.1f} MiB in {summary['seconds']:.1f}s"
    )
    if summary["not_kept"]:
        # Read, but the stores' budgets could not hold them: a job reads them
        # from the source (or the disk tier) again.
        console.print(
            f"[yellow]not cached[/]: {summary['not_kept']} samples did not fit the "
            "stores' memory budget (SHARDCACHE_CACHE_BYTES, the chart's "
            "cache.cacheBytes); a job reads them from the source again."
        )
        raise typer.Exit(1)

"""Mosaic Streaming in the benchmark: MDSWriter conversion and StreamingDataset ranks.

`import streaming` imports torchvision, and the only torchvision that runs on
this machine is 0.29.1 beside torch 2.14.1, so Mosaic runs in an environment
of its own (`.venv-mosaic`, made by scripts/bench.sh) as subprocesses of
bench/run.py, and shares the rest of the harness (`ranks.measure_epochs`):

    .venv-mosaic/bin/python bench/mosaic.py convert CFG.json
    .venv-mosaic/bin/python bench/mosaic.py node CFG.json NODE OUTDIR

Mosaic keeps its per-node state in machine-wide shared memory (one
`/dev/shm` per node), so two emulated nodes on one machine would collide;
bench/launch.py starts each node in a mount namespace of its own with a private
`/dev/shm` (`unshare -m`), which is what two real machines have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import tree_anon  # noqa: E402
from samples import PREPROCESS  # noqa: E402

from ranks import _init_group, measure_epochs  # noqa: E402

# Mosaic hands out read-only views of its shards, as the SDK does of Ray's
# object store; the samples are only read here.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
SHARD_BYTES = 8 * 2**20  # as LitData's chunk_bytes in this benchmark
CONVERT_THREADS = 8  # concurrent source reads while converting


def remote_dir(cfg: dict[str, Any]) -> str | None:
    """Where the shards are uploaded; none with ``--source local``."""
    if cfg["source"] == "local":
        return None
    return f"s3://bench/mosaic-{cfg['namespace']}"


def out_dir(cfg: dict[str, Any]) -> str:
    return f"{cfg['tmp']}/mosaic-out-{cfg['namespace']}"  # per run: starts cold


def s3_env(cfg: dict[str, Any]) -> None:
    """Mosaic's S3 client (boto3) reads the endpoint from the environment."""
    os.environ.update(
        S3_ENDPOINT_URL=cfg["endpoint"],
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )


def convert(cfg: dict[str, Any]) -> None:
    """Read + preprocess every object once into MDS shards, uploaded to S3
    (or left on local disk with ``--source local``)."""
    from streaming import MDSWriter

    pre = PREPROCESS[cfg["dataset"]]
    if cfg["source"] == "local":

        def load(url: str) -> np.ndarray:
            with open(url, "rb") as f:
                return pre(f.read())

    else:
        import boto3

        s3_env(cfg)
        s3 = boto3.client("s3", endpoint_url=cfg["endpoint"])

        def load(url: str) -> np.ndarray:
            bucket, key = url.removeprefix("s3://").split("/", 1)
            return pre(s3.get_object(Bucket=bucket, Key=key)["Body"].read())

    remote = remote_dir(cfg)
    with (
        MDSWriter(
            out=(out_dir(cfg), remote) if remote else out_dir(cfg),
            columns={"x": "ndarray"},
            size_limit=SHARD_BYTES,
        ) as writer,
        ThreadPoolExecutor(CONVERT_THREADS) as pool,
    ):
        for x in pool.map(load, cfg["urls"]):
            writer.write({"x": x})


def run_rank(cfg: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """One rank: StreamingDataset over the shards, cached on its node's disk."""
    import torch.distributed as dist
    from streaming import StreamingDataLoader, StreamingDataset

    if cfg["source"] != "local":
        s3_env(cfg)
    per_node = cfg["ranks_per_node"]
    node = rank // per_node
    # Mosaic reads the layout from the torchrun environment.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(cfg["world"]),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(cfg["port"]),
    )
    _init_group(rank, cfg)
    anon0 = tree_anon(os.getpid())
    remote = remote_dir(cfg)
    ds = StreamingDataset(
        remote=remote,
        local=(
            f"{cfg['tmp']}/mosaic-cache-{cfg['namespace']}-node{node}"
            if remote
            else out_dir(cfg)
        ),
        shuffle=True,
        shuffle_seed=1,
        batch_size=cfg["batch_size"],
    )
    loader = StreamingDataLoader(
        ds,
        batch_size=cfg["batch_size"],
        num_workers=cfg["workers"],
        persistent_workers=cfg["workers"] > 0,
    )
    rows = measure_epochs(
        "mosaic",
        rank,
        cfg,
        lambda epoch: loader,
        anon_before=anon0,
        path="StreamingDataLoader (default collate)",
    )
    dist.destroy_process_group()
    return rows


def run_node(cfg: dict[str, Any], cfg_path: str, node: int, out_dir: str) -> int:
    """Start this node's ranks (sharing its /dev/shm) and wait for them."""
    per_node = cfg["ranks_per_node"]
    ranks = range(node * per_node, (node + 1) * per_node)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "rank",
                cfg_path,
                str(r),
                f"{out_dir}/rank{r}.json",
            ]
        )
        for r in ranks
    ]
    return max(p.wait() for p in procs)


def main() -> None:
    mode, cfg_path = sys.argv[1], sys.argv[2]
    cfg = json.loads(Path(cfg_path).read_text())
    if mode == "convert":
        convert(cfg)
    elif mode == "node":
        raise SystemExit(run_node(cfg, cfg_path, int(sys.argv[3]), sys.argv[4]))
    elif mode == "rank":
        rows = run_rank(cfg, int(sys.argv[3]))
        Path(sys.argv[4]).write_text(json.dumps(rows))
    else:
        raise SystemExit(f"unknown mode {mode!r}: convert, node or rank")


if __name__ == "__main__":
    main()

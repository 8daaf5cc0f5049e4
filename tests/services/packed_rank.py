"""One DDP rank reading packed local files it cannot see (run by
test_packed_local_ranks.py inside a mount namespace that hides the data)."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    address, redis_url, namespace, data = sys.argv[4:8]
    import ray
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from shardcache import DistributedCachedDataset

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    out: dict[str, object] = {"rank": rank, "sees_data": os.listdir(data)}
    for name in ("train.h5", "train.lmdb"):
        ds = DistributedCachedDataset(
            f"{data}/{name}",
            redis_url=redis_url,
            ray_address=address,  # DataLoader workers join this cluster, not "auto"
            namespace=namespace,
            seed=1,
            chunk_samples=8,
            name=name.replace(".", "-"),
        )
        # DataLoader workers read through the cache too, never the file.
        loader = DataLoader(
            ds,
            batch_size=4,
            sampler=ds.sampler,
            num_workers=2,
            collate_fn=list,
            multiprocessing_context="spawn",  # Ray cannot be used after fork
        )
        epochs = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            seen = []
            for batch in loader:
                for s in batch:
                    if isinstance(s, dict):  # HDF5: {"x": row, "y": index}
                        seen.append([int(s["y"]), s["x"].tolist()])
                    else:  # LMDB: the value's bytes
                        seen.append(bytes(s.numpy()).decode())
            epochs.append(seen)
        out[name] = epochs
        ds.close()
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Run by test_restart.py as a real training process (a rank with two
DataLoader workers). ``crash`` mode prints ``MID <job id> <worker pids>``
in the middle of epoch 1 and waits to be killed; ``full`` mode runs two
epochs and prints one JSON line of what it read."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only

COUNT = 48  # objects; object i holds byte i, 64 times


def main(mode: str, address: str, redis_url: str, options: str, bucket: str) -> None:
    import psutil
    import ray
    from torch.utils.data import DataLoader

    from shardcache import DistributedCachedDataset

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    ds = DistributedCachedDataset(
        f"s3://{bucket}/crash/",
        storage_options=json.loads(options),
        redis_url=redis_url,
        namespace=os.environ["SHARDCACHE_NAMESPACE"],
        name="crash",
        ray_address=address,  # spawned DataLoader workers join this cluster too
        chunk_samples=4,
        job="crash-job",  # the restarted job has the same name
    )
    loader = DataLoader(
        ds,
        batch_size=4,
        sampler=ds.sampler,
        collate_fn=list,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="spawn",
    )
    wrong = read = 0
    for epoch in range(2):
        ds.set_epoch(epoch)
        for step, batch in enumerate(loader):
            for t in batch:
                wrong += int(t.numel() != 64 or not bool((t == t[0]).all()))
                read += 1
            if mode == "crash" and epoch == 1 and step == 3:
                workers = [p.pid for p in psutil.Process().children(recursive=True)]
                job = ray.get_runtime_context().get_job_id()
                print("MID", job, *workers, flush=True)
                time.sleep(600)  # killed here, mid-epoch, workers busy
    print(json.dumps({"wrong": wrong, "read": read}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""The README's mixture example, run as written: the code block is read from
README.md, saved as ``mix.py`` and started with the command its first line
names, at 2 ranks; then again at 3 ranks, where it resumes from the state
the first run saved. The test supplies the bucket ``my-corpus`` (moto's
server, through ``AWS_ENDPOINT_URL``) and ``books.npy`` in the working
directory.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from test_readme import fresh_bucket, readme_script

from shardcache.embedded import free_port

BUCKET = "my-corpus"


def _npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value)
    return buf.getvalue()


def test_readme_mixture_runs_as_written_and_resumes_at_another_world_size(
    user, s3, s3fs_client
):
    fresh_bucket(s3fs_client, BUCKET)
    for k, (name, count) in enumerate((("web", 28), ("code", 8))):
        s3fs_client.pipe(
            {
                f"{BUCKET}/{name}/{i:03d}.npy": _npy(np.array([k, i], np.float32))
                for i in range(count)
            }
        )
    np.save(
        user.workdir / "books.npy", np.array([[2, i] for i in range(4)], np.float32)
    )
    code, command = readme_script("mix.py")
    assert command[:4] == [
        "python", "-m", "torch.distributed.run", "--nproc_per_node=2"
    ]  # fmt: skip
    user.write("mix.py", code)
    env = {
        "AWS_ENDPOINT_URL": s3.storage_options()["client_kwargs"]["endpoint_url"],
        # torchrun reads its defaults from PET_* variables: a free port, so a
        # job of another test on this machine never shares the store.
        "PET_MASTER_PORT": str(free_port()),
    }

    done = user.python(*command[1:], env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    saved = torch.load(user.workdir / "mix-state.pt")
    # Saved at the first step of the last epoch, by 2 ranks of 8 samples.
    assert (saved["epoch"], saved["start"]) == (1, 16)
    assert saved["weights"] == [0.7, 0.2, 0.1]

    # Preempted there and restarted on 3 ranks: it resumes, and its own
    # checkpoint lies further along the same epoch.
    again = [*command[1:3], "--nproc_per_node=3", *command[4:]]
    resumed = user.python(*again, env={**env, "PET_MASTER_PORT": str(free_port())})
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    later = torch.load(user.workdir / "mix-state.pt")
    assert later["epoch"] == 1 and later["start"] == 16 + 3 * 8
    s3fs_client.rm(BUCKET, recursive=True)

"""Local files rewritten under a job, on the user's path: the README's
script under plain ``torchrun`` (no ``job=``, no ``close()``, embedded
defaults, the demo run first), reading ``.npy`` files from a folder.

A README trial (2026-12-02) rewrote one file with the same size after the
job had listed the folder: the job delivered the new bytes under its old
listing, with no error (S3 raises ``StaleVersionError`` there). A job must
read the version it listed or say that the file changed; the next job reads
the new version.
"""

from __future__ import annotations

import numpy as np

from tests.userpath.test_jobs import _lines

SCRIPT = """
import json, sys
import numpy as np
import torch
import torch.distributed as dist
from shardcache import DistributedCachedDataset, StaleVersionError

src, rewrite = sys.argv[1], sys.argv[2] == "rewrite"
dist.init_process_group("gloo")
ds = DistributedCachedDataset(src)        # the job lists the folder here
dist.barrier()
if rewrite and ds.rank == 0:              # same shape and dtype: same size
    np.save(src + "s0005.npy", np.full((4,), 6005, np.float32))
dist.barrier()
loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=ds.sampler)
values, error = [], None
try:
    for batch in loader:
        values += [int(v) for v in batch[:, 0].tolist()]
except StaleVersionError as exc:
    error = str(exc)
print(json.dumps({"values": values, "error": error}))
"""


def _files(folder, count: int) -> None:
    folder.mkdir()
    for i in range(count):
        np.save(folder / f"s{i:04d}.npy", np.full((4,), i, np.float32))


def test_a_local_file_rewritten_after_the_listing_is_never_served_as_listed(user):
    src = user.workdir / "data"
    _files(src, 40)
    script = user.write("local_rewrite.py", SCRIPT)

    ranks = _lines(user.torchrun(script, f"{src}/", "rewrite"))
    assert len(ranks) == 2
    delivered = [v for r in ranks for v in r["values"]]
    assert 6005 not in delivered  # never the new bytes under the old listing
    errors = [r["error"] for r in ranks if r["error"]]
    assert len(errors) == 1, ranks  # the rank whose shard holds it
    assert "s0005.npy" in errors[0] and "changed since it was listed" in errors[0]
    assert "refresh()" in errors[0]

    ranks = _lines(user.torchrun(script, f"{src}/", "read"))  # a new job lists again
    assert [r["error"] for r in ranks] == [None, None]
    delivered = sorted(v for r in ranks for v in r["values"])
    assert delivered == sorted([*range(5), 6005, *range(6, 40)])

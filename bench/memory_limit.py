"""A memory cgroup around the reading process and the processes it starts.

A benchmark of a dataset larger than memory means little while the page
cache holds every file: the kernel charges a page-cache page to the cgroup
whose process read it in, so a limit on the reader's group bounds what it
keeps cached as well as what it allocates. The benchmark puts its reader
(the rank; later the plain loader and its workers) in the group after
dropping the page cache, so neither reads pages another process brought in.
Needs root and a writable cgroup mount (v1 ``memory`` controller or v2
unified); says why not otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["MemoryLimit"]

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


class MemoryLimit:
    """Enter a new memory cgroup of ``mib`` MiB (``with MemoryLimit(512):``).

    Children inherit the group; on exit this process moves back to its
    parent group, and the group is removed once its last process left.
    """

    def __init__(self, mib: int):
        self.limit = mib * 2**20
        name = f"shardcache-bench-{os.getpid()}"
        self.v1 = (V1 / "memory.limit_in_bytes").exists()
        root = V1 if self.v1 else V2
        self.group = root / name
        self.parent = root / _own_group(self.v1)  # where this process was

    def __enter__(self) -> MemoryLimit:
        try:
            self.group.mkdir()
            limit = "memory.limit_in_bytes" if self.v1 else "memory.max"
            (self.group / limit).write_text(str(self.limit))
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as exc:
            raise SystemExit(
                f"cannot make the memory cgroup {self.group} ({exc}): run as root "
                "on a host with a writable cgroup mount, or leave the limit out"
            ) from exc
        return self

    @staticmethod
    def drop_page_cache() -> None:
        """Write back and drop the clean page cache of the whole machine."""
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")

    @staticmethod
    def resident_mib(folder: str) -> float:
        """MiB of the files under ``folder`` in the page cache (util-linux
        ``fincore``; -1 where it is missing)."""
        files = [str(p) for p in Path(folder).rglob("*") if p.is_file()]
        if not files or shutil.which("fincore") is None:
            return -1.0
        done = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
            capture_output=True,
            text=True,
            check=False,
        )
        return round(sum(int(x) for x in done.stdout.split()) / 2**20, 1)

    def peak_mib(self) -> float:
        """The most memory the group used (page cache included), in MiB."""
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        path = self.group / name
        return round(int(path.read_text()) / 2**20, 1) if path.exists() else -1.0

    def __exit__(self, *exc: object) -> None:
        (self.parent / "cgroup.procs").write_text(str(os.getpid()))
        try:
            self.group.rmdir()
        except OSError:
            pass  # a child still in it (Ray's last process exiting): left behind


def _own_group(v1: bool) -> str:
    """This process's memory cgroup, relative to the mount (``/proc/self/cgroup``)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (v1 and "memory" in controllers.split(",")) or (not v1 and not controllers):
            return path.lstrip("/")
    return ""

"""Where a rank's process posts the reading (``job:epoch``) its DataLoader
workers read for, and the listing and invalidations they must follow.

A worker's copy of the dataset cannot say which epoch it serves: a
persistent worker keeps the sampler it was started with, whose epoch the
loop's ``set_epoch`` never reaches. Yet its requests must name the epoch,
so that the store can tell a chunk another rank built in this epoch (a
source read for this job) from one built before (a hit; see
docs/metrics.md). So the rank's process writes its reading to a small file
at each epoch start, and every worker reads it before each batch: a stat
(~2 us) and, when the file changed, a read. The file lives on tmpfs where
there is one (``/dev/shm``), is created with a random name readable by its
owner only, and is removed when the process that made it exits. A process
killed with SIGKILL cannot remove it, so the name carries its maker's pid
and pid namespace, and the next board made in that namespace removes the
files whose maker is gone (a few bytes each, but tmpfs is memory).

The same file carries what a persistent worker must follow inside the
epoch (``Post``): the listing digest after the rank's ``refresh()`` (the
worker maps the new listing and drops the chunks of changed objects) and
the count of its ``invalidate()`` calls (the worker reads the generation
anew before its next batch). Without it a persistent worker served the
listing and generation of its start: a README trial saw the old bytes of
two refreshed objects in every later epoch.

>>> board = EpochBoard()
>>> board.read()
''
>>> board.post("job1:0"); board.read()
'job1:0'
>>> import pickle
>>> copy = pickle.loads(pickle.dumps(board))  # a spawned worker's copy
>>> board.post("job1:1"); copy.read()
'job1:1'
>>> board.close(); copy.read()
''
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

__all__ = ["EpochBoard", "Post"]

log = logging.getLogger("shardcache")

_TMPFS = "/dev/shm"
_PREFIX = "shardcache-epoch-"
# "shardcache-epoch-{pid namespace}-{pid}-{random}": what a sweep may remove.
_NAMED = re.compile(re.escape(_PREFIX) + r"(\d+)-(\d+)-")


@dataclass(frozen=True)
class Post:
    """What a rank's process posts for its workers: the reading (``job:epoch``),
    and what a persistent worker must follow within the epoch too: the
    listing the rank reads (a ``refresh()``) and its ``invalidate()`` calls.

    >>> Post.decode(Post("job1:0", 0, "ab12", 1).encode())
    Post(reading='job1:0', epoch=0, listing='ab12', invalidations=1)
    >>> Post.decode("")
    Post(reading='', epoch=-1, listing='', invalidations=0)
    """

    reading: str = ""
    # The rank's epoch: a new one even where the reading is "" (a job= name).
    epoch: int = -1
    listing: str = ""
    invalidations: int = 0

    def encode(self) -> str:
        fields = (self.reading, self.epoch, self.listing, self.invalidations)
        return "\n".join(map(str, fields))

    @classmethod
    def decode(cls, text: str) -> Post:
        parts = text.split("\n")
        if len(parts) != 4 or not parts[3].isdigit():
            return cls()  # nothing posted (or gone): no reading, nothing to follow
        return cls(parts[0], int(parts[1]), parts[2], int(parts[3]))

    def moves_generation(self, last: Post) -> bool:
        """A new epoch or an invalidate since ``last``: read the generation
        anew (a refresh alone keeps it, as ``consistency="epoch"`` does)."""
        return (self.reading, self.epoch, self.invalidations) != (
            last.reading,
            last.epoch,
            last.invalidations,
        )


def _namespace() -> str:
    """This process's pid namespace (its inode), "0" where it cannot be read.

    Pods or containers may share one /dev/shm with pid namespaces of their
    own; a pid is only meaningful within its namespace, so a sweep never
    judges another namespace's files."""
    try:
        return os.readlink("/proc/self/ns/pid").strip("pid:[]") or "0"
    except OSError:
        return "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user
        return True
    return True


def _sweep(folder: str) -> int:
    """Remove the boards (and half-written posts) in ``folder`` whose maker
    is gone: same pid namespace, same owner, pid no longer running. Returns
    how many were removed."""
    space, uid, removed = _namespace(), os.getuid(), 0
    if space == "0":
        return 0  # no namespace to tell pids apart: judge nothing
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        match = _NAMED.match(name)
        if match is None or match.group(1) != space:
            continue
        pid = int(match.group(2))
        path = os.path.join(folder, name)
        try:
            if pid == os.getpid() or _alive(pid) or os.stat(path).st_uid != uid:
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue  # removed meanwhile by another sweep, or not ours to remove
    return removed


def _prefix() -> str:
    return f"{_PREFIX}{_namespace()}-{os.getpid()}-"


class EpochBoard:
    """One process's posted reading, and its workers' view of it."""

    def __init__(self) -> None:
        self.path = ""  # made by the first post
        self._owner = os.getpid()
        self._posts = True  # this object, not a worker's copy of it
        self._warned = False
        self._seen = (-1, -1, -1)  # (inode, mtime_ns, size) last read
        self._value = ""

    def __getstate__(self) -> dict[str, Any]:
        # A worker pickled before the first post must still know the file.
        if self._is_owner and not self.path:
            self._make()
        return {"path": self.path, "_owner": self._owner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.path, self._owner = state["path"], state["_owner"]
        self._posts = False

    @property
    def _is_owner(self) -> bool:
        # A forked worker inherits the object itself: its pid tells it apart.
        return self._posts and os.getpid() == self._owner

    def post(self, reading: str) -> None:
        """Post ``reading`` for this process's workers. Written to a new file
        renamed over the old one, so a worker reads one whole value or the
        other. A copy made elsewhere (a dataset built by a Ray Train driver
        and sent to its workers) starts a file of its own."""
        if not self._is_owner:
            self.path, self._owner, self._posts, self._value = "", os.getpid(), True, ""
        if reading == self._value:
            return
        if not self.path and not self._make():
            return
        staged = ""
        try:
            fd, staged = tempfile.mkstemp(
                prefix=_prefix(), dir=os.path.dirname(self.path)
            )
            with os.fdopen(fd, "w") as f:
                f.write(reading)
            os.replace(staged, self.path)
        except OSError as exc:
            # A full or read-only tmpfs must not stop set_epoch: the workers
            # then read without a reading (counted as before, docs/metrics.md).
            self._unwritable(exc)
            if staged:
                try:
                    os.unlink(staged)
                except OSError:
                    pass
            return
        self._value = reading

    def prepare(self) -> None:
        """Make the file now, in the posting process: a worker forked before
        the first post must still know where to read it."""
        if self._is_owner and not self.path:
            self._make()

    def _make(self) -> bool:
        """Create the (empty) file; False where no folder takes it."""
        folder = _TMPFS if os.access(_TMPFS, os.W_OK) else tempfile.gettempdir()
        _sweep(folder)
        try:
            fd, self.path = tempfile.mkstemp(prefix=_prefix(), dir=folder)
        except OSError as exc:
            self._unwritable(exc)
            return False
        os.close(fd)
        atexit.register(self.close)
        return True

    def _unwritable(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "shardcache: cannot post the epoch for DataLoader workers (%s); "
                "their source counts are per process (docs/metrics.md), and "
                "persistent workers follow refresh() and invalidate() only "
                "from their next start: pass persistent_workers=False",
                exc,
            )

    def read(self) -> str:
        """The reading posted last, "" if none (or its process is gone)."""
        if self._is_owner:
            return self._value
        if not self.path:
            return ""
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self._value = (-1, -1, -1), ""
            return ""
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            try:
                with open(self.path) as f:
                    self._value = f.read()
            except OSError:
                self._value = ""
            self._seen = seen
        return self._value

    def close(self) -> None:
        """Remove the file (its owner only)."""
        if not self._is_owner or not self.path:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.path, self._value = "", ""

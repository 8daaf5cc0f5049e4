"""Finding and stopping the local processes shardcache started, and only those.

Ray renames most of its processes (``ray::CacheShard``, ``ray::IDLE``,
``ray::RuntimeEnvAgent``) with setproctitle, so their command lines no longer
name the temp dir they belong to. Their environment does: every process of a
Ray head inherits the environment ``ray start`` ran with, so the head
shardcache starts carries a marker variable, and that is how its processes are
found again, however Ray renamed them and whoever their parent is now. The
one exception, the runtime env agent, starts with a scrubbed environment; it
writes its logs under the temp dir, so holding a file open there counts too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

__all__ = [
    "cmdline",
    "is_alive",
    "processes_holding",
    "processes_marked",
    "processes_naming",
    "terminate",
]

STOP_GRACE_S = 1.0  # SIGTERM to SIGKILL: Ray's processes exit in ~0.3 s or not at all
KILL_WAIT_S = 5.0  # how long a SIGKILLed process may take to disappear


def cmdline(pid: int) -> str:
    """The command line of ``pid`` with spaces for NULs; ``""`` when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _environ(pid: int) -> bytes:
    # Another user's processes are unreadable: they are not ours to stop.
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _pids() -> list[int]:
    me = os.getpid()
    return [
        int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()
        and int(e.name) != me
    ]  # fmt: skip


def processes_naming(path: str) -> list[int]:
    """Pids whose command line names ``path`` (a directory) or a path under it."""
    pattern = re.compile(re.escape(path.rstrip("/")) + r"(/|\s|$)")
    return [pid for pid in _pids() if pattern.search(cmdline(pid))]


def processes_marked(name: str, value: str) -> list[int]:
    """Pids whose environment holds ``name=value`` exactly."""
    entry = f"{name}={value}".encode()
    return [pid for pid in _pids() if entry in _environ(pid).split(b"\0")]


def processes_holding(path: str) -> list[int]:
    """Pids of Ray's renamed processes (``ray::...``) with a file open under
    ``path`` (a directory). Only those: a driver (the user's training script)
    holds its log files there too, and is not ours to stop."""
    prefix = path.rstrip("/") + "/"
    found = []
    for pid in _pids():
        if not cmdline(pid).startswith("ray::"):
            continue
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(prefix):
                found.append(pid)
                break
    return found


def is_alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an exited child nobody reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def terminate(pids: list[int], grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM ``pids``, SIGKILL those still alive after ``grace_s``, and return
    once all are gone (or ``KILL_WAIT_S`` passed), so a caller that checks or
    restarts right after sees no survivor. Returns ``pids``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    alive = _wait_gone(pids, grace_s)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(alive, KILL_WAIT_S)
    return pids


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if is_alive(p)]
    return alive

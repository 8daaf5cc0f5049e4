"""The file a rank's process posts its reading to, for its DataLoader workers."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys

from shardcache import epoch_board
from shardcache.epoch_board import EpochBoard


def test_a_worker_pickled_before_the_first_post_sees_every_later_post():
    board = EpochBoard()
    worker = pickle.loads(pickle.dumps(board))  # spawned before set_epoch
    assert worker.read() == ""
    for reading in ("job:0", "job:1", ""):
        board.post(reading)
        assert worker.read() == reading
    board.close()


def test_a_full_tmpfs_never_stops_set_epoch(tmp_path, monkeypatch, caplog):
    """A full /dev/shm (Docker's 64 MB, filled by DataLoader tensors) answers
    ENOSPC: faked, since this suite runs as root on a tmpfs it cannot fill
    safely. set_epoch goes on, one warning, the last posted reading stays."""
    monkeypatch.setattr(epoch_board, "_TMPFS", str(tmp_path))
    board = EpochBoard()
    board.post("job:0")
    real = epoch_board.tempfile.mkstemp

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(epoch_board.tempfile, "mkstemp", full)
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        board.post("job:1")
        board.post("job:2")
    monkeypatch.setattr(epoch_board.tempfile, "mkstemp", real)
    warnings = [r.message for r in caplog.records]
    assert len(warnings) == 1 and "cannot post the epoch" in warnings[0]
    assert pickle.loads(pickle.dumps(board)).read() == "job:0"
    assert [p.name for p in tmp_path.iterdir()] == [board.path.rsplit("/", 1)[-1]]
    board.close()
    assert list(tmp_path.iterdir()) == []


def test_a_board_left_by_a_killed_process_is_removed_by_the_next_one(
    tmp_path, monkeypatch
):
    """SIGKILL skips atexit: the next board made in this pid namespace removes
    the files of makers that are gone, and nothing of a live process or of
    another namespace (a pod sharing /dev/shm whose pids mean other things)."""
    script = (
        "import os, signal, sys\n"
        "from shardcache import epoch_board\n"
        f"epoch_board._TMPFS = {str(tmp_path)!r}\n"
        "board = epoch_board.EpochBoard()\n"
        "board.post('job:0')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", script], env=env, check=False)
    assert killed.returncode == -signal.SIGKILL
    (left,) = [p.name for p in tmp_path.iterdir()]
    space = epoch_board._namespace()
    assert left.startswith(f"shardcache-epoch-{space}-")
    live = tmp_path / f"shardcache-epoch-{space}-{os.getppid()}-live"
    other = tmp_path / f"shardcache-epoch-1{space}-999999-other"
    live.write_text("job:3")
    other.write_text("job:4")

    monkeypatch.setattr(epoch_board, "_TMPFS", str(tmp_path))
    board = EpochBoard()
    board.post("job:1")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert left not in names
    assert names == sorted([live.name, other.name, os.path.basename(board.path)])
    board.close()

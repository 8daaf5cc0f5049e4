"""The file a rank's process posts its reading to, for its DataLoader workers."""

from __future__ import annotations

import logging
import pickle

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

"""Per-batch wait times of one rank, summarised as percentiles."""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["WaitRecorder"]

WINDOW = 4096  # batches kept for the percentiles: a few epochs of a small job


class WaitRecorder:
    """Records how long the training loop waited for each batch.

    >>> w = WaitRecorder(); [w.record(x / 1000) for x in (1, 2, 3)]
    [None, None, None]
    >>> round(w.summary()["wait_p50_ms"], 3)
    2.0
    """

    def __init__(self, window: int = WINDOW):
        self._waits_s: deque[float] = deque(maxlen=window)
        self.batches = 0

    def record(self, wait_s: float) -> None:
        self._waits_s.append(wait_s)
        self.batches += 1

    def reset(self) -> None:
        self._waits_s.clear()

    def summary(self) -> dict[str, float]:
        if not self._waits_s:
            return {"wait_p50_ms": 0.0, "wait_p99_ms": 0.0, "wait_mean_ms": 0.0}
        ms = np.asarray(self._waits_s) * 1000.0
        return {
            "wait_p50_ms": float(np.percentile(ms, 50)),
            "wait_p99_ms": float(np.percentile(ms, 99)),
            "wait_mean_ms": float(ms.mean()),
        }

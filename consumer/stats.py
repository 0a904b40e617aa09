"""The trainer's own figures: how long it waits for data, and how long it works.

For every batch the iterator hands out it records the wait (from the caller asking for
the batch to having it: the data stall) and the work before it (from the previous batch
being handed out to this one being asked for: the trainer's own step). From these:
the stall fraction of the last epoch and of the last N batches, wait percentiles,
batches/s and MB/s; and ``first_batch_s``, the time from the stream's first iteration
(its first epoch asked for: connecting, claiming the run, waiting for producers
included) to the first batch handed out, None before it. The reader thread drains the
counters into its next pop script call (no extra round trip), so ``batchq status``,
``top`` and the exporter see them too.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from typing import Any

from batchq.protocol.fields import HistoryField, TrainerField
from batchq.protocol.layout import WAIT_BUCKETS_S  # the histogram buckets (s); last is +Inf

__all__ = ["WAIT_BUCKETS_S", "TrainerStats"]


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


class TrainerStats:
    """Per-batch accounting of one ServerDataStream (thread-safe).

    Args:
        window: how many recent batches the "recent" figures cover.
    """

    def __init__(self, window: int = 100) -> None:
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, float, int, float]] = deque(maxlen=window)
        self.batches = 0
        self.bytes = 0
        self.wait_s = 0.0
        self.busy_s = 0.0
        self.epoch = -1
        self.epoch_batches = 0
        self._epoch_wait_s = 0.0
        self._epoch_busy_s = 0.0
        self.last_epoch: dict[str, float] = {}
        # Not yet sent to Redis:
        self._out_wait_ms = 0.0
        self._out_busy_ms = 0.0
        self._out_epochs = 0
        self._out_buckets = [0] * (len(WAIT_BUCKETS_S) + 1)
        self._last_flush = 0.0
        self._flushed_batches = 0  # batches the figures last sent counted
        self._iterated_at: float | None = None  # the stream's first iteration (monotonic)
        self.first_batch_s: float | None = None  # from it to the first batch handed out

    def iterating(self) -> None:
        """The stream's iteration began (its first epoch was asked for): the clock of
        ``first_batch_s`` starts at the first call."""
        with self._lock:
            if self._iterated_at is None:
                self._iterated_at = time.monotonic()

    def start_epoch(self, epoch: int) -> None:
        """An epoch iterator started; the previous epoch's figures are kept."""
        with self._lock:
            if self.epoch >= 0 and self.epoch_batches:
                self._close_epoch()
            self.epoch, self.epoch_batches = epoch, 0
            self._epoch_wait_s = self._epoch_busy_s = 0.0

    def end_epoch(self) -> None:
        """The current epoch's iterator was exhausted."""
        with self._lock:
            self._close_epoch()
            self._out_epochs += 1
            self.epoch_batches = 0
            self._epoch_wait_s = self._epoch_busy_s = 0.0

    def _close_epoch(self) -> None:
        total = self._epoch_wait_s + self._epoch_busy_s
        self.last_epoch = {
            TrainerField.EPOCH: self.epoch,
            "batches": self.epoch_batches,
            "seconds": total,
            "stall_fraction": self._epoch_wait_s / total if total else 0.0,
        }

    def batch(self, wait_s: float, busy_s: float, nbytes: int) -> None:
        """One batch handed out after waiting ``wait_s``, ``busy_s`` after the last."""
        with self._lock:
            self.batches += 1
            self.epoch_batches += 1
            self.bytes += nbytes
            self.wait_s += wait_s
            self.busy_s += busy_s
            self._epoch_wait_s += wait_s
            self._epoch_busy_s += busy_s
            now = time.monotonic()
            if self.first_batch_s is None and self._iterated_at is not None:
                self.first_batch_s = now - self._iterated_at
            self._recent.append((wait_s, busy_s, nbytes, now))
            self._out_wait_ms += wait_s * 1000
            self._out_busy_ms += busy_s * 1000
            for i, bound in enumerate(WAIT_BUCKETS_S):
                if wait_s <= bound:
                    self._out_buckets[i] += 1
                    break
            else:
                self._out_buckets[-1] += 1

    def snapshot(self) -> dict[str, Any]:
        """The figures: stall fractions, wait percentiles, rates (see the module doc)."""
        with self._lock:
            recent = list(self._recent)
            epoch_total = self._epoch_wait_s + self._epoch_busy_s
            if epoch_total:
                epoch_stall = self._epoch_wait_s / epoch_total
            else:  # between epochs: the one that just ended
                epoch_stall = self.last_epoch.get("stall_fraction", 0.0)
            out: dict[str, Any] = {
                "batches": self.batches,
                "bytes": self.bytes,
                TrainerField.EPOCH: self.epoch,
                TrainerField.EPOCH_PROGRESS: self.epoch_batches,
                TrainerField.STALL_FRACTION_EPOCH: epoch_stall,
                TrainerField.FIRST_BATCH_S: self.first_batch_s,
                "last_epoch": dict(self.last_epoch),
            }
        waits = sorted(w for w, _, _, _ in recent)
        spent = sum(w + b for w, b, _, _ in recent)
        out[TrainerField.STALL_FRACTION_RECENT] = sum(waits) / spent if spent else 0.0
        out[TrainerField.WAIT_P50_S] = _percentile(waits, 0.5)
        out[TrainerField.WAIT_P90_S] = _percentile(waits, 0.9)
        out[TrainerField.WAIT_P99_S] = _percentile(waits, 0.99)
        out[TrainerField.BATCHES_PER_S] = len(recent) / spent if spent else 0.0
        out[TrainerField.MB_PER_S] = sum(n for _, _, n, _ in recent) / 1e6 / spent if spent else 0.0
        return out

    def figures_due(self) -> bool:
        """Whether batches were taken since the figures were last sent, a second ago or
        more (an idle reader sends them then: the trainer's progress shows)."""
        with self._lock:
            moved = self.batches != self._flushed_batches
            return moved and time.monotonic() - self._last_flush >= 1.0

    def drain(self, depth: int, force: bool = False) -> list[Any]:
        """The pop script's accounting arguments; figures and history about once a second.

        Returns:
            [wait_ms, busy_ms, epochs, buckets, figures JSON, history JSON].
        """
        now = time.monotonic()
        with self._lock:
            wait_ms, busy_ms = int(self._out_wait_ms), int(self._out_busy_ms)
            self._out_wait_ms -= wait_ms
            self._out_busy_ms -= busy_ms
            epochs, self._out_epochs = self._out_epochs, 0
            buckets = ",".join(map(str, self._out_buckets)) if any(self._out_buckets) else ""
            self._out_buckets = [0] * len(self._out_buckets)
            due = force or now - self._last_flush >= 1.0
            if due:
                self._last_flush = now
        figures = history = ""
        if due and self.batches:
            snap = self.snapshot()
            self._flushed_batches = snap["batches"]
            published = TrainerField.PUBLISHED  # the trainer hash's fields (pop.lua)
            figures = json.dumps(
                {k: round(float(snap[k]), 6) for k in published if snap[k] is not None}
            )
            history = json.dumps(
                {
                    HistoryField.T: round(time.time(), 3),
                    HistoryField.DEPTH: depth,
                    HistoryField.BATCHES: snap["batches"],
                    HistoryField.STALL: round(snap[TrainerField.STALL_FRACTION_RECENT], 4),
                    HistoryField.BATCHES_PER_S: round(snap[TrainerField.BATCHES_PER_S], 3),
                    HistoryField.MB_PER_S: round(snap[TrainerField.MB_PER_S], 3),
                }
            )
        return [wait_ms, busy_ms, epochs, buckets, figures, history]

"""A trainer whose work per batch is a sleep, for the sizing and autoscaling scenarios.

With producers that sleep too (``pipelines:numbered`` with ``TEST_SLOW_MS``), the true
need is known in advance: ``producer sleep / trainer sleep`` producers; neither side
costs CPU, so the figures hold on a small, loaded machine.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from consumer import ServerDataStream


class SleepyTrainer:
    """Trains on a queue in a thread, sleeping ``busy_s`` per batch (changeable).

    Attributes:
        busy_s: the work per batch, read before every sleep.
        batches: batches taken so far.
        error: what stopped the thread, if anything did.
    """

    def __init__(self, url: str, queue: str, busy_s: float) -> None:
        self.url, self.queue, self.busy_s = url, queue, busy_s
        self.batches = 0
        self.error: BaseException | None = None
        self._steps: deque[tuple[float, float]] = deque(maxlen=400)  # (wait, busy)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SleepyTrainer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def slowdown(self, ratio_last: int = 50) -> float | None:
        """Time per batch over the work per batch, over the last ``ratio_last`` batches.

        1.0 is the trainer's floor (it never waited); None before that many batches.
        """
        with self._lock:
            steps = list(self._steps)[-ratio_last:]
        if len(steps) < ratio_last:
            return None
        busy = sum(b for _, b in steps)
        return (sum(w for w, _ in steps) + busy) / busy if busy else None

    def since(self, batches: int) -> int:
        """Batches taken after the count ``batches``."""
        return self.batches - batches

    def _run(self) -> None:
        try:
            with ServerDataStream(("features", "targets"), url=self.url, queue=self.queue) as s:
                while not self._stop.is_set():
                    it = s.get_epoch_iterator()
                    asked = time.monotonic()
                    for _ in it:
                        got = time.monotonic()
                        time.sleep(self.busy_s)
                        done = time.monotonic()
                        with self._lock:
                            self._steps.append((got - asked, done - got))
                            self.batches += 1
                        asked = done
                        if self._stop.is_set():
                            break
        except BaseException as e:  # reported by the test
            self.error = e

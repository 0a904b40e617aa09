"""A producer's time to its first push: from its process's start (an interpreter's
start, imports and the factory included; for a worker forked from a warm pool, from the
fork) to its first frame in the list.

The figure is the producer's own, written once into the queue's pstats hash
(``<id>:first_push_ms``, :attr:`batchq.protocol.fields.ProducerFigure.FIRST_PUSH_MS`) by
its heartbeat thread, so nothing is added to the first batch's path; ``batchq status``
shows it per producer (``first_push_s``) and the exporter as
``batchq_producer_first_push_seconds``.
"""

from __future__ import annotations

import os
import time

import redis

from batchq.protocol.fields import ProducerFigure, producer_stat_field
from batchq.protocol.keys import QueueKeys

__all__ = ["FirstPush", "process_started_s"]


def process_started_s() -> float:
    """When this process started (wall clock, s; 10 ms steps), from /proc; now where
    there is no /proc."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        with open("/proc/uptime", "rb") as fh:
            uptime_s = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    ticks = int(stat[stat.rfind(b")") + 2 :].split()[19])  # field 22, starttime
    return time.time() - (uptime_s - ticks / os.sysconf("SC_CLK_TCK"))


class FirstPush:
    """When a producer started and first pushed.

    Args:
        started_s: the start (wall clock, s); None: the process's.
    """

    def __init__(self, started_s: float | None = None) -> None:
        self.started_s = started_s if started_s is not None else process_started_s()
        self.pushed_s: float | None = None
        self.written = False

    def pushed(self) -> None:
        """A frame of this producer is in the list (the first call counts)."""
        if self.pushed_s is None:
            self.pushed_s = time.time()

    @property
    def ms(self) -> int | None:
        """Milliseconds from the start to the first push, None before it."""
        if self.pushed_s is None:
            return None
        return max(0, round(1000 * (self.pushed_s - self.started_s)))

    def write(self, client: redis.Redis, keys: QueueKeys, producer: str) -> None:
        """Write the figure into the pstats hash, once it is known (once)."""
        ms = self.ms
        if ms is None or self.written:
            return
        client.hset(keys.pstats, producer_stat_field(producer, ProducerFigure.FIRST_PUSH_MS), ms)
        self.written = True

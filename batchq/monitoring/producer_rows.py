"""The producers in a status row: one object per live producer, and what their counters
add up to.

A producer object has the fields of :data:`PRODUCER_FIELDS` (documented with the row in
:mod:`batchq.monitoring.rows`), read from its counters in the pstats hash
(:class:`batchq.protocol.fields.ProducerStat`) and its heartbeat. The live producers'
totals give the mean frame size behind ``bytes_held`` and the lifetime rate the sizing
falls back to.
"""

from __future__ import annotations

from typing import Any

from batchq.monitoring.sizing import ratio
from batchq.monitoring.snapshot import QueueSnapshot
from batchq.protocol.fields import ProducerFigure, ProducerStat, StatsField
from batchq.protocol.layout import id_host

__all__ = ["PRODUCER_FIELDS", "bytes_held", "live_totals", "producer_rows"]

#: The fields of each object in a status row's ``producers``, in order.
PRODUCER_FIELDS = (
    "id", "batches", "bytes", "build_s", "blocked_s", "build_ms_per_batch", "batches_per_s",
    "blocked_fraction", "heartbeat_in_s", "host", "first_push_s",
)  # fmt: skip


def _producer(snap: QueueSnapshot, producer: str, deadline: float) -> dict[str, Any]:
    c = snap.pstats.get(producer, {})
    batches, build_ms, blocked_ms = (
        c.get(ProducerStat.BATCHES, 0),
        c.get(ProducerStat.PRODUCE_MS, 0),
        c.get(ProducerStat.BLOCKED_MS, 0),
    )
    per_batch = ratio(build_ms, batches)
    return {
        "id": producer,
        "batches": batches,
        "bytes": c.get(ProducerStat.BYTES, 0),
        "build_s": build_ms / 1000,
        "blocked_s": blocked_ms / 1000,
        "build_ms_per_batch": per_batch,
        "batches_per_s": ratio(1000.0, per_batch) if per_batch else None,
        "blocked_fraction": ratio(blocked_ms, build_ms + blocked_ms),
        "heartbeat_in_s": round((deadline - snap.now_ms) / 1000, 3),
        "host": id_host(producer),
        "first_push_s": (
            c[ProducerFigure.FIRST_PUSH_MS] / 1000 if ProducerFigure.FIRST_PUSH_MS in c else None
        ),
    }


def producer_rows(snap: QueueSnapshot) -> list[dict[str, Any]]:
    """One object per live producer (:data:`PRODUCER_FIELDS`), by id."""
    return [_producer(snap, p, d) for p, d in snap.alive.items()]


def live_totals(snap: QueueSnapshot) -> dict[str, int]:
    """Each counter of :class:`ProducerStat` summed over the live producers."""
    counters = [snap.pstats.get(p, {}) for p in snap.alive]
    return {name: sum(c.get(name, 0) for c in counters) for name in ProducerStat.ALL}


def bytes_held(snap: QueueSnapshot, totals: dict[str, int]) -> int:
    """depth x the mean frame size of the live producers (``totals``; the queue's when
    none has pushed), 0 when empty (see :mod:`batchq.monitoring.rows`)."""
    if not snap.depth:
        return 0
    nbytes, frames = totals[ProducerStat.BYTES], totals[ProducerStat.BATCHES]
    if not frames:
        stats = snap.stats
        nbytes, frames = stats.get(StatsField.PUSHED_BYTES, 0), stats.get(StatsField.PUSHED, 0)
    return round(snap.depth * nbytes / frames) if frames else 0

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

__all__ = ["PRODUCER_FIELDS", "bytes_held", "cache_fields", "live_totals", "producer_rows"]

#: The fields of each object in a status row's ``producers``, in order.
PRODUCER_FIELDS = (
    "id", "batches", "bytes", "build_s", "blocked_s", "build_ms_per_batch", "batches_per_s",
    "blocked_fraction", "heartbeat_in_s", "host", "cache_hits", "cache_misses",
    "cache_hit_rate", "cache_bytes", "cache_saved_s", "first_push_s",
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
        **_cache(c),
        "first_push_s": (
            c[ProducerFigure.FIRST_PUSH_MS] / 1000 if ProducerFigure.FIRST_PUSH_MS in c else None
        ),
    }


def _cache(c: dict[str, int]) -> dict[str, Any]:
    """A producer's cache figures (:mod:`producer.cache_stats`); None when it caches
    nothing."""
    if ProducerStat.CACHE_HITS not in c:
        return {name: None for name in _CACHE_FIELDS}
    hits, misses = c.get(ProducerStat.CACHE_HITS, 0), c.get(ProducerStat.CACHE_MISSES, 0)
    return {
        "cache_hits": hits,
        "cache_misses": misses,
        "cache_hit_rate": ratio(hits, hits + misses),
        "cache_bytes": c.get(ProducerStat.CACHE_BYTES, 0),
        "cache_saved_s": c.get(ProducerStat.CACHE_SAVED_MS, 0) / 1000,
    }


_CACHE_FIELDS = ("cache_hits", "cache_misses", "cache_hit_rate", "cache_bytes", "cache_saved_s")


def cache_fields(producers: list[dict[str, Any]]) -> dict[str, Any]:
    """The row's cache fields from its producer objects: hits, misses, the hit rate and
    the build time saved summed; ``cache_bytes`` the largest figure per host, summed over
    hosts (the producers of a host share its directory). None when none caches."""
    caching = [p for p in producers if p["cache_hits"] is not None]
    if not caching:
        return {name: None for name in _CACHE_FIELDS}
    hits = sum(p["cache_hits"] for p in caching)
    misses = sum(p["cache_misses"] for p in caching)
    per_host: dict[str, int] = {}
    for p in caching:
        per_host[p["host"]] = max(per_host.get(p["host"], 0), p["cache_bytes"])
    return {
        "cache_hits": hits,
        "cache_misses": misses,
        "cache_hit_rate": ratio(hits, hits + misses),
        "cache_bytes": sum(per_host.values()),
        "cache_saved_s": sum(p["cache_saved_s"] for p in caching),
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

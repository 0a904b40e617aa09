"""The fields of a status row read straight from the queue's counters and figures: the
stats hash's cumulative counters (:func:`counter_fields`), the trainer's recent figures
(:func:`figure_fields`), the params log's (:func:`params_fields`), and the producers: one
object per live producer (:func:`producer_rows`, the fields of :data:`PRODUCER_FIELDS`)
read from its counters in the pstats hash (:class:`batchq.protocol.fields.ProducerStat`)
and its heartbeat, and what their counters add up to (:func:`live_totals`: the mean
frame size behind ``bytes_held``, the lifetime rate the sizing falls back to; the cache's
figures, :func:`cache_fields`). Each is read here once; the fields are documented with
the row in :mod:`batchq.monitoring.rows`.
"""

from __future__ import annotations

from typing import Any

from batchq.monitoring.sizing import ratio
from batchq.monitoring.snapshot import QueueSnapshot
from batchq.monitoring.verdict import figures_fresh
from batchq.protocol.fields import (
    MetaField,
    ProducerFigure,
    ProducerStat,
    StatsField,
    TrainerField,
    autoscale_field,
    dead_field,
    wait_bucket_field,
)
from batchq.protocol.layout import WAIT_BUCKETS_S, id_host, parse_params_stamp
from batchq.protocol.ranks import lookahead_batches
from batchq.protocol.words import as_int

__all__ = [
    "PRODUCER_FIELDS",
    "bytes_held",
    "cache_fields",
    "cache_since_created",
    "counter_fields",
    "figure_fields",
    "live_totals",
    "params_fields",
    "producer_rows",
    "quarantined_in_run",
    "saved_ms_per_batch",
]


def _wait_buckets(stats: dict[str, int]) -> list[int]:
    """The trainer's waits per bucket, cumulative (as the exporter's le buckets)."""
    waits, total = [], 0
    for i in range(len(WAIT_BUCKETS_S) + 1):
        total += stats.get(wait_bucket_field(i), 0)
        waits.append(total)
    return waits


def counter_fields(stats: dict[str, int]) -> dict[str, Any]:
    """The row's fields read from the stats hash (cumulative counters)."""
    f = StatsField
    dead = dead_field("")
    return {
        "pushed": stats.get(f.PUSHED, 0),
        "popped": stats.get(f.POPPED, 0),
        "pushed_bytes": stats.get(f.PUSHED_BYTES, 0),
        "popped_bytes": stats.get(f.POPPED_BYTES, 0),
        "producer_blocked_s": stats.get(f.PRODUCER_BLOCKED_MS, 0) / 1000,
        "shards_done": stats.get(f.SHARDS_DONE, 0),
        "redone_shards": stats.get(f.REDONE_SHARDS, 0),
        "quarantined": stats.get(f.QUARANTINED, 0),
        "epochs_completed": stats.get(f.EPOCHS_COMPLETED, 0),
        "dead_by_reason": {
            k.removeprefix(dead): v for k, v in sorted(stats.items()) if k.startswith(dead) and v
        },
        "trainer_wait_s": stats.get(f.TRAINER_WAIT_MS, 0) / 1000,
        "trainer_busy_s": stats.get(f.TRAINER_BUSY_MS, 0) / 1000,
        "autoscale_added": stats.get(autoscale_field("add"), 0),
        "autoscale_retired": stats.get(autoscale_field("retire"), 0),
        "wait_buckets": _wait_buckets(stats),
    }


def figure_fields(snap: QueueSnapshot) -> dict[str, Any]:
    """The row's fields read from the trainer's figures, and whether they are fresh."""
    f = TrainerField
    updated = snap.figure(f.UPDATED_MS)
    age = None if updated is None else max(0.0, (snap.now_ms - updated) / 1000)
    epoch, progress = snap.figure(f.EPOCH), snap.figure(f.EPOCH_PROGRESS)
    epoch_batches = as_int(snap.meta.get(MetaField.EPOCH_BATCHES))
    return {
        "figures_age_s": age,
        "figures_fresh": figures_fresh(age),
        "stall": snap.figure(f.STALL_FRACTION_RECENT),
        "stall_epoch": snap.figure(f.STALL_FRACTION_EPOCH),
        "trainer_batches_per_s": snap.figure(f.BATCHES_PER_S),
        "trainer_mb_per_s": snap.figure(f.MB_PER_S),
        "wait_p50_s": snap.figure(f.WAIT_P50_S),
        "wait_p90_s": snap.figure(f.WAIT_P90_S),
        "wait_p99_s": snap.figure(f.WAIT_P99_S),
        "first_batch_s": snap.figure(f.FIRST_BATCH_S),
        "epoch": None if epoch is None or epoch < 0 else int(epoch),
        "epoch_progress": None if progress is None else int(progress),
        "epoch_fraction": ratio(progress, epoch_batches) if progress is not None else None,
    }


def quarantined_in_run(snap: QueueSnapshot) -> int:
    """The examples the queue's current run quarantined: its quarantine hash's count
    (0 when the hash is another run's, or there is none)."""
    run, count = snap.quarantine
    return count if run and run == snap.meta.get(MetaField.RUN) else 0


def params_fields(snap: QueueSnapshot) -> dict[str, Any]:
    """The row's fields about steering the producers: the run's look-ahead D in global
    batch indices (None until a producer published the plan), the params log's version
    (its entries, 0 for none) and the frames built with params since changed."""
    meta = snap.meta
    run, version = parse_params_stamp(meta.get(MetaField.PARAMS, ""))
    stride = meta.get(MetaField.SHARD_BATCHES)
    known = stride is not None and MetaField.WINDOW in meta
    # A striped queue's stripes each mint W of their shards ahead: N x W of the run's.
    window = as_int(meta.get(MetaField.WINDOW)) * max(1, as_int(meta.get(MetaField.STRIPES)))
    return {
        "lookahead_batches": (
            lookahead_batches(window, as_int(stride), snap.world) if known else None
        ),
        "params_version": version if run and run == meta.get(MetaField.RUN) else 0,
        "rebuilt_params": snap.stats.get(StatsField.REBUILT_PARAMS, 0),
    }


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
    """A producer's cache figures (:mod:`producer.cache_stage`); None when it caches
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


def saved_ms_per_batch(producers: list[dict[str, Any]]) -> float | None:
    """The build time the caches saved per batch pushed, in ms: the caching producers'
    ``cache_saved_s`` over their ``batches`` (None when none caches or none pushed)."""
    caching = [p for p in producers if p["cache_hits"] is not None]
    return ratio(
        1000 * sum(p["cache_saved_s"] for p in caching), sum(p["batches"] for p in caching)
    )


def cache_since_created(snap: QueueSnapshot) -> dict[str, Any]:
    """The cache fields (:func:`cache_fields`) and ``cache_saved_ms_per_batch`` over every
    producer in the pstats hash, gone ones included: a run's figures once its producers
    stopped (``report``; the status row's are the live producers'). Each producer's as
    of its last heartbeat; since the queue's keys were created, as the other counters."""
    producers = [
        {"host": id_host(p), "batches": c.get(ProducerStat.BATCHES, 0), **_cache(c)}
        for p, c in sorted(snap.pstats.items())
    ]
    return {**cache_fields(producers), "cache_saved_ms_per_batch": saved_ms_per_batch(producers)}


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

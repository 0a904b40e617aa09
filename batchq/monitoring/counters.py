"""The fields of a status row read straight from the queue's hashes: the stats hash's
cumulative counters (:func:`counter_fields`), the trainer's recent figures
(:func:`figure_fields`) and the params log's (:func:`params_fields`). Each is read here
once; the fields are documented with the row in :mod:`batchq.monitoring.rows`.
"""

from __future__ import annotations

from typing import Any

from batchq.monitoring.sizing import ratio
from batchq.monitoring.snapshot import QueueSnapshot
from batchq.monitoring.verdict import FIGURES_FRESH_S
from batchq.protocol.fields import (
    MetaField,
    StatsField,
    TrainerField,
    autoscale_field,
    dead_field,
    wait_bucket_field,
)
from batchq.protocol.layout import WAIT_BUCKETS_S, parse_params_stamp
from batchq.protocol.ranks import lookahead_batches
from batchq.protocol.words import as_int

__all__ = ["counter_fields", "figure_fields", "params_fields"]


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
        "figures_fresh": age is not None and age <= FIGURES_FRESH_S,
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


def params_fields(snap: QueueSnapshot) -> dict[str, Any]:
    """The row's fields about steering the producers: the run's look-ahead D in global
    batch indices (None until a producer published the plan), the params log's version
    (its entries, 0 for none) and the frames built with params since changed."""
    meta = snap.meta
    run, version = parse_params_stamp(meta.get(MetaField.PARAMS, ""))
    stride = meta.get(MetaField.SHARD_BATCHES)
    known = stride is not None and MetaField.WINDOW in meta
    return {
        "lookahead_batches": (
            lookahead_batches(as_int(meta.get(MetaField.WINDOW)), as_int(stride), snap.world)
            if known
            else None
        ),
        "params_version": version if run and run == meta.get(MetaField.RUN) else 0,
        "rebuilt_params": snap.stats.get(StatsField.REBUILT_PARAMS, 0),
    }

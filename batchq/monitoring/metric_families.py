"""The Prometheus metric families of the exporter (:mod:`batchq.monitoring.exporter`,
which documents them), built from the queues' status rows.

Each family reads row fields only (the tables below: metric -> row field), so a figure
is computed once, in the row (:mod:`batchq.monitoring.rows`), for ``status``, ``top``,
``report`` and Prometheus.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from batchq.protocol.layout import WAIT_BUCKETS_S

__all__ = ["group_families", "producer_families", "queue_families", "rank_families"]

_Q = ["queue"]
_QP = ["queue", "producer"]

Row = dict[str, Any]
# Gauges per queue: (name, help, the value from its status row; None: no sample).
_GAUGES: tuple[tuple[str, str, Callable[[Row], float | None]], ...] = (
    ("queue_depth_items", "Frames in the data list (LLEN)", lambda r: r["depth"]),
    ("queue_capacity_items", "The run's cap (hwm) on the data list", lambda r: r["hwm"]),
    (
        "queue_depth_bytes",
        "Bytes in the data list (depth x the mean frame size; 0 when empty)",
        lambda r: r["bytes_held"],
    ),
    (
        "queue_oldest_frame_age_seconds",
        "Age of the oldest frame in the list, by its producer's clock (0 when empty)",
        lambda r: 0.0 if r["depth"] == 0 else r["oldest_age_s"],
    ),
    (
        "cache_hit_ratio",
        "Hits over examples of the live producers' cached stages",
        lambda r: r["cache_hit_rate"],
    ),
    (
        "cache_bytes",
        "Bytes the live producers' cache directories hold (largest per host, summed)",
        lambda r: r["cache_bytes"],
    ),
    (
        "producers_alive",
        "Producers whose heartbeat has not lapsed",
        lambda r: r["producers_alive"],
    ),
    (
        "trainer_attached",
        "1 while a trainer holds the queue",
        lambda r: 1 if r["trainer"] == "attached" else 0,
    ),
    (
        "trainer_stall_ratio",
        "Fraction of its last 100 batches' time the trainer waited for data",
        lambda r: r["stall"] if r["figures_fresh"] else None,
    ),
    (
        "trainer_epoch",
        "The trainer's current epoch",
        lambda r: r["epoch"] if r["figures_fresh"] else None,
    ),
    (
        "trainer_demand_batches_per_second",
        "Batches/s the trainer would take if it never waited (1 / its busy time per batch)",
        lambda r: r["demand_batches_per_s"],
    ),
    (
        "supply_batches_per_second",
        "The live producers' summed pipeline rate (blocked time excluded)",
        lambda r: r["supply_batches_per_s"],
    ),
    (
        "producer_rate_batches_per_second",
        "The observed pipeline rate of one producer",
        lambda r: r["producer_batches_per_s"],
    ),
    (
        "recommended_producers",
        "Producers that meet the trainer's demand at the observed rate, with a margin",
        lambda r: r["recommended_producers"],
    ),
    (
        "lookahead_batches",
        "The run's look-ahead D: how far past the trainer producers can have built",
        lambda r: r["lookahead_batches"],
    ),
    (
        "run_quarantined_examples",
        "Examples the queue's current run quarantined (its quarantine hash's count)",
        lambda r: r["quarantined_run"],
    ),
    (
        "trainer_first_batch_seconds",
        "The trainer's time from its stream's first iteration to its first batch",
        lambda r: r["first_batch_s"],
    ),
)
# Counters per queue: (name, help, the row field).
_COUNTERS = (
    ("frames_pushed", "Frames pushed into the data list", "pushed"),
    ("frames_popped", "Frames popped by the trainer", "popped"),
    ("bytes_pushed", "Bytes pushed into the data list", "pushed_bytes"),
    ("bytes_popped", "Bytes the trainer received", "popped_bytes"),
    ("producers_blocked_seconds", "Time producers spent blocked at the hwm", "producer_blocked_s"),
    ("trainer_busy_seconds", "Time the trainer spent between batches", "trainer_busy_s"),
    ("epochs_completed", "Epochs the trainer finished", "epochs_completed"),
    ("shards_done", "Shards whose last frame was pushed", "shards_done"),
    ("redone_shards", "Shards handed back to be built again", "redone_shards"),
    (
        "quarantined_examples",
        "Examples the dataset could not read, replaced by substitutes (quarantine)",
        "quarantined",
    ),
    (
        "rebuilt_params_frames",
        "Frames built with params a later set_params made stale, built again",
        "rebuilt_params",
    ),
)
# Counters per live producer: (name, help, the producer object's field).
_PRODUCER_COUNTERS = (
    ("frames_pushed", "Frames this producer pushed", "batches"),
    ("bytes_pushed", "Bytes this producer pushed", "bytes"),
    ("build_seconds", "Time this producer's pipeline spent building batches", "build_s"),
    ("blocked_seconds", "Time this producer spent blocked at the hwm", "blocked_s"),
    ("cache_hits", "Examples this producer's cached stages read from the cache", "cache_hits"),
    ("cache_misses", "Examples this producer's cached stages built", "cache_misses"),
    (
        "cache_saved_seconds",
        "Build time this producer's cache hits saved, less their reads",
        "cache_saved_s",
    ),
)
_BOUNDS = [repr(b) for b in WAIT_BUCKETS_S] + ["+Inf"]


def queue_families(rows: list[Row]) -> Iterable[Metric]:
    """The per-queue gauges, counters, the wait histogram, dead frames and decisions."""
    gauges = [(GaugeMetricFamily(f"batchq_{n}", doc, labels=_Q), v) for n, doc, v in _GAUGES]
    counters = [
        (CounterMetricFamily(f"batchq_{n}", doc, labels=_Q), field) for n, doc, field in _COUNTERS
    ]
    wait = HistogramMetricFamily(
        "batchq_trainer_wait_seconds", "The trainer's wait for each batch", labels=_Q
    )
    dead = CounterMetricFamily(
        "batchq_dead_frames", "Frames that failed validation", labels=["queue", "reason"]
    )
    decisions = CounterMetricFamily(
        "batchq_autoscale_decisions",
        "Decisions of `serve --workers auto`: workers added or retired",
        labels=["queue", "action"],
    )
    for row in rows:
        q = [row["queue"]]
        for gauge, value_of in gauges:
            value = value_of(row)
            if value is not None:
                gauge.add_metric(q, value)
        for counter, field in counters:
            counter.add_metric(q, row[field])
        buckets = list(zip(_BOUNDS, row["wait_buckets"], strict=True))
        wait.add_metric(q, buckets, row["trainer_wait_s"])
        for reason, count in row["dead_by_reason"].items():
            dead.add_metric([row["queue"], reason], count)
        decisions.add_metric([row["queue"], "add"], row["autoscale_added"])
        decisions.add_metric([row["queue"], "retire"], row["autoscale_retired"])
    yield from (gauge for gauge, _ in gauges)
    yield from (counter for counter, _ in counters)
    yield wait
    yield dead
    yield decisions


def producer_families(rows: list[Row]) -> Iterable[Metric]:
    """The per-producer counters (label ``producer``) of the live producers, and the
    time each took from its start to its first push (once known)."""
    fams = [
        (CounterMetricFamily(f"batchq_producer_{n}", doc, labels=_QP), field)
        for n, doc, field in _PRODUCER_COUNTERS
    ]
    first_push = GaugeMetricFamily(
        "batchq_producer_first_push_seconds",
        "From the producer's start (its process's, or its fork) to its first push",
        labels=_QP,
    )
    for row in rows:
        for prod in row["producers"]:
            for fam, field in fams:
                if prod[field] is not None:  # the cache's: only where it caches
                    fam.add_metric([row["queue"], prod["id"]], prod[field])
            if prod["first_push_s"] is not None:
                first_push.add_metric([row["queue"], prod["id"]], prod["first_push_s"])
    yield from (fam for fam, _ in fams)
    yield first_push


def group_families(rows: list[Row]) -> Iterable[Metric]:
    """The per-group metrics of runs read by several groups (label ``group``; the
    default group's is ``''``)."""
    labels = ["queue", "group"]
    fams = {
        key: GaugeMetricFamily(f"batchq_group_{name}", doc, labels=labels)
        for key, name, doc in (
            ("depth", "depth_items", "Items in the group's data list(s)"),
            ("attached", "attached", "1 while the group's trainer holds its claim"),
            ("alone", "detached", "1 while its batches are built for it alone"),
            ("lag_batches", "lag_batches", "Batches the group is behind the leading group"),
            ("stall", "stall_ratio", "The group's recent stall fraction"),
            ("batches_per_s", "batches_per_second", "Batches the group took per second"),
            ("epoch", "epoch", "The group's current epoch"),
        )
    }
    solo = CounterMetricFamily(
        "batchq_group_solo_builds", "Frames built for the group alone", labels=labels
    )
    for row in rows:
        for group in row["groups"]:
            key = [row["queue"], group["group"]]
            fams["depth"].add_metric(key, group["depth"])
            fams["attached"].add_metric(key, 1 if group["trainer"] == "attached" else 0)
            fams["alone"].add_metric(key, 1 if group["sharing"] == "alone" else 0)
            for name in ("lag_batches", "stall", "batches_per_s", "epoch"):
                if group[name] is not None:
                    fams[name].add_metric(key, group[name])
            solo.add_metric(key, group["solo_builds"])
    yield from fams.values()
    yield solo


def rank_families(rows: list[Row]) -> Iterable[Metric]:
    """The per-rank metrics of data-parallel trainers (label ``rank``)."""
    labels = ["queue", "rank"]
    fams = {
        key: GaugeMetricFamily(f"batchq_rank_{name}", doc, labels=labels)
        for key, name, doc in (
            ("depth", "depth_items", "LLEN of the rank's data list"),
            ("attached", "attached", "1 while the rank holds its claim"),
            ("stall", "stall_ratio", "The rank's recent stall fraction"),
            ("batches_per_s", "batches_per_second", "Batches the rank took per second"),
            ("epoch", "epoch", "The rank's current epoch"),
        )
    }
    verdict = GaugeMetricFamily(
        "batchq_rank_verdict", "1 for the rank's verdict", labels=[*labels, "verdict"]
    )
    slowest = GaugeMetricFamily("batchq_slowest_rank", "The rank furthest behind", labels=_Q)
    for row in rows:
        for rank in row["ranks"]:
            key = [row["queue"], str(rank["rank"])]
            fams["depth"].add_metric(key, rank["depth"])
            fams["attached"].add_metric(key, 1 if rank["trainer"] == "attached" else 0)
            for name in ("stall", "batches_per_s", "epoch"):
                if rank[name] is not None:
                    fams[name].add_metric(key, rank[name])
            verdict.add_metric([*key, rank["verdict"]], 1)
        if row["slowest_rank"] is not None:
            slowest.add_metric([row["queue"]], row["slowest_rank"])
    yield from fams.values()
    yield verdict
    yield slowest

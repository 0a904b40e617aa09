"""A Prometheus exporter: the queues' state, read from Redis on every scrape.

Needs ``prometheus-client`` (``pip install 'batchq[exporter]'``). :class:`BatchqCollector`
reads every queue (or the ones named) with :func:`batchq.monitoring.snapshot.read_snapshots`: one
pipelined round trip for all of them, plus a GETRANGE round trip only when the oldest
element of a queue is a reference to a large frame. Nothing is cached between scrapes
and nothing is written.

Metrics (base units; labels ``queue``, ``producer`` and ``rank``, plus ``le`` on the histogram's
buckets, ``reason`` on dead frames, a closed set: the codec's FrameError reasons, and
``action`` on autoscale decisions: add, retire):

==========================================  ========  =====================================
``batchq_up``                               gauge     1 if the last read of Redis worked
``batchq_queue_depth_items``                gauge     LLEN of the data list
``batchq_queue_capacity_items``             gauge     the run's hwm (0 before a producer)
``batchq_queue_depth_bytes``                gauge     bytes in the list (an estimate, see
                                                      :mod:`batchq.monitoring.rows`)
``batchq_queue_oldest_frame_age_seconds``   gauge     age of the oldest frame (0: empty)
``batchq_frames_pushed_total``              counter   frames pushed
``batchq_frames_popped_total``              counter   frames popped
``batchq_bytes_pushed_total``               counter   bytes pushed
``batchq_bytes_popped_total``               counter   bytes popped
``batchq_producers_alive``                  gauge     producers with a live heartbeat
``batchq_producers_blocked_seconds_total``  counter   time all producers spent blocked at
                                                      the hwm
``batchq_trainer_attached``                 gauge     1 while a trainer holds the queue
``batchq_trainer_wait_seconds``             histogram the trainer's wait per batch
``batchq_trainer_busy_seconds_total``       counter   the trainer's time between batches
``batchq_trainer_stall_ratio``              gauge     its recent stall fraction (only while
                                                      its figures are fresh)
``batchq_trainer_epoch``                    gauge     its current epoch (same condition)
``batchq_epochs_completed_total``           counter   epochs the trainer finished
``batchq_shards_done_total``                counter   shards fully pushed
``batchq_redone_shards_total``              counter   shards handed back to be rebuilt
``batchq_dead_frames_total``                counter   frames that failed validation
``batchq_producer_frames_pushed_total``     counter   per live producer: frames pushed
``batchq_producer_bytes_pushed_total``      counter   per live producer: bytes pushed
``batchq_producer_build_seconds_total``     counter   per live producer: pipeline time
``batchq_producer_blocked_seconds_total``   counter   per live producer: blocked at the hwm
``batchq_trainer_demand_batches_per_second`` gauge    batches/s the trainer would take if
                                                      it never waited (fresh figures only)
``batchq_supply_batches_per_second``        gauge     the live producers' summed pipeline
                                                      rate
``batchq_producer_rate_batches_per_second`` gauge     the observed rate of one producer
``batchq_recommended_producers``            gauge     producers that meet the demand
                                                      (batchq.monitoring.sizing; with the demand)
``batchq_autoscale_decisions_total``        counter   autoscaler decisions, label
                                                      ``action``: add, retire
``batchq_rank_depth_items``                 gauge     per rank of a data-parallel trainer
                                                      (label ``rank``): LLEN of its list
``batchq_rank_attached``                    gauge     per rank: 1 while it holds its claim
``batchq_rank_stall_ratio``                 gauge     per rank: its recent stall fraction
``batchq_rank_batches_per_second``          gauge     per rank: batches it took per second
``batchq_rank_epoch``                       gauge     per rank: its current epoch
``batchq_rank_verdict``                     gauge     per rank: 1, label ``verdict`` (the
                                                      status verdict of that rank alone)
``batchq_slowest_rank``                     gauge     the rank furthest behind
==========================================  ========  =====================================

The stall over any range is ``rate(batchq_trainer_wait_seconds_sum[r]) /
(rate(batchq_trainer_wait_seconds_sum[r]) + rate(batchq_trainer_busy_seconds_total[r]))``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from batchq.errors import ConfigError
from batchq.monitoring.rows import WAIT_BUCKETS_S, list_queues, row_from_snapshot
from batchq.monitoring.snapshot import read_snapshots

__all__ = ["METRIC_NAMES", "BatchqCollector", "MetricsServer", "start_exporter"]

log = logging.getLogger(__name__)

#: Every metric family the collector may expose (names without the sample suffixes).
METRIC_NAMES = (
    "batchq_up",
    "batchq_queue_depth_items",
    "batchq_queue_capacity_items",
    "batchq_queue_depth_bytes",
    "batchq_queue_oldest_frame_age_seconds",
    "batchq_frames_pushed",
    "batchq_frames_popped",
    "batchq_bytes_pushed",
    "batchq_bytes_popped",
    "batchq_producers_alive",
    "batchq_producers_blocked_seconds",
    "batchq_trainer_attached",
    "batchq_trainer_wait_seconds",
    "batchq_trainer_busy_seconds",
    "batchq_trainer_stall_ratio",
    "batchq_trainer_epoch",
    "batchq_epochs_completed",
    "batchq_shards_done",
    "batchq_redone_shards",
    "batchq_dead_frames",
    "batchq_producer_frames_pushed",
    "batchq_producer_bytes_pushed",
    "batchq_producer_build_seconds",
    "batchq_producer_blocked_seconds",
    "batchq_trainer_demand_batches_per_second",
    "batchq_supply_batches_per_second",
    "batchq_producer_rate_batches_per_second",
    "batchq_recommended_producers",
    "batchq_autoscale_decisions",
    "batchq_rank_depth_items",
    "batchq_rank_attached",
    "batchq_rank_stall_ratio",
    "batchq_rank_batches_per_second",
    "batchq_rank_epoch",
    "batchq_rank_verdict",
    "batchq_slowest_rank",
)

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
)
# Counters per live producer: (name, help, the producer object's field).
_PRODUCER_COUNTERS = (
    ("frames_pushed", "Frames this producer pushed", "batches"),
    ("bytes_pushed", "Bytes this producer pushed", "bytes"),
    ("build_seconds", "Time this producer's pipeline spent building batches", "build_s"),
    ("blocked_seconds", "Time this producer spent blocked at the hwm", "blocked_s"),
)
_BOUNDS = [repr(b) for b in WAIT_BUCKETS_S] + ["+Inf"]


class BatchqCollector:
    """A prometheus-client collector reading the queues on every scrape.

    Every value is a field of the queue's status row (:mod:`batchq.monitoring.rows`): a figure
    is computed once, there, for ``status``, ``top``, ``report`` and this exporter.

    Args:
        client: a Redis client returning bytes (thread-safe: scrapes may overlap).
        queues: the queues to export; empty or None: every queue on the server, found
            with SCAN on each scrape.
    """

    def __init__(self, client: redis.Redis, queues: Sequence[str] | None = None) -> None:
        self.client = client
        self.queues = list(queues or [])

    def describe(self) -> Iterable[Metric]:
        """Nothing up front: registering must not read Redis."""
        return []

    def collect(self) -> Iterable[Metric]:
        """Read Redis and yield the metric families (``batchq_up`` 0 if it failed)."""
        up = GaugeMetricFamily("batchq_up", "1 if the last read of Redis succeeded, else 0")
        try:
            names = self.queues or list_queues(self.client)
            # 20 history samples: the recent per-producer rate (batchq.monitoring.sizing).
            snaps = read_snapshots(self.client, names, history=20, leases=False)
        except (redis.RedisError, OSError) as e:
            log.warning("batchq exporter: reading Redis failed: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        rows = [row_from_snapshot(snap) for snap in snaps]
        yield from _queue_families(rows)
        yield from _rank_families(rows)
        yield from _producer_families(rows)


def _queue_families(rows: list[Row]) -> Iterable[Metric]:
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


def _producer_families(rows: list[Row]) -> Iterable[Metric]:
    """The per-producer counters (label ``producer``) of the live producers."""
    fams = [
        (CounterMetricFamily(f"batchq_producer_{n}", doc, labels=_QP), field)
        for n, doc, field in _PRODUCER_COUNTERS
    ]
    for row in rows:
        for prod in row["producers"]:
            for fam, field in fams:
                fam.add_metric([row["queue"], prod["id"]], prod[field])
    yield from (fam for fam, _ in fams)


def _rank_families(rows: list[Row]) -> Iterable[Metric]:
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


class MetricsServer:
    """A running ``/metrics`` endpoint (see :func:`start_exporter`).

    Attributes:
        host: the address it is bound to.
        port: the TCP port it listens on.
    """

    def __init__(self, server: Any, thread: threading.Thread, host: str) -> None:
        self._server, self._thread = server, thread
        self.host = host
        self.port = int(server.server_port)

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_exporter(
    client: redis.Redis,
    *,
    port: int,
    host: str = "127.0.0.1",
    queues: Sequence[str] | None = None,
) -> MetricsServer:
    """Serve ``/metrics`` on ``host:port`` in a background thread.

    Args:
        client: the Redis client the collector reads with.
        port: the TCP port (0: any free port; see ``MetricsServer.port``).
        host: the address to bind.
        queues: the queues to export (None or empty: every queue).

    Returns:
        The running server; ``close()`` it.

    Raises:
        ConfigError: the port is out of range, or the address cannot be bound (in use,
            not an address of this host, no permission).
    """
    if not isinstance(port, int) or not 0 <= port < 65536:
        raise ConfigError(f"port {port!r} is not valid: expected an integer in 0..65535")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BatchqCollector(client, queues))
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e}") from e
    return MetricsServer(server, thread, host)

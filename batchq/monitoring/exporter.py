"""A Prometheus exporter: the queues' state, read from Redis on every scrape.

Needs ``prometheus-client`` (``pip install 'batchq[exporter]'``). :class:`BatchqCollector`
reads every queue (or the ones named) with :func:`batchq.monitoring.snapshot.read_snapshots`: one
pipelined round trip for all of them, plus a GETRANGE round trip only when the oldest
element of a queue is a reference to a large frame. Nothing is cached between scrapes
and nothing is written.

The families are built from the rows by :mod:`batchq.monitoring.metric_families` (its
tables: metric -> row field).

Metrics (base units; labels ``queue``, ``producer``, ``rank`` and ``group``, plus ``le`` on
the histogram's buckets, ``reason`` on dead frames, a closed set: the codec's FrameError
reasons, and ``action`` on autoscale decisions: add, retire):

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
``batchq_quarantined_examples_total``       counter   examples the dataset could not read,
                                                      replaced by substitutes
                                                      (on_sample_error='quarantine'; each
                                                      once per run; `batchq dead` lists
                                                      the run's)
``batchq_run_quarantined_examples``         gauge     those of the queue's current run
                                                      (0 for a run without any)
``batchq_rebuilt_params_frames_total``      counter   frames built with params a later
                                                      set_params made stale, built again
``batchq_lookahead_batches``                gauge     the run's look-ahead D (set_params'
                                                      default distance, batch indices)
``batchq_trainer_first_batch_seconds``      gauge     the trainer's time from its stream's
                                                      first iteration to its first batch
``batchq_dead_frames_total``                counter   frames that failed validation
``batchq_producer_frames_pushed_total``     counter   per live producer: frames pushed
``batchq_producer_bytes_pushed_total``      counter   per live producer: bytes pushed
``batchq_producer_build_seconds_total``     counter   per live producer: pipeline time
``batchq_producer_blocked_seconds_total``   counter   per live producer: blocked at the hwm
``batchq_producer_cache_hits_total``        counter   per live producer that caches a stage
                                                      (producer.torch.cached): examples read
                                                      from the cache
``batchq_producer_cache_misses_total``      counter   per such producer: examples built
``batchq_producer_cache_saved_seconds_total`` counter per such producer: build time its
                                                      hits saved, less their reads
``batchq_cache_hit_ratio``                  gauge     hits over examples, the live producers
                                                      that cache (absent when none does)
``batchq_cache_bytes``                      gauge     bytes their cache directories hold
                                                      (the largest figure per host, summed)
``batchq_producer_first_push_seconds``      gauge     per live producer: from its start
                                                      (process or fork) to its first push
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
``batchq_group_depth_items``                gauge     per group of a run read by several
                                                      (label ``group``): its list(s)' items
``batchq_group_attached``                   gauge     per group: 1 while it holds its claim
``batchq_group_detached``                   gauge     per group: 1 while its batches are
                                                      built for it alone
``batchq_group_lag_batches``                gauge     per group: batches behind the leader
``batchq_group_stall_ratio``                gauge     per group: its recent stall fraction
``batchq_group_batches_per_second``         gauge     per group: batches it took per second
``batchq_group_epoch``                      gauge     per group: its current epoch
``batchq_group_solo_builds_total``          counter   per group: frames built for it alone
==========================================  ========  =====================================

The build time the caches saved per batch over a range is
``sum(rate(batchq_producer_cache_saved_seconds_total[r])) /
sum(rate(batchq_producer_frames_pushed_total[r]) and on(queue, producer)
batchq_producer_cache_hits_total)`` (the frames of the producers that cache; ``status``
and ``report`` show it as ``cache_saved_ms_per_batch``), and the quarantined examples
of an earlier run are ``increase(batchq_quarantined_examples_total[r])`` over its range
(the current run's: ``batchq_run_quarantined_examples``).

The stall over any range is ``rate(batchq_trainer_wait_seconds_sum[r]) /
(rate(batchq_trainer_wait_seconds_sum[r]) + rate(batchq_trainer_busy_seconds_total[r]))``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from batchq.errors import ConfigError, ConnectionLost
from batchq.monitoring.metric_families import (
    group_families,
    producer_families,
    queue_families,
    rank_families,
)
from batchq.monitoring.rows import list_queues, row_from_snapshot
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
    "batchq_quarantined_examples",
    "batchq_run_quarantined_examples",
    "batchq_rebuilt_params_frames",
    "batchq_lookahead_batches",
    "batchq_trainer_first_batch_seconds",
    "batchq_dead_frames",
    "batchq_producer_frames_pushed",
    "batchq_producer_bytes_pushed",
    "batchq_producer_build_seconds",
    "batchq_producer_blocked_seconds",
    "batchq_producer_cache_hits",
    "batchq_producer_cache_misses",
    "batchq_producer_cache_saved_seconds",
    "batchq_cache_hit_ratio",
    "batchq_cache_bytes",
    "batchq_producer_first_push_seconds",
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
    "batchq_group_depth_items",
    "batchq_group_attached",
    "batchq_group_detached",
    "batchq_group_lag_batches",
    "batchq_group_stall_ratio",
    "batchq_group_batches_per_second",
    "batchq_group_epoch",
    "batchq_group_solo_builds",
)


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
        except (redis.RedisError, OSError, ConnectionLost) as e:
            log.warning("batchq exporter: reading Redis failed: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        rows = [row_from_snapshot(snap) for snap in snaps]
        yield from queue_families(rows)
        yield from rank_families(rows)
        yield from group_families(rows)
        yield from producer_families(rows)


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

"""The figures ``stream.stats`` shows: the trainer's own (how long it waits for data, and
how long it works), and the run's beyond them.

For every batch the iterator hands out it records the wait (from the caller asking for
the batch to having it: the data stall) and the work before it (from the previous batch
being handed out to this one being asked for: the trainer's own step). From these:
the stall fraction of the last epoch and of the last N batches, wait percentiles,
batches/s and MB/s; and ``first_batch_s``, the time from the stream's first iteration
(its first epoch asked for: connecting, claiming the run, waiting for producers
included) to the first batch handed out, None before it. The reader thread drains the
counters into its next pop script call (no extra round trip), so ``batchq status``,
``top`` and the exporter see them too.

What the reader owes the queue's figures it sends without a round trip of its own
(:class:`Accounting`). The pop script carries the accounting (docs/design.md,
"Accounting"): the frames popped outside it (a BRPOP alone) and the bytes received
since its last call, and the trainer's figures (:meth:`TrainerStats.drain`). Each is
counted as sent before the call: if its reply is lost the script may have run, and
sending them again would count them twice (an undercount is the lesser harm). The
frames the ledger dropped past the look-ahead window are counted apart, one HINCRBY when
there are new ones.

The run's figures beyond the trainer's own (:class:`RunFigures`): the live producers'
cache figures and the examples the run quarantined. Producers whose pipeline caches a
stage (``producer.torch.cached``) keep hits, misses, bytes held and build time saved in
their pstats counters (:class:`batchq.protocol.fields.ProducerStat`'s ``CACHE``, set by
their heartbeat); the run's quarantined examples are counted in its quarantine hash
(:func:`batchq.protocol.layout.read_quarantine`). ``stats`` may be read
every batch, so both are read at most once per :data:`REFRESH_S`: three commands in two
round trips.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any

import redis

from batchq.client.connection import redis_errors
from batchq.errors import ConnectionLost
from batchq.protocol.fields import (
    HistoryField,
    ProducerStat,
    StatsField,
    TrainerField,
    producer_stat_field,
)
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import (
    WAIT_BUCKETS_S,  # the histogram buckets (s); last is +Inf
    id_host,
    read_quarantine,
)

__all__ = ["REFRESH_S", "WAIT_BUCKETS_S", "Accounting", "RunFigures", "TrainerStats"]

log = logging.getLogger(__name__)


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


class Accounting:
    """One reader's figures not yet sent.

    Args:
        stats: the trainer's figures (shared with the iterator, which records into it).
    """

    def __init__(self, stats: TrainerStats) -> None:
        self.stats = stats
        self.extra_popped = 0  # frames a BRPOP alone took since the last pop script
        self.nbytes = 0  # bytes of frames received since the last pop script
        self.depth = 0  # the data list's length the last pop script saw
        self._ahead_counted = 0  # the ledger's dropped_ahead already added to the stats

    def for_pop(self, force: bool) -> tuple[list[Any], int, int]:
        """(figures, extra_popped, nbytes) for the next pop script, counted as sent.

        Args:
            force: the figures now, not about once a second (the last call, at close).
        """
        figures = self.stats.drain(self.depth, force=force)
        extra, nbytes = self.extra_popped, self.nbytes
        self.extra_popped = self.nbytes = 0
        return figures, extra, nbytes

    def count_ahead(self, client: redis.Redis, keys: QueueKeys, dropped: int) -> None:
        """Count the frames the ledger dropped past the look-ahead window since the last
        call in the queue's stats (``dropped_ahead``): one HINCRBY, only when there were.

        Such a frame is a shard the run had leased under a floor further ahead (a crashed
        trainer's; before a resume moved it back) and handed back; it is built again
        once the window reaches it, so this is a figure, not an error.

        Args:
            dropped: the ledger's count of such frames so far.

        Raises:
            ConnectionLost: the connection dropped (the count is then not sent again).
        """
        new = dropped - self._ahead_counted
        if new <= 0:
            return
        # Marked sent first: a lost reply then undercounts once instead of twice.
        self._ahead_counted = dropped
        log.info(
            "queue %s: %d frame(s) past the look-ahead window dropped (leased before the "
            "run's floor moved back); their shards are built again when due",
            keys.queue,
            new,
        )
        try:
            client.hincrby(keys.stats, StatsField.DROPPED_AHEAD, new)
        except redis_errors as e:
            raise ConnectionLost(f"Redis connection lost while counting frames: {e}") from e
        except redis.ResponseError as e:  # a foreign type under stats, or Redis full
            log.warning("queue %s: could not count dropped frames: %s", keys.queue, e)


#: Seconds between two reads of the run's figures.
REFRESH_S = 1.0


class RunFigures:
    """The live producers' cache figures and the run's quarantined count, read at most
    once per :data:`REFRESH_S` (the last ones meanwhile, and on a lost connection: they
    are figures for people)."""

    def __init__(self) -> None:
        self._read_at = -REFRESH_S
        self._cache: dict[str, Any] | None = None
        self._quarantined = 0

    def read(self, client: Any, keys: QueueKeys, run: str) -> tuple[dict[str, Any] | None, int]:
        """(cache, quarantined): ``cache`` is ``{hits, misses, hit_rate, bytes, saved_s,
        producers}`` summed over the producers that cache, ``bytes`` the largest figure
        per host summed over hosts (as ``batchq status``: a host's producers share its
        directory), None when none caches; ``quarantined`` the examples ``run``
        quarantined. None and 0 before the stream connected."""
        now = time.monotonic()
        if client is None or now - self._read_at < REFRESH_S:
            return self._cache, self._quarantined
        self._read_at = now
        try:
            self._quarantined = read_quarantine(client, keys, records=False).count_of(run)
            self._cache = _cache(client, keys)
        except (redis.RedisError, OSError):
            pass
        return self._cache, self._quarantined


def _cache(client: Any, keys: QueueKeys) -> dict[str, Any] | None:
    """The cache figures of the producers in the run's registry (two commands)."""
    listed = client.zrange(keys.producers, 0, -1)
    producers = [p.decode() if isinstance(p, bytes) else str(p) for p in listed]
    fields = [producer_stat_field(p, name) for p in producers for name in ProducerStat.CACHE]
    values = client.hmget(keys.pstats, fields) if fields else []
    n = len(ProducerStat.CACHE)
    rows = [values[i : i + n] for i in range(0, len(values), n)]
    caching = [
        (id_host(p), [int(v) for v in row])
        for p, row in zip(producers, rows, strict=True)
        if all(v is not None for v in row)
    ]
    if not caching:
        return None
    hits = sum(r[0] for _, r in caching)
    misses = sum(r[1] for _, r in caching)
    per_host: dict[str, int] = {}
    for host, r in caching:
        per_host[host] = max(per_host.get(host, 0), r[2])
    return {
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "bytes": sum(per_host.values()),
        "saved_s": sum(r[3] for _, r in caching) / 1000,
        "producers": len(caching),
    }

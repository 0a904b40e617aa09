"""A producer's heartbeat: a thread that keeps it alive in the run, reaps the dead, and
notices when no trainer has claimed the run for too long.

It has its own client (a push blocked at the cap never delays a beat), and beats every
third of the heartbeat TTL: ZADD XX of the producer's deadline (a producer already
declared dead must join again, not revive), the reaping of producers past theirs
(:func:`batchq.protocol.reaper.reap_dead`), and the orphan check. It stops with the producer's
stop event.

It also writes the producer's own figures into the queue's pstats hash, so nothing is
added to a batch's path: its caches' (:func:`producer.cache_stage.process_totals`) and,
once, its time to its first push (:class:`FirstPush`: from its process's start, an
interpreter's start, imports and the factory included, or for a worker forked from a
warm pool from the fork, to its first frame in the list; ``<id>:first_push_ms``,
:attr:`batchq.protocol.fields.ProducerFigure.FIRST_PUSH_MS`), which ``batchq status``
shows per producer (``first_push_s``) and the exporter as
``batchq_producer_first_push_seconds``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import redis

from batchq.client.connection import StopEvent, make_client
from batchq.errors import BatchQueueError
from batchq.protocol.admin import is_oom
from batchq.protocol.fields import MetaField, ProducerFigure, ProducerStat, producer_stat_field
from batchq.protocol.groups import reader_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.reaper import reap_dead, record_client, server_ms
from producer.cache_stage import process_totals
from producer.serving.membership import RunPosition

__all__ = ["BEATS_PER_TTL", "FirstPush", "Heartbeat", "process_started_s"]

log = logging.getLogger(__name__)

# Beats per heartbeat TTL: two may be lost (a slow Redis, a GC pause) before the
# producer is declared dead.
BEATS_PER_TTL = 3


class Heartbeat:
    """The heartbeat of one producer.

    Args:
        url: the Redis URL (the thread opens its own client).
        keys: the queue's keys.
        producer: the producer's id.
        heartbeat_ttl_ms: the producer is declared dead this long after its last beat.
        position: the run the producer serves at first (its incarnation and world are
            read); each join hands over the next one (:meth:`follow`).
        stop: the producer's stop event: ends the thread; set here when orphaned.
        orphan_exit_s: stop the producer once no trainer has held a live claim on the
            run for this long; None: never.
        first_push: the producer's start and first push; the beat after that push
            writes the figure (:class:`FirstPush`); None: not reported.
        on_beat: called with the heartbeat's client at every beat (a producer that
            quarantines learns the run's bad examples, :meth:`RunRecords.learn
            <producer.quarantine.RunRecords.learn>`); None: nothing.
    """

    def __init__(
        self,
        url: str,
        keys: QueueKeys,
        producer: str,
        heartbeat_ttl_ms: int,
        position: RunPosition,
        stop: StopEvent,
        orphan_exit_s: float | None,
        first_push: FirstPush | None = None,
        on_beat: Callable[[redis.Redis], None] | None = None,
    ) -> None:
        self.url = url
        self.on_beat = on_beat
        self.first_push = first_push
        self.keys = keys
        self.id = producer
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        self.orphan_exit_s = orphan_exit_s
        self.orphaned = False  # the producer stopped because no trainer claimed the run
        self._position = position
        self._position_lock = threading.Lock()  # follow() runs on the serving thread
        self._stop = stop
        self._unclaimed_since_ms: int | None = None  # server clock
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start beating (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="batchq-heartbeat", daemon=True)
            self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait for the thread, once the stop event is set."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def follow(self, position: RunPosition) -> None:
        """The producer joined (again): beat for ``position``'s run from now on."""
        with self._position_lock:
            self._position = position

    def position(self) -> RunPosition:
        """The run the producer serves, as its last join handed it over."""
        with self._position_lock:
            return self._position

    def run(self) -> None:
        """The thread's loop: beat, reap, check for an orphaned run, until stopped."""
        client = make_client(self.url, key=self.keys.meta)
        interval_s = self.heartbeat_ttl_ms / 1000 / BEATS_PER_TTL
        record = True  # the heartbeat's CLIENT ID, re-recorded each beat (it may reconnect)
        while True:
            if record:
                try:
                    record = record_client(client, self.keys, f"{self.id}:hb")
                except (redis.RedisError, OSError, BatchQueueError) as e:
                    log.debug("producer %s: client id not recorded: %s", self.id, e)
            if self._stop.wait(interval_s):
                break
            try:
                now_ms = server_ms(client)
                deadline_ms = now_ms + self.heartbeat_ttl_ms
                client.zadd(self.keys.producers, {self.id: deadline_ms}, xx=True)
                if self.first_push is not None:
                    self.first_push.write(client, self.keys, self.id)
                reap_dead(client, self.keys, self.position().incarnation, now_ms)
                self.check_orphaned(client, now_ms)
                self.record_cache(client)
                if self.on_beat is not None:
                    self.on_beat(client)
            except (redis.RedisError, OSError, BatchQueueError) as e:
                # At maxmemory the heartbeat is refused too; pushes report that once.
                level = logging.DEBUG if is_oom(e) else logging.WARNING
                log.log(level, "producer %s: heartbeat failed: %s", self.id, e)
        try:
            self.record_cache(client)  # the last figures, as the producer stops
        except (redis.RedisError, OSError, BatchQueueError) as e:
            log.debug("producer %s: cache figures not recorded: %s", self.id, e)
        client.close()

    def record_cache(self, client: redis.Redis) -> None:
        """Set this process's cache figures (:func:`producer.cache_stage.process_totals`) in the
        producer's counters (``ProducerStat.CACHE``); nothing when it caches nothing."""
        totals = process_totals()
        if totals is None:
            return
        values = (totals.hits, totals.misses, totals.bytes_held, round(totals.saved_s * 1000))
        client.hset(
            self.keys.pstats,
            mapping={
                producer_stat_field(self.id, name): value
                for name, value in zip(ProducerStat.CACHE, values, strict=True)
            },
        )

    def check_orphaned(self, client: redis.Redis, now_ms: int) -> None:
        """Stop the producer once no trainer has held a live claim on the run for
        orphan_exit_s (``now_ms``: the server's clock).

        A crashed trainer leaves its run for a restarted one to resume, which is right,
        but not for ever: producers of an abandoned run would serve (and hold memory in
        Redis) until someone kills them.
        """
        if self.orphan_exit_s is None:
            return
        position = self.position()
        fields = [
            reader_field(MetaField.CLAIM_DEADLINE, slot, r, world)
            for slot, world in enumerate(position.slot_worlds())
            for r in range(world)
        ]  # every rank of every group reading the run
        deadlines = client.hmget(self.keys.meta, fields)
        if any(d and int(d) > now_ms for d in deadlines):
            self._unclaimed_since_ms = None
            return
        if self._unclaimed_since_ms is None:
            self._unclaimed_since_ms = now_ms
            return
        if now_ms - self._unclaimed_since_ms >= self.orphan_exit_s * 1000:
            log.warning(
                "producer %s: no trainer has claimed the run of queue %s for %g s "
                "(--orphan-exit-s); exiting",
                self.id,
                self.keys.queue,
                self.orphan_exit_s,
            )
            self.orphaned = True
            self._stop.set()


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

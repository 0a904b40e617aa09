"""What the reader repairs or waits out: producers that died, shards nobody will deliver,
and a queue key a foreign writer replaced.

While the trainer waits, the reader looks after the producers it waits for:

- every REAP_CLOSED_S (REAP_IDLE_S while the trainer does not wait) it reaps producers
  whose Redis connections all closed (killed): Redis knows at once that a killed
  process's sockets closed, and waiting for the heartbeat TTL would stall the trainer
  for seconds (a hung producer is left to the TTL: its sockets stay open);
- after ``stall_s`` without a frame it reaps the dead (heartbeat lapsed) and hands the
  shards in the look-ahead window that have a gap back to the work list;
- after ``timeout_s`` with no producer alive it raises
  :class:`~batchq.errors.ProducersLost`.

A :class:`StallRepair` is given its inputs (client, keys, the session, the buffer, the
reader's settings) and keeps its own clocks; the reader tells it when a frame arrived
and when a pop script saw producers alive.

A queue key a foreign writer replaced by another type is waited out (bounded), then
:class:`~batchq.errors.WrongKeyType`. A :class:`KeyGuard` is given what it needs (the
queue's name, the bound, the reader's stop event) and keeps one fact: since when a key
has been of the wrong type. The pop script names such a key in its reply; a reap or
requeue script meets one as a Redis error. Either way the reader waits there, and the
next successful pop clears it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import redis

from batchq.errors import ProducersLost, WrongKeyType
from batchq.protocol.keys import KEY_TYPES, QueueKeys
from batchq.protocol.reaper import reap_dead, reap_gone, requeue_gaps
from consumer.plan import ReaderBuffer, RunView
from consumer.stream_options import ReaderSettings

__all__ = ["REAP_CLOSED_S", "REAP_IDLE_S", "WAIT_S", "KeyGuard", "StallRepair"]

log = logging.getLogger(__name__)

# While the trainer waits this long without a frame, look for producers whose
# connections closed (batchq.protocol.reaper.reap_gone), and again every as long.
REAP_CLOSED_S = 0.1
REAP_IDLE_S = 0.25  # and this often while it does not wait


@dataclass(eq=False)
class StallRepair:
    """One reader's watch over the producers it waits for.

    Attributes:
        client: the reader's client.
        keys: the queue's keys (the reader's: the group slot's, once it reads one).
        session: the trainer's claim (incarnation, run, rank, plan).
        buffer: the trainer's buffer (whether the iterator waits, what is missing).
        settings: the reader's settings (timeout_s, stall_s, layout).
        last_frame, last_alive: when frames last arrived, when a pop script last saw a
            producer alive (monotonic; both start at the repair's creation).
        last_repair, last_gone: when it last repaired, when it last looked for closed
            producers.
        no_client_list: CLIENT LIST was refused (ACL): the TTL alone tells.
    """

    client: redis.Redis
    keys: QueueKeys
    session: RunView
    buffer: ReaderBuffer
    settings: ReaderSettings
    last_frame: float = field(init=False)
    last_alive: float = field(init=False)
    last_repair: float = field(init=False, default=0.0)
    last_gone: float = field(init=False, default=0.0)
    no_client_list: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.last_frame = self.last_alive = time.monotonic()

    def frames_arrived(self) -> None:
        self.last_frame = time.monotonic()

    def producers_alive(self) -> None:
        self.last_alive = time.monotonic()

    def reap_closed(self) -> None:
        """Reap producers whose connections all closed (killed): every REAP_CLOSED_S
        while the trainer waits, every REAP_IDLE_S otherwise."""
        since = self.buffer.waited_since()
        now = time.monotonic()
        if self.no_client_list or not self._reap_due(since, now):
            return
        self.last_gone = now
        if reap_gone(self.client, self.keys, self.session.incarnation) is None:
            self.no_client_list = True
            log.info("queue %s: CLIENT LIST refused; dead producers found by TTL", self.keys.queue)

    def _reap_due(self, since: float | None, now: float) -> bool:
        if since is None or now - max(self.last_frame, since) < REAP_CLOSED_S:
            # Not stalled: look now and then anyway, so that a killed producer's shard
            # is redone before the trainer reaches it.
            return now - self.last_gone >= REAP_IDLE_S
        return now - self.last_gone >= REAP_CLOSED_S

    def check(self) -> None:
        """A pop found nothing: while the trainer waits, give up on producers silent for
        timeout_s, or repair after stall_s without a frame.

        Raises:
            ProducersLost: no producer alive for timeout_s.
        """
        if self.buffer.waited_since() is None:
            return
        now = time.monotonic()
        if now - self.last_alive > self.settings.options.timeout_s:
            epoch, missing = self.buffer.missing()
            raise ProducersLost(
                epoch, missing, self.settings.options.timeout_s, queue=self.keys.queue
            )
        stall_s = self.settings.options.stall_s
        if now - self.last_frame > stall_s and now - self.last_repair > stall_s:
            self.repair()

    def repair(self) -> None:
        """After a stall: reap dead producers, then requeue shards nobody will deliver."""
        self.last_repair = time.monotonic()
        s = self.session
        reap_dead(self.client, self.keys, s.incarnation)
        candidates = self.buffer.incomplete(s.plan.window if s.plan else 1)
        layout = self.settings.layout
        if layout is None and s.slot == 0:
            requeue_gaps(self.client, self.keys, s.incarnation, s.run, candidates)
            return
        # A rank (or a group slot > 0) asks in global slot numbers, checked against its
        # own counter; a group's shards go back for it alone.
        requeue_gaps(
            self.client,
            self.keys,
            s.incarnation,
            s.run,
            candidates if layout is None else [layout.to_global(n, s.rank) for n in candidates],
            rank=(s.data_key, f"next{s.suffix}", candidates),
            mask=1 << s.slot,
        )


# How long a replaced key is waited for between checks.
WAIT_S = 0.2


class KeyGuard:
    """Waits out a replaced queue key, for at most ``timeout_s`` in all.

    Args:
        queue: the queue's name (for messages).
        timeout_s: how long a key may stay of the wrong type.
        halt: the reader's stop event (a wait ends when it is set).
    """

    def __init__(self, queue: str, timeout_s: float, halt: threading.Event) -> None:
        self.queue = queue
        self.timeout_s = timeout_s
        self.halt = halt
        self.since: float | None = None  # since when a key is of the wrong type

    def wrong_type(self, key: str, got: str) -> None:
        """A queue key was replaced by another type: wait for a repair, bounded.

        Raises:
            WrongKeyType: it stayed so for timeout_s.
        """
        now = time.monotonic()
        expected = KEY_TYPES.get(key.rsplit(":", 1)[-1], "type batchq wrote")
        if self.since is None:
            self.since = now
            log.warning(
                "queue %s: %s is a %s, not a %s; waiting up to %g s for it to be repaired",
                self.queue,
                key,
                got,
                expected,
                self.timeout_s,
            )
        if now - self.since > self.timeout_s:
            raise WrongKeyType(key, expected, got, f"for {self.timeout_s:g} s")
        self.halt.wait(WAIT_S)

    def repaired(self) -> None:
        """The keys were of their types again (a pop script went through)."""
        self.since = None

"""The reader's defences against faults: replaced keys and killed producers.

:class:`ReaderGuards` is mixed into :class:`consumer.reader.thread.Reader`: waiting out a queue
key that a foreign writer replaced by another type (bounded, then
:class:`~batchq.errors.WrongKeyType`), reaping producers whose Redis connections all
closed (killed) without waiting for their heartbeat TTL, and counting the frames dropped
past the look-ahead window (shards a crashed run had leased, built again).
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from batchq.client.connection import is_wrong_type, redis_errors
from batchq.errors import ConnectionLost, FrameError, WrongKeyType
from batchq.protocol.fields import StatsField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.reaper import reap_gone
from consumer.reader.buffer import Buffer
from consumer.reader.ledger import Ledger
from consumer.session import Session

__all__ = ["REAP_CLOSED_S", "REAP_IDLE_S", "ReaderGuards", "ref_error"]

log = logging.getLogger(__name__)

# While the trainer waits this long without a frame, look for producers whose
# connections closed (batchq.protocol.reaper.reap_gone), and again every as long.
REAP_CLOSED_S = 0.1
REAP_IDLE_S = 0.25  # and this often while it does not wait
# How long a replaced key is waited for between checks.
WAIT_S = 0.2

# The Redis type of each key pop.lua checks, by the key's last part.
_EXPECTED = {"meta": "hash", "incarnation": "string", "data": "list"}


class ReaderGuards:
    """Replaced keys and killed producers; mixed into :class:`consumer.reader.thread.Reader`."""

    # Set by Reader.__init__.
    client: redis.Redis
    keys: QueueKeys
    session: Session
    cond: threading.Condition
    timeout_s: float
    buffer: Buffer
    ledger: Ledger
    _halt: threading.Event
    _last_frame: float
    _wrong_since: float | None
    _last_gone: float
    _no_client_list: bool
    _ahead_counted: int

    def _wrong_type(self, key: str, got: str) -> None:
        """A queue key was replaced by another type: wait for a repair, bounded.

        Raises:
            WrongKeyType: it stayed so for timeout_s.
        """
        now = time.monotonic()
        expected = _EXPECTED.get(key.rsplit(":", 1)[-1], "type batchq wrote")
        if self._wrong_since is None:
            self._wrong_since = now
            log.warning(
                "queue %s: %s is a %s, not a %s; waiting up to %g s for it to be repaired",
                self.keys.queue,
                key,
                got,
                expected,
                self.timeout_s,
            )
        if now - self._wrong_since > self.timeout_s:
            raise WrongKeyType(key, expected, got, f"for {self.timeout_s:g} s")
        self._halt.wait(WAIT_S)

    def _reap_closed(self) -> None:
        """Reap producers whose connections all closed (killed): every REAP_CLOSED_S
        while the trainer waits, every REAP_IDLE_S otherwise.

        Redis knows at once that a killed process's sockets closed; waiting for the
        heartbeat TTL would stall the trainer for seconds. A hung producer is left to the
        TTL (its sockets stay open).
        """
        with self.cond:
            since = self.buffer.waiting_since
        now = time.monotonic()
        if self._no_client_list:
            return
        if since is None or now - max(self._last_frame, since) < REAP_CLOSED_S:
            # Not stalled: look now and then anyway, so that a killed producer's shard
            # is redone before the trainer reaches it.
            if now - self._last_gone < REAP_IDLE_S:
                return
        elif now - self._last_gone < REAP_CLOSED_S:
            return
        self._last_gone = now
        if reap_gone(self.client, self.keys, self.session.incarnation) is None:
            self._no_client_list = True  # refused (ACL): the TTL alone tells death
            log.info("queue %s: CLIENT LIST refused; dead producers found by TTL", self.keys.queue)

    def _count_ahead(self) -> None:
        """Count the frames the ledger dropped past the look-ahead window since the last
        call in the queue's stats (``dropped_ahead``): one HINCRBY, only when there were.

        Such a frame is a shard the run had leased under a floor further ahead (a crashed
        trainer's; before a resume moved it back) and handed back; it is built again
        once the window reaches it, so this is a figure, not an error.

        Raises:
            ConnectionLost: the connection dropped (the count is then not sent again).
        """
        dropped = self.ledger.dropped_ahead  # written by this thread only (Buffer.put)
        new = dropped - self._ahead_counted
        if new <= 0:
            return
        # Marked sent first: a lost reply then undercounts once instead of twice.
        self._ahead_counted = dropped
        log.info(
            "queue %s: %d frame(s) past the look-ahead window dropped (leased before the "
            "run's floor moved back); their shards are built again when due",
            self.keys.queue,
            new,
        )
        try:
            self.client.hincrby(self.keys.stats, StatsField.DROPPED_AHEAD, new)
        except redis_errors as e:
            raise ConnectionLost(f"Redis connection lost while counting frames: {e}") from e
        except redis.ResponseError as e:  # a foreign type under stats, or Redis full
            log.warning("queue %s: could not count dropped frames: %s", self.keys.queue, e)


def ref_error(key: str, error: Exception) -> FrameError:
    """The bad frame for a reference whose key could not be read as a string.

    Raises:
        ConnectionLost: the error was the connection's.
    """
    if is_wrong_type(error):
        return FrameError(
            "wrong_type", f"frame key {key!r} holds another Redis type, expected a string"
        )
    if isinstance(error, redis_errors):
        raise ConnectionLost(f"Redis connection lost while fetching {key!r}: {error}") from error
    return FrameError("bad_ref", f"frame key {key!r} could not be read: {error}")

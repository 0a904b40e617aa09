"""What the reader owes the queue's figures, and sends without a round trip of its own.

The pop script carries the accounting (docs/design.md, "Accounting"): the frames popped
outside it (a BRPOP alone) and the bytes received since its last call, and the trainer's
figures (:meth:`consumer.stats.TrainerStats.drain`). Each is counted as sent before the
call: if its reply is lost the script may have run, and sending them again would count
them twice (an undercount is the lesser harm). The frames the ledger dropped past the
look-ahead window are counted apart, one HINCRBY when there are new ones.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from batchq.client.connection import redis_errors
from batchq.errors import ConnectionLost
from batchq.protocol.fields import StatsField
from batchq.protocol.keys import QueueKeys
from consumer.stats import TrainerStats

__all__ = ["Accounting"]

log = logging.getLogger(__name__)


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

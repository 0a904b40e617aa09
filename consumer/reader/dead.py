"""The dead list: where the reader moves an element it cannot use, with its reason.

Every bad element (a frame that fails validation, a reference that cannot be read, a
shared-memory descriptor that does not check out, an impossible frame) is recorded here,
counted in the queue's stats by reason, and then the trainer's policy applies:
``on_bad_frame='raise'`` raises the :class:`~batchq.errors.FrameError` (the iterator
raises it), ``'skip'`` goes on.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import redis

from batchq.errors import FrameError
from batchq.protocol.calls import execute_pipeline
from batchq.protocol.fields import dead_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import DEAD_CAP

__all__ = ["DeadList"]

log = logging.getLogger(__name__)


class DeadList:
    """Records one reader's bad elements.

    Args:
        client: the reader's client.
        keys: the queue's keys.
        on_bad_frame: 'raise' or 'skip'.
    """

    def __init__(self, client: redis.Redis, keys: QueueKeys, on_bad_frame: str) -> None:
        self.client = client
        self.keys = keys
        self.on_bad_frame = on_bad_frame
        self.count = 0  # bad elements recorded

    def record(self, element: bytes, error: FrameError) -> None:
        """Move a bad element to the dead list with its reason, count it, apply the policy.

        Raises:
            FrameError: ``error`` itself, under on_bad_frame='raise'.
            ConnectionLost: the connection dropped.
        """
        self.count += 1
        record = msgpack.packb(
            {"reason": error.reason, "detail": error.detail, "element": bytes(element[:4096])}
        )
        keys = self.keys

        def record_it(pipe: Any) -> None:
            pipe.lpush(keys.dead, record)
            pipe.ltrim(keys.dead, 0, DEAD_CAP - 1)
            pipe.hincrby(keys.stats, dead_field(error.reason), 1)

        try:  # a lost connection raises ConnectionLost (converted in calls.round_trip)
            execute_pipeline(self.client, record_it)
        except redis.ResponseError as e:
            # The dead list or the counters replaced by a foreign type (or Redis full):
            # the record is lost, the policy below still applies.
            log.warning("queue %s: could not record a bad frame: %s", self.keys.queue, e)
        log.warning("queue %s: bad frame moved to the dead list: %s", self.keys.queue, error)
        if self.on_bad_frame == "raise":
            raise error

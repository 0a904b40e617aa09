"""A served stream's quarantined examples, recorded in the run (quarantine.lua).

A producer serving a stream read with ``on_sample_error='quarantine'``
(:mod:`producer.quarantine`) binds :class:`RunRecords` to it: every example replaced by a
substitute goes into the run's quarantine hash (``batchq dead`` lists them, ``status`` and
``stream.stats`` count them), and the run's count bounds ``max_quarantined`` over every
producer. The records travel on a client of their own: an example is met while a batch
is built, which may happen while the serving thread's connection waits for a push's
reply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis

from batchq.client.connection import make_client
from batchq.errors import BatchQueueError
from batchq.protocol import producer_scripts
from batchq.protocol.keys import QueueKeys
from batchq.protocol.quarantine_records import read_quarantine
from batchq.protocol.words import Status
from producer.quarantine import LocalRecords, SampleErrors
from producer.serving.sharding import find_root

__all__ = ["RunRecords", "bind_records"]

log = logging.getLogger(__name__)


class RunRecords:
    """Quarantined examples recorded in the run a producer serves.

    Args:
        url: the queue's Redis.
        keys: the queue's keys.
        position: ``() -> (incarnation, run)`` of the run served now.
    """

    def __init__(self, url: str, keys: QueueKeys, position: Callable[[], tuple[str, str]]) -> None:
        self.url = url
        self.keys = keys
        self.position = position
        self.local = LocalRecords()  # what could not reach Redis still counts here
        self._client: redis.Redis | None = None

    def record(self, index: int, record: str) -> int:
        local = self.local.record(index, record)
        incarnation, run = self.position()
        try:
            reply = producer_scripts.quarantine(
                self.client, self.keys, incarnation=incarnation, run=run, index=index,
                record=record,
            )  # fmt: skip
        except (redis.RedisError, OSError, BatchQueueError) as e:
            log.warning("example %d: quarantine not recorded in Redis: %s", index, e)
            return local
        # Another run now (the shard is dropped anyway): this process's count.
        return reply.first if reply.status == Status.OK else local

    def listing(self, limit: int) -> list[dict[str, Any]]:
        try:
            found = read_quarantine(self.client, self.keys).records
        except (redis.RedisError, OSError, BatchQueueError) as e:
            log.warning("quarantined examples not read from Redis: %s", e)
            found = []
        return found[:limit] or self.local.listing(limit)

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = make_client(self.url, key=self.keys.meta)
        return self._client

    def close(self) -> None:
        """Close the records' client (made on the first record)."""
        if self._client is not None:
            self._client.close()
            self._client = None


def bind_records(
    stream: Any, url: str, keys: QueueKeys, producer: str, position: Callable[[], tuple[str, str]]
) -> RunRecords | None:
    """Bind the run's records to the stream's root where it quarantines examples
    (``sample_errors`` in 'quarantine' mode); None where it does not, or where a producer
    bound them already (a striped producer's lanes share the stream: stripe 0's, the
    first, records, where ``batchq dead --queue Q`` reads)."""
    errors = getattr(find_root(stream), "sample_errors", None)
    if not isinstance(errors, SampleErrors) or not errors.quarantine:
        return None
    if isinstance(errors.records, RunRecords):
        return None
    records = RunRecords(url, keys, position)
    errors.bind(records, producer)
    return records

"""Administering queues: deleting one queue's keys (and only those)."""

from __future__ import annotations

import redis

from batchq.connection import call
from batchq.keys import QueueKeys

__all__ = ["delete_queue"]


def delete_queue(client: redis.Redis, queue: str) -> int:
    """Delete every key of ``queue`` (``bq:{queue}:*``), in batches; returns how many.

    Keys of other queues are never touched: the pattern matches the queue's hash tag
    exactly (braces escaped), and nothing like FLUSHDB is used.
    """
    keys = QueueKeys(queue)
    found = call(lambda: list(client.scan_iter(match=keys.pattern, count=1000)), "scanning")
    chunks = [found[start : start + 500] for start in range(0, len(found), 500)]
    return sum(_delete(client, chunk) for chunk in chunks)


def _delete(client: redis.Redis, names: list[bytes]) -> int:
    return int(call(lambda: client.delete(*names), "deleting"))

"""Administering queues: deleting one queue's keys (and only those)."""

from __future__ import annotations

import logging

import redis

from batchq.client.connection import call
from batchq.protocol.keys import QueueKeys
from batchq.protocol.words import as_text

__all__ = ["check_eviction_policy", "delete_queue", "is_oom"]

log = logging.getLogger(__name__)


def is_oom(error: BaseException) -> bool:
    """True for Redis' "OOM command not allowed" (maxmemory reached under noeviction)."""
    # redis-py raises OutOfMemoryError for a plain command; a script's error comes back
    # as a ResponseError whose text carries the OOM message.
    if isinstance(error, redis.exceptions.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, redis.ResponseError) and (
        text.startswith("OOM") or "used memory > 'maxmemory'" in text
    )


def check_eviction_policy(client: redis.Redis) -> str | None:
    """Warn when Redis may evict queue keys; returns the policy (None if unreadable).

    With maxmemory set and any policy but noeviction, Redis deletes keys to make room:
    frames, leases or the run's meta could vanish. CONFIG may be forbidden (ACL, managed
    Redis); then nothing is said.
    """
    try:
        reply = client.config_get("maxmemory*")
    except redis.RedisError:
        return None
    policy = str(as_text(reply.get("maxmemory-policy", b"noeviction")))
    maxmemory = int(as_text(reply.get("maxmemory", b"0")) or 0)
    if maxmemory and policy != "noeviction":
        log.warning(
            "Redis maxmemory-policy is %r with maxmemory=%d: Redis may evict queue keys "
            "(frames, leases, the run's state); set maxmemory-policy noeviction",
            policy,
            maxmemory,
        )
    return policy


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

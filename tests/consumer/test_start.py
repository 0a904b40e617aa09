"""A run's start: old frames stored by reference are deleted, and only those."""

from __future__ import annotations

import redis

from batchq.protocol.keys import QueueKeys
from consumer import checkpoint, start
from consumer.start import DELETE_CHUNK, delete_old_frames


def test_old_frames_are_deleted_in_chunks_and_nothing_else(
    redis_client: redis.Redis, queue_name: str
) -> None:
    keys, other = QueueKeys(queue_name), QueueKeys(queue_name + "-other")
    names = [keys.frame("p1", i) for i in range(DELETE_CHUNK + 7)]  # two DELs
    redis_client.mset(dict.fromkeys(names, b"frame"))
    redis_client.set(other.frame("p1", 1), b"another queue's frame")
    redis_client.hset(keys.meta, "run", "r1")
    try:
        assert delete_old_frames(redis_client, keys, timeout_s=5.0) == len(names)
        assert redis_client.exists(*names) == 0
        assert redis_client.get(other.frame("p1", 1)) == b"another queue's frame"
        assert redis_client.hget(keys.meta, "run") == b"r1"
        assert delete_old_frames(redis_client, keys, timeout_s=5.0) == 0
    finally:
        redis_client.delete(other.frame("p1", 1))


def test_the_module_says_what_it_offers() -> None:
    assert start.__all__ == sorted(start.__all__)
    assert {"delete_old_frames", "open_reading"} <= set(start.__all__)
    assert {"resume_position", "Resumed"} <= set(checkpoint.__all__)

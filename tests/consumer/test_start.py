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
    names = [keys.frame("r0", "p1", i) for i in range(DELETE_CHUNK + 7)]  # two DELs
    redis_client.mset(dict.fromkeys(names, b"frame"))
    redis_client.set(other.frame("r0", "p1", 1), b"another queue's frame")
    redis_client.hset(keys.meta, "run", "r1")
    try:
        assert delete_old_frames(redis_client, keys, "r1", timeout_s=5.0) == len(names)
        assert redis_client.exists(*names) == 0
        assert redis_client.get(other.frame("r0", "p1", 1)) == b"another queue's frame"
        assert redis_client.hget(keys.meta, "run") == b"r1"
        assert delete_old_frames(redis_client, keys, "r1", timeout_s=5.0) == 0
    finally:
        redis_client.delete(other.frame("r0", "p1", 1))


def test_frames_of_the_run_read_stay_and_go_when_it_ended(
    redis_client: redis.Redis, queue_name: str
) -> None:
    # Before: a trainer's start deleted every frame of the queue, those of the run it
    # reads too; a producer let in by another group's claim had pushed some already, so
    # every group met missing_ref (CI: a striped run of two groups).
    keys = QueueKeys(queue_name)
    old, ours = keys.frame("r0", "p1", 1), keys.frame("r1", "p1", 1)
    longer = keys.frame("r10", "p1", 1)  # another run whose id starts like it
    redis_client.mset({old: b"old", ours: b"pushed already", longer: b"another"})
    assert delete_old_frames(redis_client, keys, "r1", timeout_s=5.0) == 2
    assert redis_client.get(ours) == b"pushed already"
    assert redis_client.exists(old, longer) == 0
    redis_client.set(old, b"old")  # left by a race of an older start: not the run's
    assert delete_old_frames(redis_client, keys, "r1", timeout_s=5.0, ended=True) == 1
    assert redis_client.get(old) == b"old" and redis_client.exists(ours) == 0


def test_the_module_says_what_it_offers() -> None:
    assert start.__all__ == sorted(start.__all__)
    assert {"delete_old_frames", "open_reading"} <= set(start.__all__)
    assert {"resume_position", "Resumed"} <= set(checkpoint.__all__)

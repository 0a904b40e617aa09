"""The heartbeat thread: it keeps a live producer's deadline ahead, never revives a dead
one, and stops with the producer's stop event."""

from __future__ import annotations

import threading

import redis
from waiting import wait_until

from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import rank_field
from producer.serving.heartbeat import Heartbeat
from producer.serving.membership import RunPosition

TTL_MS = 300


def _beat(url: str, keys: QueueKeys, producer: str, stop: threading.Event) -> Heartbeat:
    return Heartbeat(url, keys, producer, TTL_MS, RunPosition(), stop, orphan_exit_s=None)


def test_a_live_producer_is_kept_ahead_and_a_dead_one_not_revived(
    redis_url: str, redis_client: redis.Redis, queue_name: str
) -> None:
    keys = QueueKeys(queue_name)
    redis_client.zadd(keys.producers, {"alive": 1})
    stop = threading.Event()
    alive, dead = _beat(redis_url, keys, "alive", stop), _beat(redis_url, keys, "dead", stop)
    alive.start()
    dead.start()
    try:
        wait_until(lambda: (redis_client.zscore(keys.producers, "alive") or 0) > 1, 10.0, "a beat")
        # The heartbeat's own connection is recorded, so that a killed process is seen.
        wait_until(lambda: redis_client.hget(keys.clients, "alive:hb"), 10.0, "its client id")
        assert redis_client.zscore(keys.producers, "dead") is None  # XX: join again instead
    finally:
        stop.set()
        alive.join(timeout_s=5)
        dead.join(timeout_s=5)
    assert not any(t.name == "batchq-heartbeat" and t.is_alive() for t in threading.enumerate())


def test_without_orphan_exit_s_a_run_is_never_orphaned(
    redis_url: str, redis_client: redis.Redis, queue_name: str
) -> None:
    stop = threading.Event()
    beat = _beat(redis_url, QueueKeys(queue_name), "p", stop)
    for now_ms in (0, 10**9, 10**12):
        beat.check_orphaned(redis_client, now_ms)
    assert not beat.orphaned and not stop.is_set()


def test_the_heartbeat_follows_each_join(
    redis_url: str, redis_client: redis.Redis, queue_name: str
) -> None:
    keys = QueueKeys(queue_name)
    stop = threading.Event()
    beat = Heartbeat(redis_url, keys, "p", TTL_MS, RunPosition(), stop, orphan_exit_s=1.0)
    beat.follow(RunPosition("run", "inc", world=2))  # a join, on the serving thread
    redis_client.hset(keys.meta, rank_field(MetaField.CLAIM_DEADLINE, 1, 2), 10_000)
    for now_ms in (0, 5_000):  # rank 1 of the joined world claims the run until 10 s
        beat.check_orphaned(redis_client, now_ms)
    assert not beat.orphaned
    for now_ms in (20_000, 21_000):
        beat.check_orphaned(redis_client, now_ms)
    assert beat.orphaned and stop.is_set()

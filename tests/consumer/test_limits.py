"""Limits: Redis at maxmemory, oversized frames, an evicting maxmemory-policy."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import redis
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.errors import FrameError, ProducerFailed
from batchq.host.embedded import EmbeddedRedis
from batchq.protocol.calls import load_all
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream
from producer import Producer


def serve(url: str, queue: str, stream: Any, **options: Any) -> tuple[Producer, threading.Thread]:
    producer = Producer(stream, url, queue, **options)
    thread = threading.Thread(target=producer.serve, daemon=True)
    thread.start()
    return producer, thread


def test_redis_at_maxmemory_is_backpressure_not_a_crash(
    own_redis: EmbeddedRedis, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(own_redis.url)
    load_all(client)  # the scripts' text takes Redis memory too (~120 KB): not the frames'
    used = int(client.info("memory")["used_memory"])
    # Room for a few 320 KB frames, far below what hwm=40 would allow.
    client.config_set("maxmemory", used + 2_000_000)
    client.config_set("maxmemory-policy", "noeviction")
    caplog.set_level(logging.WARNING, logger="producer.server")
    stream = numbered(20000, 5000, shuffled=False)  # 5000 x 8 int64 = 320 KB per batch
    producer, thread = serve(own_redis.url, queue_name, stream, hwm=40)
    try:
        wait_until(lambda: producer.oom_waits > 0, what="the producer to meet maxmemory")
        assert thread.is_alive()
        with ServerDataStream(("features", "targets"), url=own_redis.url, queue=queue_name) as t:
            for _ in range(2):
                got = sorted(x for f, _ in t.get_epoch_iterator() for x in examples_of(f))
                assert got == list(range(20000))
            t.close(finished=True)
        thread.join(timeout=20)
        assert not thread.is_alive()
    finally:
        producer.stop()
        client.close()
    warnings = [r for r in caplog.records if "maxmemory" in r.getMessage()]
    assert len(warnings) == 1  # logged once, however often it waited


def test_producer_refuses_a_batch_above_max_frame_bytes(
    redis_url: str, queue_name: str, producer_thread: Any
) -> None:
    producer_thread(numbered(40, 20, shuffled=False), max_frame_bytes=1000, max_attempts=1)
    stream = ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name)
    with stream, pytest.raises(ProducerFailed, match="exceeds max_frame_bytes=1000"):
        next(iter(stream.get_epoch_iterator()))


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_trainer_refuses_oversized_frames_without_fetching_them(
    redis_url: str, queue_name: str, producer_thread: Any, redis_client: Any, policy: str
) -> None:
    keys = QueueKeys(queue_name)
    producer_thread(numbered(40, 20, shuffled=False), inline_max_bytes=100)
    stream = ServerDataStream(
        ("features", "targets"),
        url=redis_url,
        queue=queue_name,
        max_frame_bytes=500,
        on_bad_frame=policy,
        timeout_s=5,
    )
    if policy == "raise":
        with pytest.raises(FrameError, match="too_large"):
            next(iter(stream.get_epoch_iterator()))
    else:
        it = stream.get_epoch_iterator()
        wait_until(lambda: redis_client.llen(keys.dead) >= 2, what="dead frames")
        assert stream._reader is not None and stream._reader.is_alive()
        del it
    assert int(redis_client.hget(keys.stats, "dead:too_large")) >= 1
    stream.close()


def test_an_evicting_policy_is_warned_about(
    own_redis: EmbeddedRedis, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(own_redis.url)
    client.config_set("maxmemory", 100_000_000)
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.close()
    caplog.set_level(logging.WARNING, logger="batchq.protocol.admin")
    producer, thread = serve(own_redis.url, queue_name, numbered(40, 20), hwm=2)
    try:
        wait_until(
            lambda: any("allkeys-lru" in r.getMessage() for r in caplog.records),
            what="the warning",
        )
    finally:
        producer.stop()
        thread.join(timeout=10)

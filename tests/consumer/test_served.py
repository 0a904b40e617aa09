"""End to end on the real redis-server: producers (threads) feed a ServerDataStream."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis
from pipelines import FEATURES, FailOnExample, examples_of, numbered
from waiting import wait_until

from batchq.errors import FrameError, ProducerFailed, ProducersLost, TrainerConflict
from batchq.protocol.keys import QueueKeys
from batchq.wire import codec
from consumer import ServerDataStream

EPOCHS = 5


def flat(lists: Any) -> list[int]:
    return [x for batch in lists for x in batch]


def trainer(url: str, queue: str, **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 20)
    return ServerDataStream(("features", "targets"), False, url=url, queue=queue, **kw)


def test_five_epochs_exact_and_in_plan_order(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(200, 20))
    local = numbered(200, 20)
    with trainer(redis_url, queue_name) as stream:
        assert len(stream) == 10
        for epoch in range(EPOCHS):
            served = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
            assert stream.epoch == epoch
            expected = [examples_of(f) for f, _ in local.get_epoch_iterator()]
            assert served == expected  # the in-process order, batch by batch
            assert sorted(flat(served)) == list(range(200))  # each example once


def test_arrays_are_read_only_views_unless_writable(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(40, 20, shuffled=False))
    with trainer(redis_url, queue_name, writable=False) as stream:
        batch = next(iter(stream.get_epoch_iterator(as_dict=True)))
        assert set(batch) == {"features", "targets"}
        assert batch["features"].shape == (20, FEATURES)
        assert batch["features"].dtype == np.int64
        assert not batch["features"].flags.writeable
        np.testing.assert_array_equal(batch["targets"], np.arange(20))


def test_writable_gives_copies(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(40, 20, shuffled=False))
    with trainer(redis_url, queue_name, writable=True) as stream:
        features, _ = next(iter(stream.get_epoch_iterator()))
        features[0, 0] = -1  # would raise on a read-only view
        assert features.flags.writeable


def test_large_batches_travel_by_reference_and_leave_nothing(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any], redis_client: Any
) -> None:
    # 2 batches of 1000 x 8 int64 = 64 KB each plus targets: above the inline limit.
    producer_thread(numbered(2000, 1000, shuffled=False), inline_max_bytes=16 * 1024)
    with trainer(redis_url, queue_name) as stream:
        for _ in range(2):
            served = sorted(flat(examples_of(f) for f, _ in stream.get_epoch_iterator()))
            assert served == list(range(2000))
        stream.close(finished=True)
    keys = QueueKeys(queue_name)
    assert list(redis_client.scan_iter(match=keys.frame_pattern)) == []


def test_constructor_touches_nothing(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any], redis_client: Any
) -> None:
    producer_thread(numbered(200, 20), hwm=3)
    keys = QueueKeys(queue_name)
    wait_until(lambda: redis_client.llen(keys.data) == 3, what="the queue to fill")
    before = redis_client.lrange(keys.data, 0, -1)
    stream = trainer(redis_url, queue_name)
    assert redis_client.lrange(keys.data, 0, -1) == before
    assert redis_client.hget(keys.meta, "claim") is None
    stream.close()


def test_hwm_is_never_exceeded_and_a_waiting_producer_is_quiet(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Any],
    redis_client: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The producer's scripts and blocking pops, counted as its threads send them (the
    # server's own command counts would include other tests' running beside this one).
    sent: list[bytes] = []
    real_send = redis.connection.AbstractConnection.send_packed_command

    def send(conn: Any, command: Any, check_health: bool = True) -> None:
        if threading.current_thread() is not threading.main_thread():
            packed = command if isinstance(command, bytes) else b"".join(map(bytes, command))
            sent.append(packed.split(b"\r\n")[2].upper())
        real_send(conn, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
    producer_thread(numbered(400, 10), hwm=5)
    keys = QueueKeys(queue_name)
    wait_until(lambda: redis_client.llen(keys.data) == 5, what="the queue to fill")
    before = len(sent)
    t0 = time.monotonic()
    samples = [redis_client.llen(keys.data) for _ in range(300)]
    elapsed = time.monotonic() - t0
    theirs = sum(1 for name in sent[before:] if name in (b"EVALSHA", b"BLPOP"))
    assert max(samples) == 5
    # While it waits at the cap, measured against this run's own clock: a waiting
    # producer is not spinning.
    assert theirs <= 20 * elapsed + 4


def test_pipeline_error_reaches_the_trainer(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(FailOnExample(numbered(100, 10, shuffled=False), bad=35))
    with trainer(redis_url, queue_name) as stream:
        it = stream.get_epoch_iterator()
        got = [examples_of(f) for f, _ in (next(it) for _ in range(3))]
        assert got[0][0] == 0
        with pytest.raises(ProducerFailed) as info:
            next(it)
    assert info.value.epoch == 0 and info.value.shard == 3
    assert "example 35 is poisoned" in info.value.remote_traceback
    assert "RuntimeError" in str(info.value)


def test_no_producer_raises_producers_lost(redis_url: str, queue_name: str) -> None:
    with trainer(redis_url, queue_name, timeout_s=0.5) as stream, pytest.raises(ProducersLost):
        next(iter(stream.get_epoch_iterator()))


def test_second_trainer_conflicts_and_a_later_one_starts_a_new_run(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any], redis_client: Any
) -> None:
    producer_thread(numbered(100, 10))
    first = trainer(redis_url, queue_name)
    next(iter(first.get_epoch_iterator()))
    second = trainer(redis_url, queue_name)
    with pytest.raises(TrainerConflict):
        second.get_epoch_iterator()
    second.close()
    run1 = redis_client.hget(QueueKeys(queue_name).meta, "run")
    first.close()
    with trainer(redis_url, queue_name) as third:
        served = sorted(flat(examples_of(f) for f, _ in third.get_epoch_iterator()))
        assert served == list(range(100))  # a whole epoch 0 of the new run
        assert redis_client.hget(QueueKeys(queue_name).meta, "run") != run1


def test_bad_frames_are_skipped_by_policy_and_go_to_the_dead_list(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any], redis_client: Any
) -> None:
    keys = QueueKeys(queue_name)
    producer_thread(numbered(40, 20, shuffled=False), hwm=10)
    wait_until(lambda: redis_client.llen(keys.data) >= 2, what="frames")
    old = codec.encode_frame(
        codec.FrameHeader(codec.FrameKind.BATCH, run="old-run", epoch=0, shard=1, k=0, producer="x")
    )
    # The right end is popped first: these two come before the producer's frames.
    redis_client.rpush(keys.data, bytes(old), b"garbage that is no frame")
    with trainer(redis_url, queue_name, on_bad_frame="skip") as stream:
        served = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
    assert served == [list(range(20)), list(range(20, 40))]  # old run ignored, garbage skipped
    assert redis_client.llen(keys.dead) == 1
    assert redis_client.hget(keys.stats, "dead:bad_magic") == b"1"


def test_bad_frame_raises_frame_error(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any], redis_client: Any
) -> None:
    keys = QueueKeys(queue_name)
    producer_thread(numbered(40, 20, shuffled=False), hwm=10)
    wait_until(lambda: redis_client.llen(keys.data) >= 2, what="frames")
    with trainer(redis_url, queue_name) as stream:
        redis_client.rpush(keys.data, b"BQF\x63" + bytes(60))  # popped first (right end)
        with pytest.raises(FrameError, match="bad_version"):
            list(stream.get_epoch_iterator())


def test_redis_errors_are_not_leaked_when_the_server_is_unreachable() -> None:
    stream = ServerDataStream(("x",), url="redis://127.0.0.1:1/0", timeout_s=1)
    with pytest.raises(Exception) as info:
        stream.get_epoch_iterator()
    assert not isinstance(info.value, redis.RedisError)
    stream.close()


def test_a_producer_started_after_a_run_finished_serves_the_next_run(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    # A job run again at once (a sweep's next trial, a script run twice): its producer
    # starts after the last run finished, so it starts the queue's next run; a producer
    # of the finished job (started before its end) exits.
    local = numbered(40, 20)
    expected = [examples_of(f) for f, _ in local.get_epoch_iterator()]
    first = producer_thread(numbered(40, 20))
    with trainer(redis_url, queue_name) as stream:
        assert [examples_of(f) for f, _ in stream.get_epoch_iterator()] == expected
        stream.close(finished=True)
    late = producer_thread(numbered(40, 20), job_started_s=time.time() - 3600)
    wait_until(lambda: first.stopped and late.stopped, what="the first job's producers")
    producer_thread(numbered(40, 20))
    with trainer(redis_url, queue_name) as stream:
        assert [examples_of(f) for f, _ in stream.get_epoch_iterator()] == expected

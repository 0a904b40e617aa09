"""Frames through shared memory end to end: exact epochs, mixing, limits, leaks, hostility."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from pipelines import FEATURES, examples_of, numbered
from small_tmpfs import small_tmpfs
from waiting import wait_until

from batchq.cli import main
from batchq.host.embedded import EmbeddedRedis
from batchq.monitoring.rows import queue_status
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.wire import shm
from consumer import ServerDataStream
from producer import Producer
from producer.serving.shm_pool import SegmentPool
from producer.serving.transport import pool_size

pytestmark = pytest.mark.skipif(shm.host_identity() is None, reason="no writable /dev/shm")

SUPPORT_DIR = Path(__file__).resolve().parent.parent / "support"
EXAMPLES, BATCH = 200, 10  # 20 batches per epoch


def reference(epochs: int, examples: int = EXAMPLES, batch: int = BATCH) -> list[list[int]]:
    stream = numbered(examples, batch)
    return [examples_of(f) for _ in range(epochs) for f, _ in stream.get_epoch_iterator()]


def trainer(url: str, queue: str, **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 30)
    return ServerDataStream(("features", "targets"), url=url, queue=queue, **kw)


def segments(queue: str, folder: str = shm.DEFAULT_SHM_DIR) -> list[shm.SegmentName]:
    names = [shm.parse_segment_name(n) for n in os.listdir(folder)]
    return [n for n in names if n is not None and n.queue == queue]


def test_exact_epochs_through_shared_memory_and_bounded(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Producer], redis_client: Any
) -> None:
    keys = QueueKeys(queue_name)
    producer = producer_thread(numbered(EXAMPLES, BATCH), hwm=3)  # before the trainer
    wait_until(lambda: redis_client.llen(keys.data) == 3, what="the producer at the cap")
    got, most = [], 0
    with trainer(redis_url, queue_name) as stream:
        held = None
        for epoch in range(3):
            for features, _ in stream.get_epoch_iterator():
                got.append(examples_of(features))
                if held is None:
                    held = features  # kept across epochs: its segment must not be reused
                    held_copy = features.copy()
                most = max(most, len(segments(queue_name)))
            assert epoch == stream.epoch
            row = queue_status(redis_client, queue_name)  # status shows what shm holds
            assert row["shm_segments"] >= 1 and row["shm_bytes"] >= 4096 * row["shm_segments"]
        # The producer switched once the trainer published its host: only the frames
        # it had made before (the 3 queued, the one waiting at the cap) went by Redis,
        # and any that found every segment in use (the batch this test holds is one
        # more than the pool is sized for; a trainer keeping up never makes one).
        fallbacks = producer._transport.fallbacks
        assert producer._transport.shm_frames >= stream._shm.frames >= 60 - 4 - fallbacks
        assert held is not None
        np.testing.assert_array_equal(held, held_copy)
        assert redis_client.hget(QueueKeys(queue_name).meta, MetaField.SHM_HOST)
        stats = redis_client.hgetall(QueueKeys(queue_name).stats)
        assert int(stats[b"pushed_bytes"]) > 60 * BATCH * FEATURES * 8  # the batches' size
        stream.close(finished=True)
    assert got == reference(3)
    assert 1 <= most <= pool_size(3, 10, 1)  # the pool's cap: hwm 3, the trainer's look-ahead 10
    wait_until(lambda: not segments(queue_name), what="the finished run's segments to go")


def test_a_trainer_slower_than_its_producer_still_gets_every_frame_by_shm(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Producer], redis_client: Any
) -> None:
    # The steady state of a well-fed trainer: its look-ahead and the list full at every
    # step. The pool is sized for that (the trainer publishes its look-ahead), so no
    # frame falls back to Redis for want of a free segment.
    data = QueueKeys(queue_name).data
    with trainer(redis_url, queue_name, hwm=4) as stream:
        producer = producer_thread(numbered(EXAMPLES, BATCH), hwm=3)
        it = stream.get_epoch_iterator()
        got = [examples_of(next(it)[0])]
        # The producer started first: what it made before it saw the trainer's host went
        # through Redis (at most the batch taken, the look-ahead, the list and the one
        # at the cap). It looks at the host again after its first wait at the cap, so
        # the switch comes while this loop waits for full lists: not waited for here,
        # where nothing is consumed (a producer blocked at the cap with a frame made for
        # Redis would never make another).
        for features, _ in it:
            # Every batch held but this one and the one before it lies in a segment once
            # switched. (The producer goes on into the next epochs: both always fill.)
            wait_until(
                lambda: (
                    stream._buffer is not None
                    and stream._buffer.ledger.buffered >= 4
                    and redis_client.llen(data) >= 3
                ),
                what="the look-ahead and the list full",
            )
            got.append(examples_of(features))
        assert producer._transport.fallbacks == 0
        assert producer._transport.shm_frames >= 20 - (1 + 4 + 3 + 1 + 1)
        assert producer._transport.pool.max_segments == pool_size(3, 4, 1)
        stream.close(finished=True)
    assert got == reference(1)


def test_mixed_queue_one_by_shm_one_forced_through_redis(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Producer], redis_client: Any
) -> None:
    by_shm = producer_thread(numbered(EXAMPLES, BATCH), producer_id="by-shm")
    by_redis = producer_thread(numbered(EXAMPLES, BATCH), producer_id="by-redis", transport="redis")
    data = QueueKeys(queue_name).data
    wait_until(lambda: redis_client.llen(data) == 4, what="the producers at the cap")
    got = []
    with trainer(redis_url, queue_name) as stream:
        for _ in range(4):
            got += [examples_of(f) for f, _ in stream.get_epoch_iterator()]
        assert set(stream.producers_seen) == {"by-shm", "by-redis"}
        # The reader may already hold frames of the next epoch: count what was pushed.
        assert 0 < stream._shm.frames <= by_shm._transport.shm_frames
        stream.close(finished=True)
    assert got == reference(4)
    assert by_redis._transport.shm_frames == 0 and by_shm._transport.shm_frames > 0
    assert all(s.producer == "by-shm" for s in segments(queue_name))


def run_holding_batches(url: str, queue: str, epochs: int, **kw: Any) -> list[list[int]]:
    """Read epochs while keeping every batch referenced: the segments stay in use, so
    the producer's pool must grow until the folder (or its byte cap) is full."""
    got, held = [], []
    with trainer(url, queue, hwm=12, **kw) as stream:
        for _ in range(epochs):
            for features, _ in stream.get_epoch_iterator():
                got.append(examples_of(features))
                held.append(features)
        stream.close(finished=True)
    for features, expected in zip(held, got, strict=True):
        assert examples_of(features) == expected  # no segment was overwritten under a view
    return got


def test_full_folder_falls_back_to_redis_and_loses_nothing(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Producer],
    redis_client: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Batches of 100 x 8 int64 = 6.4 kB + header: a 64 kB folder holds a few segments.
    with small_tmpfs(tmp_path / "shm", 64 * 1024) as folder:
        with caplog.at_level(logging.WARNING, logger="producer.serving.transport"):
            producer = producer_thread(numbered(1000, 100), hwm=6, shm_dir=folder)
            data = QueueKeys(queue_name).data
            wait_until(lambda: redis_client.llen(data) == 6, what="the producer at the cap")
            got = run_holding_batches(redis_url, queue_name, 3, shm_dir=folder)
        assert got == reference(3, 1000, 100)
        assert producer._transport.shm_frames > 0 and producer._transport.fallbacks > 0
        assert caplog.text.count("no room in") == 1


def test_byte_cap_falls_back_to_redis_and_loses_nothing(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Producer], redis_client: Any
) -> None:
    producer = producer_thread(numbered(1000, 100), hwm=6, shm_max_bytes=3 * 8192)
    data = QueueKeys(queue_name).data
    wait_until(lambda: redis_client.llen(data) == 6, what="the producer at the cap")
    got = run_holding_batches(redis_url, queue_name, 3)
    assert got == reference(3, 1000, 100)
    assert producer._transport.shm_frames > 0 and producer._transport.fallbacks > 0


def test_trainer_opting_out_keeps_every_frame_in_redis(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Producer]
) -> None:
    producer = producer_thread(numbered(EXAMPLES, BATCH))
    with trainer(redis_url, queue_name, transport="redis") as stream:
        got = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
        stream.close(finished=True)
    assert got == reference(1)
    assert producer._transport.shm_frames == 0 and not segments(queue_name)


def test_hostile_descriptors_are_bad_frames_and_the_epoch_stays_exact(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Producer], redis_client: Any
) -> None:
    keys = QueueKeys(queue_name)
    producer_thread(numbered(EXAMPLES, BATCH))
    ident = shm.host_identity() or ""
    seg = shm.segment_name(queue_name, "ab12", "evil", 1)
    hostile = [
        shm.encode_descriptor("../../etc/passwd", 1, 100, ident),
        shm.encode_descriptor(seg, 1, 100, ident),  # missing
        shm.encode_descriptor(seg, 1, 100, "another-host:1:2"),
        shm.DESCRIPTOR_MAGIC + b"\x93garbage",
    ]
    got = []
    with trainer(redis_url, queue_name, on_bad_frame="skip") as stream:
        it = stream.get_epoch_iterator()
        got.append(examples_of(next(it)[0]))
        redis_client.rpush(keys.data, *hostile)  # popped next
        got += [examples_of(f) for f, _ in it]
        assert stream._reader is not None and stream._reader.bad_frames == 4
        stream.close(finished=True)
    assert got == reference(1)
    stats = redis_client.hgetall(keys.stats)
    for why in ("shm_outside", "shm_missing", "shm_foreign_host", "shm_bad"):
        assert int(stats[f"dead:{why}".encode()]) == 1
    assert redis_client.llen(keys.dead) == 4


@pytest.mark.parametrize("queue_url", ["redis", "cluster", "stripes"], indirect=True)
def test_resume_from_a_checkpoint_is_exact_with_shared_memory(
    queue_url: str, queue_name: str, producer_thread: Callable[..., Producer]
) -> None:
    producer_thread(numbered(EXAMPLES, BATCH))
    got = []
    first = trainer(queue_url, queue_name)
    got += [examples_of(f) for f, _ in first.get_epoch_iterator()]  # epoch 0
    it = first.get_epoch_iterator()
    got += [examples_of(next(it)[0]) for _ in range(7)]
    state = first.state_dict()
    first.close()
    second = trainer(queue_url, queue_name)
    second.load_state_dict(state)
    for _ in range(2):
        got += [examples_of(f) for f, _ in second.get_epoch_iterator()]
    assert second._shm.frames > 0
    second.close(finished=True)
    assert got == reference(3)


def serve(spawn_proc: Any, serve_argv: Any, serve_env: Any, url: str, *extra: str) -> Any:
    argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "2", *extra)
    argv[argv.index("--url") + 1] = url
    return spawn_proc(argv, env=serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=1))


def test_redis_restarting_empty_is_still_exact_with_shared_memory(
    own_redis: EmbeddedRedis, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    for _ in range(2):
        serve(spawn_proc, serve_argv, serve_env, own_redis.url)
    got = []
    with trainer(own_redis.url, queue_name, stall_s=1.0) as stream:
        for _ in range(3):
            for f, _ in stream.get_epoch_iterator():
                got.append(examples_of(f))
                if len(got) == 27:
                    own_redis.kill()
                    own_redis.restart(wipe=True)
        assert stream._shm.frames > 0
        stream.close(finished=True)
    assert got == reference(3)


def test_sigkilled_producer_and_trainer_leave_no_segment_after_the_next_run_starts(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    victim = serve(spawn_proc, serve_argv, serve_env, redis_url)
    serve(spawn_proc, serve_argv, serve_env, redis_url)
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, str(SUPPORT_DIR / "train.py"), "--url", redis_url]
    argv += ["--queue", queue_name, "--epochs", "50", "--out", str(out)]
    env = serve_env()
    train = spawn_proc(argv, env=env)

    def lines() -> int:
        return len(out.read_text().splitlines()) if out.exists() else 0

    wait_until(lambda: lines() >= 10, 60, "the trainer to read 10 batches")
    wait_until(lambda: {s.producer for s in segments(queue_name)}, what="segments")
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    seen = lines()
    wait_until(lambda: lines() >= seen + 10, 60, "the trainer to go on without it")
    train.send_signal(signal.SIGKILL)
    train.wait(timeout=10)
    old = {s.run for s in segments(queue_name)}
    assert old  # the kills left segments behind
    client = redis.Redis.from_url(redis_url)
    try:
        client.hset(QueueKeys(queue_name).meta, "claim_deadline", 0)  # lapse the claim now
    finally:
        client.close()
    with trainer(redis_url, queue_name) as stream:
        next(iter(stream.get_epoch_iterator()))  # the next run has started
        assert stream._session is not None
        left = {s.run for s in segments(queue_name)} - {stream._session.run}
        assert not left, f"segments of the killed run {left} are still there"
        stream.close(finished=True)
    wait_until(lambda: not segments(queue_name), what="every segment to go at the end")


def test_reset_removes_the_queues_segments_and_only_those(redis_url: str, queue_name: str) -> None:
    mine = SegmentPool(shm.DEFAULT_SHM_DIR, queue_name, "p", 4, None)
    mine.reset("ab12")
    theirs = SegmentPool(shm.DEFAULT_SHM_DIR, queue_name + "-other", "p", 4, None)
    theirs.reset("ab12")
    try:
        for pool in (mine, theirs):
            seg = pool.acquire(1000)
            assert not isinstance(seg, str)
            seg.commit(1000)  # holding a batch: a clean close would keep it
        assert len(segments(queue_name)) == 1
        assert main(["reset", "--url", redis_url, "--queue", queue_name, "--yes"]) == 0
        assert not segments(queue_name)
        assert len(segments(queue_name + "-other")) == 1
    finally:
        theirs.close(finished=True)


def test_a_sigkilled_producers_segments_go_while_the_run_goes_on(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    victim = serve(spawn_proc, serve_argv, serve_env, redis_url)
    serve(spawn_proc, serve_argv, serve_env, redis_url)
    got, killed, deadline = [], None, None
    with trainer(redis_url, queue_name, stall_s=1.0) as stream:
        for _ in range(1000):
            got += [examples_of(f) for f, _ in stream.get_epoch_iterator()]
            mine = [s for s in segments(queue_name) if f"-{victim.pid}-" in s.producer]
            if killed is None and len(mine) >= 2:  # one is the most the sweep may leave
                victim.send_signal(signal.SIGKILL)
                victim.wait(timeout=10)
                killed, deadline = len(mine), time.monotonic() + 60
            elif killed is not None and len(mine) <= 1:
                break  # at most the one it had written and not pushed when it died
            if deadline is not None and time.monotonic() > deadline:
                pytest.fail(f"the killed producer's segments stayed: {mine}")
        assert killed, "the victim never used shared memory"
        assert stream._shm.swept >= 1
        stream.close(finished=True)
    assert got == reference(stream.epoch + 1)

"""Trainers on different hosts: a rank elsewhere, a takeover from elsewhere.

Another shared-memory folder is another host identity (batchq.wire.shm.host_identity), so a
trainer given ``shm_dir=<a folder of its own>`` stands for one on another machine: it
can map nothing the producers on /dev/shm write.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.protocol.fields import StatsField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import rank_field
from batchq.wire import shm
from consumer import ServerDataStream
from producer import Producer

pytestmark = pytest.mark.skipif(shm.host_identity() is None, reason="no writable /dev/shm")

EXAMPLES, BATCH = 200, 10  # 20 batches per epoch


def trainer(url: str, queue: str, **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 30)
    return ServerDataStream(("features", "targets"), url=url, queue=queue, **kw)


def dead_frames(client: Any, queue: str) -> dict[str, int]:
    stats = client.hgetall(QueueKeys(queue).stats)
    prefix = StatsField.DEAD.encode() + b":"
    return {k.decode(): int(v) for k, v in stats.items() if k.startswith(prefix)}


def test_ranks_on_two_hosts_each_get_their_frames_the_way_they_can(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Producer],
    redis_client: Any,
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "other-host-shm"
    elsewhere.mkdir()
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []
    streams = [
        trainer(redis_url, queue_name, rank=0, world_size=2),
        trainer(redis_url, queue_name, rank=1, world_size=2, shm_dir=str(elsewhere)),
    ]

    def rank(r: int) -> None:
        try:
            epochs = [
                [examples_of(f) for f, _ in streams[r].get_epoch_iterator()] for _ in range(2)
            ]
            got[r] = [b for epoch in epochs for b in epoch]
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    meta = QueueKeys(queue_name).meta
    fields = [rank_field("shm_host", r, 2) for r in (0, 1)]
    wait_until(lambda: all(redis_client.hmget(meta, fields)) or errors, what="both hosts")
    producer = producer_thread(numbered(EXAMPLES, BATCH), hwm=3)
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    plan = numbered(EXAMPLES, BATCH)
    expected = [examples_of(f) for _ in range(2) for f, _ in plan.get_epoch_iterator()]
    assert sorted(got[0] + got[1]) == sorted(expected)  # every batch once per epoch
    assert len(got[0]) == len(got[1]) == 20
    assert dead_frames(redis_client, queue_name) == {}  # no descriptor went astray
    assert streams[0]._shm.frames > 0 and streams[1]._shm.frames == 0
    assert producer._transport.active_for(0) and not producer._transport.active_for(1)
    for stream in streams:
        stream.close(finished=True)


def test_a_takeover_from_another_host_gets_the_rest_exactly_and_no_bad_frame(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Producer],
    redis_client: Any,
    tmp_path: Path,
) -> None:
    keys = QueueKeys(queue_name)
    data = keys.data
    first = trainer(redis_url, queue_name)
    # The trainer's host is published before the producer starts, so the producer sees
    # it when it joins and every frame it makes is a descriptor. (Started first, it
    # made frames for Redis until it looked again: after a wait at the cap, or a second
    # later. One that reached the cap without waiting before the trainer published
    # kept a Redis frame at the cap there, and the list never held only descriptors.)
    opened: list[Iterator[Any]] = []
    errors: list[BaseException] = []

    def open_epoch() -> None:
        try:
            opened.append(first.get_epoch_iterator())  # claims, publishes, waits for a plan
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    opener = threading.Thread(target=open_epoch)
    opener.start()
    wait_until(lambda: redis_client.hget(keys.meta, "shm_host") or errors, what="the host")
    producer = producer_thread(numbered(EXAMPLES, BATCH), hwm=4)
    opener.join(timeout=60)
    assert not errors, errors
    assert opened, "the first epoch did not open within 60 s"
    it = opened[0]
    got = [examples_of(next(it)[0]) for _ in range(3)]
    state = first.state_dict()
    # The list full of this host's descriptors, then the trainer dies (no release).
    wait_until(
        lambda: (
            redis_client.llen(data) == 4
            and all(shm.is_descriptor(e) for e in redis_client.lrange(data, 0, -1))
        ),
        what="descriptors at the cap",
    )
    assert first._reader is not None
    first._reader.stop()
    elsewhere = tmp_path / "other-host-shm"
    elsewhere.mkdir()
    second = trainer(redis_url, queue_name, shm_dir=str(elsewhere), on_bad_frame="raise")
    second.load_state_dict(state)
    got += [examples_of(f) for f, _ in second.get_epoch_iterator()]
    got += [examples_of(f) for f, _ in second.get_epoch_iterator()]
    plan = numbered(EXAMPLES, BATCH)
    expected = [examples_of(f) for _ in range(2) for f, _ in plan.get_epoch_iterator()]
    assert got == expected
    assert dead_frames(redis_client, queue_name) == {}
    assert second._shm.frames == 0 and producer._transport.shm_frames > 0
    second.close(finished=True)


def test_a_trainer_that_claims_again_before_any_producer_publishes_its_host_again(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Producer],
    redis_client: Any,
) -> None:
    keys = QueueKeys(queue_name)
    stream = trainer(redis_url, queue_name)
    got: list[list[int]] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            got.extend(examples_of(f) for f, _ in stream.get_epoch_iterator())
        except BaseException as e:  # reported below
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    wait_until(lambda: redis_client.hget(keys.meta, "shm_host") or errors, what="the host")
    old = redis_client.get(keys.incarnation)
    redis_client.delete(keys.meta, keys.incarnation)  # the queue's state lost (a reset)
    # The trainer, waiting for a plan, claims the queue again: that drops the host, so
    # it must publish it again, or every frame would go through Redis.
    wait_until(
        lambda: (
            errors
            or (
                redis_client.get(keys.incarnation) not in (None, old)
                and redis_client.hget(keys.meta, "shm_host")
            )
        ),
        what="the host published again after the new claim",
    )
    producer = producer_thread(numbered(EXAMPLES, BATCH), hwm=3)
    reader.join(timeout=60)
    assert not errors, errors
    assert len(got) == EXAMPLES // BATCH
    assert stream._shm.frames > 0 and producer._transport.shm_frames > 0
    stream.close(finished=True)

"""producer.server on its own: a Producer's join, leases, leave, its argument checks and
its orphan rule, against the session's redis-server (no trainer, no process)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from batchq.errors import ConfigError, PipelineMismatch, ProtocolError, RunFinished
from batchq.protocol.fields import MetaField
from batchq.protocol.words import Status
from producer import start_server
from producer.datasets import IndexableDataset
from producer.schemes import SequentialScheme
from producer.server import Producer
from producer.serving.ahead import Lease
from producer.serving.membership import RunPosition
from producer.streams import DataStream


def _stream(examples: int = 40) -> DataStream:
    dataset = IndexableDataset({"x": np.arange(examples)})
    return DataStream(dataset, iteration_scheme=SequentialScheme(examples, 10))


@pytest.fixture
def producer(redis_url: str, queue_name: str) -> Iterator[Producer]:
    p = Producer(_stream(), redis_url, queue_name, hwm=3, orphan_exit_s=5.0)
    try:
        yield p
    finally:
        p._leave()  # hands back what it holds, closes its client


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("hwm", 0),
        ("hwm", "3"),
        ("window", 0),
        ("heartbeat_ttl_s", 0),
        ("heartbeat_ttl_s", "10"),
        ("max_attempts", 0),
        ("max_attempts", True),
        ("orphan_exit_s", -1.0),
        ("orphan_exit_s", "5"),
        ("build_timeout_s", "3"),
        ("reconnect_timeout_s", 0),
    ],
)
def test_an_argument_that_cannot_work_is_named(option: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"{option} {value!r} is not valid"):
        Producer(_stream(), "redis://127.0.0.1:1/0", "q", **{option: value})


@pytest.mark.parametrize("not_a_stream", [42, [1, 2, 3], "data.h5"])
def test_what_is_not_a_stream_is_refused_naming_it(not_a_stream: Any) -> None:
    for make in (
        lambda: Producer(not_a_stream, "redis://127.0.0.1:1/0", "q"),
        lambda: start_server(not_a_stream, url="redis://127.0.0.1:1/0", queue="q"),
        lambda: start_server(not_a_stream, url="redis://127.0.0.1:1/0", queue="q", stripes=2),
    ):
        with pytest.raises(ConfigError, match="is not a stream: expected a DataStream"):
            make()


def test_join_creates_the_run_and_leases_come_in_plan_order(
    producer: Producer, redis_client: redis.Redis
) -> None:
    producer._join()
    keys = producer.keys
    meta = redis_client.hgetall(keys.meta)
    assert meta[MetaField.RUN.encode()].decode() == producer._pos.run
    assert meta[MetaField.SHARDS.encode()] == b"4"  # 40 examples, batches of 10
    assert redis_client.zscore(keys.producers, producer.id) is not None
    first, second = producer._lease(), producer._lease()
    assert first is not None and second is not None
    assert (first.g, second.g) == (0, 1)
    assert first.token != second.token  # a retried request with one token is idempotent


def test_leaving_hands_the_leases_back_oldest_first(
    producer: Producer, redis_client: redis.Redis
) -> None:
    producer._join()
    producer._lease()
    producer._lease()
    keys = producer.keys
    producer._leave()
    assert redis_client.lrange(keys.work, 0, -1) == [b"0", b"1"]
    assert redis_client.zscore(keys.producers, producer.id) is None
    assert redis_client.llen(keys.lease(producer.id)) == 0


def test_a_prefetched_lease_is_served_before_asking_redis(producer: Producer) -> None:
    producer._join()
    held = Lease(g=7, skip=0, token="t", slots=4, world=1)
    producer._ahead.leases.append(held)
    seq = producer._lease_seq
    assert producer._lease() is held
    assert producer._lease_seq == seq  # no request was made
    assert not producer._ahead.leases


def test_another_pipeline_on_the_same_run_is_refused(
    producer: Producer, redis_url: str, queue_name: str
) -> None:
    producer._join()
    other = Producer(_stream(), redis_url, queue_name, hwm=5)
    try:
        with pytest.raises(PipelineMismatch, match="hwm"):
            other._join()
    finally:
        other.client.close()


def test_without_a_trainer_for_orphan_exit_s_the_producer_stops(producer: Producer) -> None:
    producer._join()
    now_ms = 1_000_000
    producer._beat.check_orphaned(producer.client, now_ms)  # the clock starts
    assert not producer.orphaned
    producer._beat.check_orphaned(producer.client, now_ms + 4_999)
    assert not producer.orphaned
    producer._beat.check_orphaned(producer.client, now_ms + 5_000)
    assert producer.orphaned and producer._stop.is_set()


def test_a_live_claim_resets_the_orphan_clock(
    producer: Producer, redis_client: redis.Redis
) -> None:
    producer._join()
    producer._beat.check_orphaned(producer.client, 1_000)
    redis_client.hset(producer.keys.meta, MetaField.CLAIM_DEADLINE, 10_000)
    producer._beat.check_orphaned(producer.client, 6_000)  # a trainer holds it
    redis_client.hdel(producer.keys.meta, MetaField.CLAIM_DEADLINE)
    producer._beat.check_orphaned(producer.client, 11_000)  # counting again from here
    assert not producer.orphaned


def test_statuses_that_end_or_make_no_sense(producer: Producer) -> None:
    with pytest.raises(RunFinished):
        producer._handle_status(Status.FINISHED)
    with pytest.raises(ProtocolError, match="NONSENSE"):
        producer._handle_status("NONSENSE")


def test_a_status_the_pusher_returns_is_acted_on_once_it_returned(
    producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer._join()
    joins: list[RunPosition] = []
    join = producer._membership.join
    monkeypatch.setattr(producer._membership, "join", lambda s: joins.append(s) or join(s))
    monkeypatch.setattr(producer._shards, "serve_shard", lambda *a, **k: Status.RUN_CHANGED)
    producer._serve(Lease(g=0, skip=0, token="t", slots=4, world=1))
    assert joins == [producer._pos]  # joined again, once the pusher had returned
    monkeypatch.setattr(producer._shards, "serve_shard", lambda *a, **k: Status.FINISHED)
    with pytest.raises(RunFinished):
        producer._serve(Lease(g=1, skip=0, token="t", slots=4, world=1))

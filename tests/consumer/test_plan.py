"""The run's plan (consumer/plan.py): the one wait for it, and len() built on it
(epoch_length)."""

from __future__ import annotations

from typing import Any

import pytest

from batchq.errors import LengthUnknown, ProducersLost
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import RankLayout
from consumer import plan as plan_module
from consumer.plan import Plan, epoch_length, wait_for_plan

PLAN = {b"shards": b"10", b"epoch_batches": b"10", b"hwm": b"4", b"fingerprint": b"f"}


def test_the_wait_reads_until_the_plan_is_published_idling_between_reads() -> None:
    reads = [{}, {b"run": b"r"}, {**PLAN, b"run": b"r"}]
    idled: list[int] = []

    def read() -> dict[bytes, bytes]:
        return reads.pop(0)

    plan = wait_for_plan(read, lambda: idled.append(1), timeout_s=60)
    assert isinstance(plan, Plan)
    assert (plan.shards, plan.epoch_batches, plan.list_cap) == (10, 10, 4)  # integers
    assert len(idled) == 2 and not reads  # idle between reads, none after the plan


def test_the_wait_is_bounded_and_names_the_epoch() -> None:
    idled: list[int] = []
    with pytest.raises(ProducersLost) as e:
        wait_for_plan(dict, lambda: idled.append(1), timeout_s=-1.0, epoch=3, queue="digts")
    assert e.value.epoch == 3 and not idled  # past its deadline at the first read
    # A mistyped queue name is the usual cause: the error names the queue and says so.
    assert str(e.value).startswith("queue 'digts': no producer published the run's plan")
    assert "none joined this queue at this Redis" in str(e.value)


def test_a_long_wait_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    monkeypatch.setattr(plan_module.time, "monotonic", lambda: now[0])

    def idle() -> None:  # each wait a second on this clock
        now[0] += 1.0

    with caplog.at_level("WARNING", logger="consumer.plan"), pytest.raises(ProducersLost):
        wait_for_plan(dict, idle, timeout_s=30.0, queue="q")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["queue 'q': no producer has joined for 10 s; waiting up to 30 s in all"]


def _client_with(fake_redis: Any, queue: str, meta: dict[bytes, bytes]) -> QueueKeys:
    keys = QueueKeys(queue)
    if meta:
        fake_redis.hset(keys.meta, mapping=meta)
    return keys


def test_len_is_the_plans_batches_or_a_ranks_share(fake_redis: Any) -> None:
    keys = _client_with(fake_redis, "q", PLAN)
    common: dict[str, Any] = dict(even="pad", timeout_s=5, epoch=0)
    assert epoch_length(fake_redis, keys, world=1, **common) == 10
    share = RankLayout(10, 3, "pad").per_rank
    assert epoch_length(fake_redis, keys, world=3, **common) == share == 4


def test_len_is_refused_where_the_plan_cannot_tell(fake_redis: Any) -> None:
    common: dict[str, Any] = dict(even="pad", timeout_s=5, epoch=0)
    unknown = _client_with(fake_redis, "filtered", {**PLAN, b"epoch_batches": b"-1"})
    with pytest.raises(LengthUnknown, match="cannot tell its batches per epoch"):
        epoch_length(fake_redis, unknown, world=1, **common)
    several = _client_with(fake_redis, "several", {**PLAN, b"shards": b"5"})
    assert epoch_length(fake_redis, several, world=1, **common) == 10
    with pytest.raises(LengthUnknown, match="more than one batch"):
        epoch_length(fake_redis, several, world=2, **common)  # B unknown (a Filter)


def test_len_of_a_rank_where_the_plan_counts_shards_of_several_batches(fake_redis: Any) -> None:
    # 5 shards of 3, the last of 1 (E = 13): 'pad' evens both ranks to rank 1's 3 + 3 + 3
    # (shards 1, 3 and a pad of 0); 'drop' serves shards 0-3, 6 each.
    meta = {**PLAN, b"shards": b"5", b"epoch_batches": b"13", b"shard_batches": b"3"}
    keys = _client_with(fake_redis, "counted", meta)
    common: dict[str, Any] = dict(world=2, timeout_s=5, epoch=0)
    assert epoch_length(fake_redis, keys, even="pad", **common) == 9
    assert epoch_length(fake_redis, keys, even="drop", **common) == 6


def test_len_waits_for_the_first_producer_and_is_bounded(fake_redis: Any) -> None:
    keys = _client_with(fake_redis, "late", {})
    fake_redis.rpush(keys.wake, b"joined")  # the first producer's join wakes the wait ...
    fake_redis.hset(keys.meta, MetaField.RUN, b"r")  # ... before it published the plan
    with pytest.raises(ProducersLost, match="queue 'late': no producer published"):
        epoch_length(fake_redis, keys, world=1, even="pad", timeout_s=0.3, epoch=0)
    fake_redis.hset(keys.meta, mapping=PLAN)
    assert epoch_length(fake_redis, keys, world=1, even="pad", timeout_s=5, epoch=0) == 10

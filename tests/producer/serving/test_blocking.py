"""producer.serving.blocking: the clock of a blocked push and the data-parallel hand-back
decision."""

from __future__ import annotations

import fakeredis
import pytest

from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import rank_field
from producer.serving import blocking
from producer.serving.blocking import HANDBACK_S, Waiting, hand_back_reason

K = QueueKeys("blk")
WORLD = 2


def _ranks(client: fakeredis.FakeRedis, *, live: list[bool], depths: list[int]) -> None:
    """Rank r holds a claim for another minute if live[r], else one that lapsed."""
    seconds, _ = client.time()
    for r in range(WORLD):
        deadline_ms = (seconds + (60 if live[r] else -60)) * 1000
        client.hset(K.meta, rank_field(MetaField.CLAIM_DEADLINE, r, WORLD), deadline_ms)
        for i in range(depths[r]):
            client.lpush(K.data_of(r, WORLD), f"frame{i}")


def test_a_live_rank_whose_peers_have_frames_keeps_the_shard(
    fake_redis: fakeredis.FakeRedis,
) -> None:
    _ranks(fake_redis, live=[True, True], depths=[3, 1])
    assert hand_back_reason(fake_redis, K, 0, WORLD) is None


def test_a_rank_that_is_not_reading_gets_the_shard_handed_back(
    fake_redis: fakeredis.FakeRedis,
) -> None:
    _ranks(fake_redis, live=[False, True], depths=[3, 1])
    assert hand_back_reason(fake_redis, K, 0, WORLD) == "it is not reading"
    fake_redis.hset(K.meta, rank_field(MetaField.DONE, 1, WORLD), "1")  # done: not reading
    _ranks(fake_redis, live=[True, True], depths=[0, 0])
    assert hand_back_reason(fake_redis, K, 1, WORLD) == "it is not reading"


def test_a_reading_peer_with_an_empty_list_gets_the_shard_handed_back(
    fake_redis: fakeredis.FakeRedis,
) -> None:
    _ranks(fake_redis, live=[True, True], depths=[3, 0])
    assert hand_back_reason(fake_redis, K, 0, WORLD) == "another rank's list is empty"


def test_the_wait_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(blocking.time, "monotonic", lambda: now[0])
    wait = Waiting()
    assert wait.since_last_try_ms() == 0  # never blocked
    assert wait.start() is False  # the first block starts the clocks
    now[0] += 0.25
    assert wait.since_last_try_ms() == 250
    assert wait.since_last_try_ms() == 0  # each try reports only its own wait
    assert wait.start() is True
    assert not wait.hand_back_due()
    now[0] += HANDBACK_S
    assert wait.hand_back_due()
    assert not wait.hand_back_due()  # once per HANDBACK_S
    wait.restart()
    now[0] += 0.5
    assert wait.since_last_try_ms() == 500

"""consumer.balance: ranks even their counts through Redis (fakeredis)."""

from __future__ import annotations

from typing import Any

import pytest

from batchq.errors import RankLost
from batchq.protocol.keys import QueueKeys
from consumer.balance import Balancer

KEYS = QueueKeys("q")


class Named(str):
    """A frame stand-in: its name, and the shard a pad records (shard 0 here)."""

    shard = 0


def frames(*names: str) -> Any:
    return iter([Named(n) for n in names])


def balancer(fake_redis: Any, even: str, rank: int = 0, timeout_s: float = 5.0) -> Balancer:
    return Balancer(fake_redis, KEYS, rank, 2, even, timeout_s, keep=2)


def test_pad_yields_its_own_first_batches_up_to_the_largest_count(fake_redis: Any) -> None:
    fake_redis.hset(KEYS.counts, "0:1", "=5")
    b = balancer(fake_redis, "pad")
    got = list(b.balance(0, frames("a", "b", "c"), lambda: None))  # type: ignore[arg-type]
    assert got == ["a", "b", "c", "a", "b"]
    assert b.padded == 2
    assert fake_redis.hget(KEYS.counts, "0:0") == b"=3"


def test_drop_ends_where_the_shortest_share_ends(fake_redis: Any) -> None:
    fake_redis.hset(KEYS.counts, "0:1", "=2")
    cut = []
    b = balancer(fake_redis, "drop")
    got = list(b.balance(0, frames("a", "b", "c", "d"), lambda: cut.append(1)))  # type: ignore[arg-type]
    assert got == ["a", "b"] and cut == [1] and b.cuts == 1
    assert fake_redis.hget(KEYS.counts, "0:0") == b"=2"


def test_drop_yields_a_batch_only_once_every_rank_has_one_as_far(fake_redis: Any) -> None:
    fake_redis.hset(KEYS.counts, "0:1", "1")  # the other rank holds its first batch only
    b = balancer(fake_redis, "drop", timeout_s=0.3)
    it = b.balance(0, frames("a", "b"), lambda: None)  # type: ignore[arg-type]
    assert next(it) == "a"
    with pytest.raises(RankLost, match=r"ranks \[1\]"):
        next(it)  # the other rank never gets a second batch


def test_a_silent_rank_is_named_after_the_timeout(fake_redis: Any) -> None:
    b = balancer(fake_redis, "pad", rank=1, timeout_s=0.2)
    with pytest.raises(RankLost, match=r"epoch 0: ranks \[0\]"):
        list(b.balance(0, frames("a"), lambda: None))  # type: ignore[arg-type]


def test_old_counts_go(fake_redis: Any) -> None:
    fake_redis.hset(KEYS.counts, mapping={"0:0": "=3", "1:0": "=3"})
    balancer(fake_redis, "pad").start_epoch(2)
    assert fake_redis.hkeys(KEYS.counts) == [b"1:0"]


def counted_balancer(fake_redis: Any, even: str, totals: list[int]) -> Balancer:
    """A rank 0 whose plan fixes every rank's count, but epoch 1's (re-split, say)."""
    return Balancer(
        fake_redis, KEYS, 0, 2, even, 0.3, keep=2,
        counted=lambda epoch: totals if epoch != 1 else None,
    )  # fmt: skip


def test_pad_with_counts_the_plan_fixes_waits_for_no_rank(fake_redis: Any) -> None:
    # No other rank published anything: a wait would be RankLost. Ranks that step
    # together (DDP) could not publish: the longer one is waiting for this one.
    b = counted_balancer(fake_redis, "pad", [3, 5])
    got = list(b.balance(0, frames("a", "b", "c"), lambda: None))  # type: ignore[arg-type]
    assert got == ["a", "b", "c", "a", "b"] and b.padded == 2
    # Resumed 2 batches into the epoch: the plan's counts are the whole epoch's.
    got = list(b.balance(2, frames("c"), lambda: None, already=2))  # type: ignore[arg-type]
    assert got == ["c", "c", "c"]
    with pytest.raises(RankLost):  # epoch 1's counts are only known as it is read
        list(b.balance(1, frames("a"), lambda: None))  # type: ignore[arg-type]


def test_drop_with_counts_the_plan_fixes_cuts_before_its_last_batch(fake_redis: Any) -> None:
    b = counted_balancer(fake_redis, "drop", [4, 2])
    cut: list[int] = []
    out = b.balance(0, frames("a", "b", "c", "d"), lambda: cut.append(1))  # type: ignore[arg-type]
    assert next(out) == "a" and cut == []
    # The epoch ends with this batch: cut before the caller holds it, so a checkpoint
    # taken now is past the epoch, as the shorter rank's is.
    assert next(out) == "b" and cut == [1] and b.cuts == 1
    assert list(out) == []
    assert fake_redis.hget(KEYS.counts, "0:0") == b"=2"
    b = counted_balancer(fake_redis, "drop", [2, 4])  # this rank is the shortest: no cut
    assert list(b.balance(2, frames("a", "b"), lambda: cut.append(2))) == ["a", "b"]  # type: ignore[arg-type]
    assert cut == [1]


def test_shard_counts_are_published_read_back_as_far_as_said_and_dropped(fake_redis: Any) -> None:
    ranks = [
        Balancer(fake_redis, KEYS, r, 2, "drop", 5.0, keep=2, shards=3, ordered=True)
        for r in range(2)
    ]
    assert ranks[0].publishes(0)
    ranks[0].publish_shards(0, {0: 3, 1: 0})
    ranks[0].publish_shards(0, {2: 2})
    ranks[1].publish_shards(0, {0: 1, 2: 0})  # shard 2's END came before shard 1's end
    assert ranks[1].shard_counts(0) == [[3, 0, 2], [1, None, 0]]
    fake_redis.hset(KEYS.counts, "n:0:1:2", "-4")  # a foreign value is not trusted
    assert ranks[0].shard_counts(0) == [[3, 0, 2], [1]]
    ranks[0].start_epoch(2)  # epoch 0's counts go with its other counts
    assert sorted(fake_redis.hkeys(KEYS.counts)) == [b"n:0:1:0", b"n:0:1:2"]  # rank 1's
    # Arrival order, or a plan that counts its shards: nothing published or read.
    unordered = Balancer(fake_redis, KEYS, 0, 2, "pad", 5.0, keep=2, shards=3)
    plan = Balancer(
        fake_redis, KEYS, 0, 2, "pad", 5.0, keep=2, shards=3, ordered=True,
        counted=lambda epoch: [6, 6],
    )  # fmt: skip
    assert not unordered.publishes(0) and unordered.shard_counts(0) is None
    assert not plan.publishes(0) and plan.shard_counts(0) is None

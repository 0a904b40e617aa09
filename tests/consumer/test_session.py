"""consumer.session on its own (real redis-server): claim, conflict, release, resume."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from waiting import wait_until

from batchq.client.connection import make_client
from batchq.errors import StateLost, StepMismatch, TrainerConflict
from batchq.protocol import producer_scripts, trainer_scripts
from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys
from batchq.protocol.words import PROTOCOL_VERSION
from consumer import plan as plan_module
from consumer.session import Session

TTL_MS = 10_000


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = make_client(redis_url)
    yield c
    c.close()


def test_acquire_starts_a_run_and_a_second_trainer_conflicts(
    client: redis.Redis, queue_name: str
) -> None:
    first = Session(client, QueueKeys(queue_name), TTL_MS)
    assert first.acquire() is True  # nothing there: a new run
    run, plan = first.position()
    assert run and plan is None and first.incarnation
    second = Session(client, QueueKeys(queue_name), TTL_MS)
    with pytest.raises(TrainerConflict, match="held by another trainer"):
        second.acquire()
    first.refresh(client)
    assert first.release(finished=False) is False
    # A run that an earlier trainer held is not adopted: a new trainer starts afresh.
    assert second.acquire() is True
    assert second.position()[0] != run


def test_a_taken_over_claim_fails_its_refresh(client: redis.Redis, queue_name: str) -> None:
    first = Session(client, QueueKeys(queue_name), TTL_MS)
    first.acquire()
    second = Session(client, QueueKeys(queue_name), TTL_MS)
    second.acquire(takeover=first.run)
    with pytest.raises(TrainerConflict, match="taken over"):
        first.refresh(client)


def test_finish_ends_the_run_for_producers(client: redis.Redis, queue_name: str) -> None:
    keys = QueueKeys(queue_name)
    s = Session(client, keys, TTL_MS)
    s.acquire()
    assert s.release(finished=True) is True
    assert client.hget(keys.meta, "finished") == b"1"
    assert s.release(finished=True) is False  # released already: nothing to do


def test_a_finish_that_finds_the_queue_lost_raises_and_a_release_warns(
    client: redis.Redis, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Redis restarted empty since the claim: the finish reached no run, which the caller
    # must know (the producers serve on until a run is finished); a plain release has
    # nothing to give up.
    for finished in (True, False):
        s = Session(client, QueueKeys(queue_name), TTL_MS)
        s.acquire()
        delete_queue(client, queue_name)
        if finished:
            with pytest.raises(StateLost, match="lost the queue's state"):
                s.release(finished=True)
        else:
            with caplog.at_level("WARNING", logger="consumer.session"):
                assert s.release(finished=False) is False
            assert "the claim was gone at its release (STATE_LOST)" in caplog.text
        assert not s.claimed


def test_resume_publishes_the_ledger_under_a_new_run(
    client: redis.Redis, queue_name: str, redis_url: str
) -> None:
    keys = QueueKeys(queue_name)
    s = Session(client, keys, TTL_MS)
    s.acquire()
    old = s.run
    own = make_client(redis_url)  # the reader's thread passes its own client
    try:
        s.resume(own, 8, "fp", [("2:0", "d"), ("2:1", "3")], shards=4)
    finally:
        own.close()
    run, _ = s.position()
    assert run != old
    assert client.hget(keys.meta, "run") == run.encode()
    assert client.hgetall(keys.ledger) == {b"2:0": b"d", b"2:1": b"3"}
    assert client.hget(keys.meta, "next") == b"8"


def test_ranks_resuming_from_different_steps_are_refused(
    client: redis.Redis, queue_name: str
) -> None:
    keys = QueueKeys(queue_name)
    ranks = [Session(client, keys, TTL_MS, rank=r, world=2) for r in (0, 1)]
    for s in ranks:
        s.resume_run = "job-run"
        s.acquire()
    ranks[0].resume(client, 0, "fp", [], step=10, shards=4)
    with pytest.raises(StepMismatch, match="step 12"):
        ranks[1].resume(client, 0, "fp", [], step=12, shards=4)


def test_a_claim_reply_is_typed(client: redis.Redis, queue_name: str) -> None:
    reply = trainer_scripts.claim(
        client, QueueKeys(queue_name), op="acquire", token="t", claim_ttl_ms=TTL_MS,
        run_id="r1", new_incarnation="i1", takeover_run="", version="1", rank=0, world=1,
        even="pad", resumed="",
    )  # fmt: skip
    assert (reply.status, reply.incarnation, reply.run, reply.new_run) == ("OK", "i1", "r1", True)


def test_redis_emptied_while_waiting_for_the_plan_claims_the_new_run(
    client: redis.Redis, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Redis restarted empty while the claim's refresh was in flight, and a producer
    # joined first (a new queue, a new run, no claim): the retried refresh finds no claim
    # of ours. That is not another trainer: the wait claims the new run and goes on.
    keys = QueueKeys(queue_name)
    s = Session(client, keys, TTL_MS)
    s.acquire()
    old_run, real_refresh = s.run, s.refresh
    restarted: list[bool] = []

    def refresh_across_a_restart(c: redis.Redis) -> None:
        if not restarted:
            restarted.append(True)
            delete_queue(client, queue_name)
            joined = producer_scripts.join(
                client, keys, producer="p", fingerprint="fp", hwm=3, shards=4, window=6,
                new_run="producers-run", new_incarnation="producers-inc",
                heartbeat_ttl_ms=TTL_MS, version=PROTOCOL_VERSION, epoch_batches=None,
                age_ms=0, no_create=False,
            )  # fmt: skip
            assert joined.status == "OK"
        real_refresh(c)

    monkeypatch.setattr(s, "refresh", refresh_across_a_restart)
    plan = s.wait_for_plan(timeout_s=10, block_s=0.05)
    assert plan.shards == 4
    assert (s.run, s.incarnation) == ("producers-run", "producers-inc") != (old_run, "")
    assert client.hget(keys.meta, "claim") == s.token.encode()


def _join(
    client: redis.Redis, keys: QueueKeys, producer: str, epoch_batches: int | None = None
) -> str:
    """A producer's join of the queue's run (its plan: 4 shards); the reply's status."""
    return producer_scripts.join(
        client, keys, producer=producer, fingerprint="fp", hwm=3, shards=4, window=6,
        new_run="producers-run", new_incarnation="producers-inc", heartbeat_ttl_ms=TTL_MS,
        version=PROTOCOL_VERSION, epoch_batches=epoch_batches, age_ms=0, no_create=False,
    ).status  # fmt: skip


def test_the_join_that_publishes_the_plan_wakes_the_trainer_waiting_for_it(
    client: redis.Redis, redis_url: str, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Cold start (issue 40): the trainer claimed before any producer joined, and waits
    # with a bound (8 s, under the client's socket timeout) past this test's patience
    # (5 s): only the join's wake-up returns it in time.
    keys = QueueKeys(queue_name)
    s = Session(client, keys, TTL_MS)
    s.acquire()
    waiting, real_refresh = threading.Event(), s.refresh

    def refresh(c: redis.Redis) -> None:
        real_refresh(c)
        waiting.set()  # the wait's idle: its BLPOP of the wake list comes next

    monkeypatch.setattr(s, "refresh", refresh)
    plans: list[int] = []
    waiter = threading.Thread(target=lambda: plans.append(s.wait_for_plan(60, 8).shards))
    waiter.start()
    producer = make_client(redis_url)
    try:
        assert waiting.wait(timeout=30)
        assert _join(producer, keys, "p1") == "OK"
        waiter.join(timeout=5)
        assert not waiter.is_alive() and plans == [4]
        # The plan was published once: a later join wakes nobody.
        assert _join(producer, keys, "p2") == "OK" and client.llen(keys.wake) == 0
    finally:
        producer.close()
        if waiter.is_alive():  # fail without hanging: end the wait with a token
            client.lpush(keys.wake, "1")
            waiter.join(timeout=30)


def test_the_plan_wakes_each_claimed_rank_and_nobody_before_a_claim(
    client: redis.Redis, queue_name: str
) -> None:
    ranks = QueueKeys(queue_name)
    for rank in range(2):
        Session(client, ranks, TTL_MS, rank=rank, world=3).acquire()  # rank 2 not yet
    assert _join(client, ranks, "p1") == "OK"
    assert client.llen(ranks.wake) == 2  # one token per rank waiting for the plan
    # Producers first: the plan is published with no trainer to wake.
    first = QueueKeys(f"{queue_name}-first")
    try:
        assert _join(client, first, "p1") == "OK" and client.llen(first.wake) == 0
    finally:
        delete_queue(client, first.queue)


def test_the_plan_wakes_the_claimed_ranks_of_every_group(
    client: redis.Redis, redis_url: str, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Groups of a run (a sweep's trials) wait for the plan too: the join that publishes
    # it pushes a token onto the run's wake list for each claimed rank of every group
    # slot, and a later group's waiter (slot 1, its own wake list for its pops) watches
    # that list as well. Its bound (8 s) is past this test's patience (5 s).
    keys = QueueKeys(queue_name)
    Session(client, keys, TTL_MS, group="a").acquire()  # slot 0, one process, not waiting
    late = Session(client, keys, TTL_MS, group="b", rank=1, world=3)
    late.acquire()
    assert late.keys.wake != keys.wake  # slot 1's own list
    Session(client, keys, TTL_MS, group="b", rank=0, world=3).acquire()
    waiting, real_refresh = threading.Event(), late.refresh

    def refresh(c: redis.Redis) -> None:
        real_refresh(c)
        waiting.set()  # the wait's idle: its BLPOP comes next

    monkeypatch.setattr(late, "refresh", refresh)
    plans: list[int] = []
    waiter = threading.Thread(target=lambda: plans.append(late.wait_for_plan(60, 8).shards))
    waiter.start()
    producer = make_client(redis_url)
    try:
        assert waiting.wait(timeout=30)
        assert _join(producer, keys, "p1") == "OK"  # 3 tokens: slot 0's rank, slot 1's two
        waiter.join(timeout=5)
        assert not waiter.is_alive() and plans == [4]
        assert client.llen(keys.wake) == 2  # the waiter took one; the others' are kept
    finally:
        producer.close()
        if waiter.is_alive():  # fail without hanging: end the wait with a token
            client.lpush(keys.wake, "1")
            waiter.join(timeout=30)


def test_len_before_any_claim_is_woken_by_the_join_that_publishes_the_plan(
    client: redis.Redis, redis_url: str, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning asks len() before its first iteration, so before the claim: that wait
    # joins the plan's waiters (a set) and the join pushes it a token as well. Its bound
    # (8 s) is past this test's patience (5 s).
    keys = QueueKeys(queue_name)
    monkeypatch.setattr(plan_module, "BLOCK_S", 8.0)
    lengths: list[int] = []

    def length() -> None:
        lengths.append(
            plan_module.epoch_length(client, keys, world=1, even="pad", timeout_s=60, epoch=0)
        )

    waiter = threading.Thread(target=length)
    waiter.start()
    producer = make_client(redis_url)
    try:
        wait_until(lambda: producer.scard(keys.planwait) == 1, timeout_s=30)
        assert _join(producer, keys, "p1", epoch_batches=4) == "OK"
        waiter.join(timeout=5)
        assert not waiter.is_alive() and lengths == [4]
        assert not producer.exists(keys.planwait)  # the join that woke it deleted the set
    finally:
        producer.close()
        if waiter.is_alive():  # fail without hanging: end the wait with a token
            client.lpush(keys.wake, "1")
            waiter.join(timeout=30)


def test_a_real_takeover_while_waiting_for_the_plan_still_fails(
    client: redis.Redis, queue_name: str
) -> None:
    keys = QueueKeys(queue_name)
    s = Session(client, keys, TTL_MS)
    s.acquire()
    Session(client, keys, TTL_MS).acquire(takeover=s.run)  # same queue state: a takeover
    with pytest.raises(TrainerConflict, match="taken over"):
        s.wait_for_plan(timeout_s=10, block_s=0.05)


def test_a_refresh_after_redis_lost_the_queue_is_state_lost_not_a_takeover(
    client: redis.Redis, queue_name: str
) -> None:
    # The reader refreshes while its buffer is full: after Redis restarted empty it must
    # re-create the run (StateLost), not stop the job as if another trainer took over.
    keys = QueueKeys(queue_name)
    s = Session(client, keys, TTL_MS)
    s.acquire()
    delete_queue(client, queue_name)
    with pytest.raises(StateLost, match="lost the queue"):
        s.refresh(client)

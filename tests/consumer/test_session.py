"""consumer.session on its own (real redis-server): claim, conflict, release, resume."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from batchq import scripts
from batchq.connection import make_client
from batchq.errors import StepMismatch, TrainerConflict
from batchq.keys import QueueKeys
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
    reply = scripts.claim(
        client, QueueKeys(queue_name), op="acquire", token="t", claim_ttl_ms=TTL_MS,
        run_id="r1", new_incarnation="i1", takeover_run="", version="1", rank=0, world=1,
        even="pad", resumed="",
    )  # fmt: skip
    assert (reply.status, reply.incarnation, reply.run, reply.new_run) == ("OK", "i1", "r1", True)

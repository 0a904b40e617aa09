"""consumer.reader.thread: one thread pops, with its own client, and closing never adds a
second popper (issue 10, point 2); a trainer that keeps up skips the pop script
(issue 14)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis
from pipelines import examples_of, numbered

from batchq.protocol import trainer_scripts
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream
from consumer.reader import thread as reader
from consumer.reader.thread import Reader


def test_the_reader_pops_with_its_own_client_and_closes_it(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(100, 10), hwm=4)
    stream = ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name, hwm=3)
    it = stream.get_epoch_iterator()
    first = examples_of(next(it)[0])
    reader = stream._reader
    assert reader is not None
    assert reader.client is not stream._client  # its own connection
    stream.close()
    assert not reader.is_alive()
    # Closed: none of its connections is open any more.
    pool: Any = reader.client.connection_pool
    assert all(c._sock is None for c in pool._available_connections)
    assert len(first) == 10


def test_close_sends_the_last_figures_from_the_reader_thread_only(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    producer_thread(numbered(100, 10), hwm=4)
    poppers: set[str] = set()
    original = Reader._pop_round

    def spy(self: Reader, room: int | None = None, *, last: bool = False) -> None:
        poppers.add(threading.current_thread().name)
        original(self, room, last=last)

    monkeypatch.setattr(Reader, "_pop_round", spy)
    with ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, hwm=3
    ) as stream:
        got = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
    assert sorted(x for batch in got for x in batch) == list(range(100))
    assert poppers == {f"batchq-reader-{queue_name}"}
    # The last epoch's figures reached Redis: the flush ran before the thread ended.
    stats = redis_client.hgetall(QueueKeys(queue_name).stats)
    assert int(stats[b"popped"]) >= 10  # the batches (and any separate END frame)
    assert int(stats.get(b"epochs_completed", 0)) == 1


def test_a_trainer_that_keeps_up_takes_frames_by_brpop_between_pop_scripts(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The producer is the slow side (10 ms a batch): the list is empty whenever the
    # reader looks, so after the first BRPOP each round may be a BRPOP alone. Only the
    # list and the floor decide here (no clock), and the window is wide.
    monkeypatch.setenv("TEST_SLOW_MS", "10")
    monkeypatch.setattr(reader, "QUICK_S", 3600.0)
    pops: list[int] = []
    original = trainer_scripts.pop

    def counting(*args: Any, **kwargs: Any) -> Any:
        pops.append(kwargs["extra_popped"])
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer_scripts, "pop", counting)
    producer_thread(numbered(200, 10), hwm=4, window=1000)
    with ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, hwm=3, timeout_s=20
    ) as stream:
        got = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
        during = len(pops)
    assert sorted(x for batch in got for x in batch) == list(range(200))
    assert during < len(got) / 2  # 20 batches, far fewer pop scripts
    assert max(pops) > 1  # frames taken outside the script, counted with the next one
    # Every frame was counted once, the BRPOP-only ones by the pop script after them
    # (the close's flush sends the last). The producer goes on after the epoch (the
    # next one's frames, until the cap): what it pushed is what was popped plus what
    # the list still holds, read in one transaction.
    keys = QueueKeys(queue_name)
    pipe = redis_client.pipeline(transaction=True)
    pipe.hgetall(keys.stats)
    pipe.llen(keys.data)
    stats, left = pipe.execute()
    # (The close gave back what the reader held and the loop had not had: given_back.)
    given_back = int(stats.get(b"given_back", 0))
    assert int(stats[b"popped"]) == int(stats[b"pushed"]) + given_back - left

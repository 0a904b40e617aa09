"""Connection drops during the trainer's start, resume and close are survived (issue 11).

The trainer connects through a loopback proxy (tests/support/faultproxy.py) that drops
its connection when it sends a given command: before the command ran, or after (it ran
and its reply is lost, so the retry must be idempotent). Producers connect directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from faultproxy import FaultProxy
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.protocol.calls import SCRIPTS
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream

EXAMPLES, BATCH = 60, 10  # 6 batches per epoch


@pytest.fixture
def proxy(redis_url: str) -> Iterator[FaultProxy]:
    port = urlsplit(redis_url).port
    assert port is not None
    p = FaultProxy(port, seed=11)
    try:
        yield p
    finally:
        p.close()


def reference(epochs: int = 1) -> list[list[int]]:
    """The first ``epochs`` epochs in plan order, batch by batch."""
    local = numbered(EXAMPLES, BATCH)
    return [examples_of(f) for _ in range(epochs) for f, _ in local.get_epoch_iterator()]


def trainer(url: str, queue: str, **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 20)
    return ServerDataStream(("features", "targets"), url=url, queue=queue, **kw)


def sha(name: str) -> bytes:
    return SCRIPTS[name].sha.encode()


def test_drop_while_waiting_for_the_plan(
    proxy: FaultProxy, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    # Before: ConnectionLost from session.wait_for_plan's BLPOP killed the trainer.
    proxy.drop_on(b"BLPOP", times=2)
    out: dict[str, Any] = {}

    def first_epoch() -> None:
        try:
            with trainer(proxy.url, queue_name) as stream:
                out["epoch"] = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
        except BaseException as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=first_epoch, daemon=True)
    t.start()
    wait_until(lambda: proxy.pending() == 0, what="both drops during the plan wait")
    producer_thread(numbered(EXAMPLES, BATCH))
    t.join(timeout=30)
    assert not t.is_alive()
    assert "error" not in out, out.get("error")
    assert out["epoch"] == reference()


@pytest.mark.parametrize("after", [False, True])
def test_drop_during_the_claim(
    proxy: FaultProxy, queue_name: str, producer_thread: Callable[..., Any], after: bool
) -> None:
    # after=True: the claim ran and its reply was lost; the retry must not start a second
    # run (that would drop what the producers pushed) nor conflict with itself.
    producer_thread(numbered(EXAMPLES, BATCH))
    proxy.drop_on(sha("claim"), times=1, after=after)
    with trainer(proxy.url, queue_name) as stream:
        served = [examples_of(f) for _ in range(2) for f, _ in stream.get_epoch_iterator()]
    assert served == reference(2)
    assert proxy.pending() == 0


@pytest.mark.parametrize("after", [False, True])
def test_drop_during_resume(
    proxy: FaultProxy,
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Any],
    after: bool,
) -> None:
    producer_thread(numbered(EXAMPLES, BATCH))
    with trainer(redis_url, queue_name) as stream:
        it = stream.get_epoch_iterator()
        seen = [examples_of(next(it)[0]) for _ in range(2)]
        state = stream.state_dict()
    proxy.drop_on(sha("resume"), times=1, after=after)
    with trainer(proxy.url, queue_name) as stream:
        stream.load_state_dict(state)
        rest = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
    assert proxy.pending() == 0
    assert seen + rest == reference()


def test_drop_during_close_finished_still_finishes(
    proxy: FaultProxy,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
) -> None:
    # Before: ConnectionLost from close(finished=True); the producers kept serving.
    producer = producer_thread(numbered(EXAMPLES, BATCH))
    stream = trainer(proxy.url, queue_name)
    assert [examples_of(f) for f, _ in stream.get_epoch_iterator()] == reference()
    proxy.drop_on(sha("claim"), times=1, after=True)
    stream.close(finished=True)
    assert proxy.pending() == 0
    assert redis_client.hget(QueueKeys(queue_name).meta, "finished") == b"1"
    wait_until(lambda: producer._stop.is_set(), what="the producer to see the finished run")


def test_close_finished_after_loading_a_finished_state(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
) -> None:
    # Point 5: a job killed after its last batch but before close, then restarted: it
    # loads its state and closes with finished=True without iterating. Before: nothing
    # was sent, the run was never marked finished, and the producers served for ever.
    producer = producer_thread(numbered(EXAMPLES, BATCH))
    stream = trainer(redis_url, queue_name)
    list(stream.get_epoch_iterator())
    state = stream.state_dict()
    stream._reader.stop()  # type: ignore[union-attr]  # killed: no close
    restarted = trainer(redis_url, queue_name)
    restarted.load_state_dict(state)
    restarted.close(finished=True)
    assert redis_client.hget(QueueKeys(queue_name).meta, "finished") == b"1"
    wait_until(lambda: producer._stop.is_set(), what="the producer to see the finished run")


def test_redis_killed_and_restarted_while_waiting_for_the_plan(
    tmp_path: Any, queue_name: str
) -> None:
    # kill -9 of redis-server while the first iterator waits for a producer's plan, then
    # a restart (empty) on the same port: the trainer claims again and serves the epoch.
    from batchq.host.embedded import EmbeddedRedis
    from producer import Producer

    with EmbeddedRedis(workdir=str(tmp_path / "redis")) as server:
        out: dict[str, Any] = {}

        def first_epoch() -> None:
            try:
                with trainer(server.url, queue_name, timeout_s=30) as stream:
                    out["epoch"] = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
            except BaseException as e:  # handed to the test
                out["error"] = e

        t = threading.Thread(target=first_epoch, daemon=True)
        t.start()
        client = redis.Redis.from_url(server.url)
        wait_until(lambda: client.hget(QueueKeys(queue_name).meta, "claim"), what="a claim")
        client.close()
        server.kill()
        server.restart(wipe=True)
        producer = Producer(numbered(EXAMPLES, BATCH), server.url, queue_name, hwm=4)
        serving = threading.Thread(target=producer.serve, daemon=True)
        serving.start()
        try:
            t.join(timeout=40)
        finally:
            producer.stop()
            serving.join(timeout=10)
        assert not t.is_alive()
        assert "error" not in out, out.get("error")
        assert out["epoch"] == reference()

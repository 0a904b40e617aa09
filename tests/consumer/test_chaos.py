"""Seeded, bounded fault soaks on the real redis-server (issue 11): every epoch exact.

The trainer connects through the loopback fault proxy, which drops all its connections
or stalls them at seeded moments while producer processes serve; a lost pop reply is
not counted twice in ``popped_bytes``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from faultproxy import FaultProxy
from pipelines import examples_of, numbered

from batchq.protocol.calls import SCRIPTS
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream
from consumer.reader.thread import Reader

EXAMPLES, BATCH = 200, 10


@pytest.fixture
def proxy(redis_url: str) -> Iterator[FaultProxy]:
    port = urlsplit(redis_url).port
    assert port is not None
    p = FaultProxy(port, seed=11)
    try:
        yield p
    finally:
        p.close()


def reference(epochs: int) -> list[list[list[int]]]:
    local = numbered(EXAMPLES, BATCH)
    return [[examples_of(f) for f, _ in local.get_epoch_iterator()] for _ in range(epochs)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [11, 12])
def test_drops_and_stalls_while_serving_keep_every_epoch_exact(
    proxy: FaultProxy,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    seed: int,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=5)
    for _ in range(2):
        spawn_proc(serve_argv("--hwm", "4", "--heartbeat-ttl-s", "2"), env=env)
    rng = random.Random(seed)
    halt = threading.Event()
    faults: list[str] = []

    def chaos() -> None:
        while len(faults) < 12 and not halt.wait(rng.uniform(0.05, 0.3)):
            if rng.random() < 0.6:
                proxy.drop_all()
                faults.append("drop")
            else:
                proxy.stall()
                halt.wait(rng.uniform(0.05, 0.4))
                proxy.resume()
                faults.append("stall")

    expected = reference(3)
    thread = threading.Thread(target=chaos, daemon=True)
    with ServerDataStream(
        ("features", "targets"), url=proxy.url, queue=queue_name, timeout_s=30, stall_s=1.0
    ) as stream:
        thread.start()
        try:
            for e in range(3):
                assert [examples_of(f) for f, _ in stream.get_epoch_iterator()] == expected[e]
        finally:
            halt.set()
            proxy.resume()
            thread.join(timeout=10)
        stream.close(finished=True)
    assert faults  # the soak really injected faults


def test_a_lost_pop_reply_does_not_count_bytes_twice(
    proxy: FaultProxy,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the bytes of the previous pop were sent again with the retried pop.
    received = [0]
    file = Reader._file

    def counting(self: Reader, fetched: list[tuple[bytes | None, bytes, str]]) -> None:
        received[0] += sum(len(raw) for raw, _, _ in fetched if raw is not None)
        file(self, fetched)

    monkeypatch.setattr(Reader, "_file", counting)
    producer_thread(numbered(60, 10))
    stream = ServerDataStream(
        ("features", "targets"), url=proxy.url, queue=queue_name, timeout_s=20, stall_s=0.5
    )
    it = stream.get_epoch_iterator()
    got = [examples_of(next(it)[0]) for _ in range(2)]
    proxy.drop_on(SCRIPTS["pop"].sha.encode(), times=1, after=True)
    got += [examples_of(f) for f, _ in it]
    stream.close(finished=True)
    assert proxy.pending() == 0
    assert got == [examples_of(f) for f, _ in numbered(60, 10).get_epoch_iterator()]
    popped = int(redis_client.hget(QueueKeys(queue_name).stats, "popped_bytes") or 0)
    assert popped <= received[0]

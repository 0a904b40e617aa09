"""A killed producer is told by its closed connections, not its heartbeat TTL (issue 11).

Each producer records the CLIENT ID of its connections; a waiting trainer reaps those
whose ids are all gone from CLIENT LIST. A hung producer (SIGSTOP) keeps its sockets
open and is left to the TTL. No timings are asserted: the proof is which path reaped
(the ``reaped_closed`` counter) with a TTL far longer than the run would survive.
"""

from __future__ import annotations

import random
import signal
from typing import Any

import pytest
import redis
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.protocol.keys import QueueKeys
from batchq.protocol.reaper import connected_ids, reap_gone
from consumer import ServerDataStream

EXAMPLES, BATCH = 200, 10


def reference(epochs: int) -> list[list[list[int]]]:
    local = numbered(EXAMPLES, BATCH)
    return [[examples_of(f) for f, _ in local.get_epoch_iterator()] for _ in range(epochs)]


def trainer(url: str, queue: str, **kw: Any) -> ServerDataStream:
    # stall_s and timeout_s longer than the test's limit: only the fast path can help.
    kw.setdefault("timeout_s", 120)
    kw.setdefault("stall_s", 120)
    return ServerDataStream(("features", "targets"), url=url, queue=queue, **kw)


@pytest.mark.timeout(60)
def test_sigkilled_producers_are_reaped_by_their_closed_connections(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    keys = QueueKeys(queue_name)
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=10)
    argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "300")  # the TTL never helps
    procs = [spawn_proc(argv, env=env) for _ in range(3)]
    rng = random.Random(11)
    kill_at = sorted(rng.sample(range(3, 35), 3))
    expected = reference(2)
    seen = 0
    with trainer(redis_url, queue_name) as stream:
        for e in range(2):
            got = []
            for f, _ in stream.get_epoch_iterator():
                got.append(examples_of(f))
                seen += 1
                if kill_at and seen == kill_at[0]:
                    kill_at.pop(0)
                    victim = procs.pop(rng.randrange(len(procs)))
                    victim.send_signal(signal.SIGKILL)
                    victim.wait(timeout=10)
                    procs.append(spawn_proc(argv, env=env))
            assert got == expected[e]
        stream.close(finished=True)
    reaped = int(redis_client.hget(keys.stats, "reaped_closed") or 0)
    # Every kill but possibly the last (the run may end first) is told by closed sockets.
    assert 1 <= reaped <= 3


def test_a_stopped_producer_keeps_its_connections_and_is_not_reaped(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    keys = QueueKeys(queue_name)
    env = serve_env(examples=EXAMPLES, batch_size=BATCH)
    proc = spawn_proc(serve_argv("--hwm", "2", "--heartbeat-ttl-s", "300"), env=env)
    wait_until(lambda: redis_client.hlen(keys.clients) >= 2, what="both ids recorded")
    proc.send_signal(signal.SIGSTOP)
    try:
        incarnation = redis_client.get(keys.incarnation)
        assert incarnation is not None
        assert reap_gone(redis_client, keys, incarnation.decode()) == (0, 0)
        assert redis_client.zcard(keys.producers) == 1
    finally:
        proc.send_signal(signal.SIGCONT)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    ids = {int(v) for v in redis_client.hvals(keys.clients)}
    wait_until(lambda: not ids & (connected_ids(redis_client) or set()), what="sockets closed")
    assert reap_gone(redis_client, keys, incarnation.decode())[0] == 1  # type: ignore[index]
    assert redis_client.zcard(keys.producers) == 0
    assert redis_client.hlen(keys.clients) == 0

"""batchq.client.held: the owner thread's round trips reuse its connection without the pool's
checks, and the client still keeps one connection (a failure half-way:
tests/batchq/protocol/test_calls.py)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import redis

from batchq.client import held, redis_internals
from batchq.client.connection import make_client
from batchq.errors import ConnectionLost
from batchq.protocol.calls import round_trip


def _client_id(client: redis.Redis) -> int:
    reply: Any = round_trip(client, [("CLIENT", "ID")], "testing")[0]
    return int(reply)


def _in_other_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=10)
    assert out, "the other thread's call did not finish"
    return out[0]


def test_the_owner_and_redis_py_share_one_connection(redis_url: str) -> None:
    client = make_client(redis_url)
    try:
        held.hold(client)
        mine = _client_id(client)
        assert _client_id(client) == mine
        assert int(client.client_id()) == mine  # redis-py's own commands reuse it
        assert _in_other_thread(lambda: _client_id(client)) == mine  # idle: anyone's
        pool: Any = client.connection_pool
        assert len(pool._available_connections) == 1 and not pool._in_use_connections
        held.release(client)
        held.release(client)  # idempotent
        assert _client_id(client) == mine
    finally:
        held.release(client)
        client.close()


def test_the_owner_takes_another_connection_while_another_thread_has_its_own(
    redis_url: str,
) -> None:
    client = make_client(redis_url)
    held.hold(client)
    try:
        mine = _client_id(client)
        pool: Any = client.connection_pool
        taken = pool.get_connection()  # what another thread would be using now
        taken.send_command("CLIENT", "ID")
        assert int(taken.read_response()) == mine
        other = _client_id(client)
        assert other != mine  # never the connection someone else is reading from
        pool.release(taken)
        assert _client_id(client) == other  # its last one, from now on
    finally:
        held.release(client)
        client.close()


def test_a_killed_held_connection_is_lost_once_then_reconnects(
    redis_url: str, redis_client: redis.Redis
) -> None:
    client = make_client(redis_url)
    held.hold(client)
    try:
        mine = _client_id(client)
        redis_client.client_kill_filter(_id=mine)
        with pytest.raises(ConnectionLost):
            round_trip(client, [("PING",)], "testing")
        assert round_trip(client, [("PING",)], "testing") == [b"PONG"]
    finally:
        held.release(client)
        client.close()


def test_a_forked_child_uses_the_pool_as_usual(redis_url: str) -> None:
    client = make_client(redis_url)
    held.hold(client)
    try:
        _client_id(client)
        pid = os.fork()
        if pid == 0:  # the child only asks which way it would go, then leaves
            os.setpgid(0, 0)
            _conn, direct = redis_internals.borrow(client)
            os._exit(1 if direct else 0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        conn, direct = redis_internals.borrow(client)
        assert direct  # the parent goes on directly
        redis_internals.give_back(client, conn, direct)
    finally:
        held.release(client)
        client.close()


def test_a_pool_of_another_kind_is_used_the_usual_way(redis_url: str) -> None:
    client = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(redis_url))
    held.hold(client)
    try:
        mine = _client_id(client)
        conn, direct = redis_internals.borrow(client)
        assert not direct  # no idle list to move it out of: lent and released by the pool
        redis_internals.give_back(client, conn, direct)
        assert _client_id(client) == mine
    finally:
        held.release(client)
        client.connection_pool.disconnect()
        client.close()
